# SPDX-License-Identifier: Apache-2.0
# Runs a command that must fail, and fail clearly: a non-zero exit and output matching a regex.
#   cmake -DCOMMAND=<program;args...> -DEXPECT=<regex> [-DMAX_LINES=n] [-DSETUP=<script>]
#         [-DREQUIRE_DIR=<dir>] [-DTIMEOUT=seconds] -P expect_failure.cmake
# MAX_LINES bounds the lines of output (stdout and stderr together): an error is one clear line,
# not a usage dump. SETUP is included first (to prepare bad input). Without REQUIRE_DIR the test
# prints "SKIPPED: ..." for ctest's SKIP_REGULAR_EXPRESSION. TIMEOUT kills a command that hangs, so
# that a test of "fails, never hangs" cannot itself hang.
cmake_minimum_required(VERSION 3.19)
if(DEFINED REQUIRE_DIR AND NOT IS_DIRECTORY "${REQUIRE_DIR}")
  message("SKIPPED: ${REQUIRE_DIR} is missing")
  return()
endif()
if(DEFINED SETUP)
  include("${SETUP}")
endif()
set(timeout_args "")
if(DEFINED TIMEOUT)
  set(timeout_args TIMEOUT ${TIMEOUT})
endif()
execute_process(COMMAND ${COMMAND} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE out ${timeout_args})
string(REPLACE ";" " " shown "${COMMAND}")
if(rc EQUAL 0)
  message(FATAL_ERROR "'${shown}' exited 0, expected a failure. Its output:\n${out}")
endif()
if(NOT out MATCHES "${EXPECT}")
  message(FATAL_ERROR "'${shown}' failed (${rc}) but its output does not match '${EXPECT}':\n${out}")
endif()
if(DEFINED MAX_LINES)
  string(STRIP "${out}" stripped)
  string(REGEX MATCHALL "\n" newlines "${stripped}")
  list(LENGTH newlines lines)
  math(EXPR lines "${lines} + 1")
  if(lines GREATER MAX_LINES)
    message(FATAL_ERROR "'${shown}' printed ${lines} lines, expected at most ${MAX_LINES}:\n${out}")
  endif()
endif()
message("'${shown}' failed (${rc}) as expected:\n${out}")
