# SPDX-License-Identifier: Apache-2.0
# Runs a command that must succeed: exit status 0 AND output matching EXPECT (and not FAIL, if given).
#   cmake -DCOMMAND=<program;args...> -DEXPECT=<regex> [-DFAIL=<regex>] [-DSKIP=<regex>] -P expect_success.cmake
# ctest's PASS_REGULAR_EXPRESSION alone ignores the exit status, so a test that printed "PASS" and then
# crashed, or whose ranks all exited 1 under a sanitizer, would pass. Output matching SKIP prints
# "SKIPPED: ..." (for ctest's SKIP_REGULAR_EXPRESSION) whatever the status.
cmake_minimum_required(VERSION 3.19)
execute_process(COMMAND ${COMMAND} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE out)
string(REPLACE ";" " " shown "${COMMAND}")
message("${out}")
if(DEFINED SKIP AND out MATCHES "${SKIP}")
  message("SKIPPED: output matched '${SKIP}'")
  return()
endif()
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "'${shown}' exited with status ${rc}, expected 0")
endif()
if(DEFINED FAIL AND out MATCHES "${FAIL}")
  message(FATAL_ERROR "'${shown}' exited 0 but its output matches '${FAIL}'")
endif()
if(NOT out MATCHES "${EXPECT}")
  message(FATAL_ERROR "'${shown}' exited 0 but its output does not match '${EXPECT}'")
endif()
