# SPDX-License-Identifier: Apache-2.0
# cmake -DCOMMAND=<;-list> -DEXPECT=<regex> -P expect_failure.cmake: the command must exit non-zero
# and print a line matching EXPECT.
execute_process(COMMAND ${COMMAND} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err TIMEOUT 100)
if(rc EQUAL 0)
  message(FATAL_ERROR "expected a failure, but the command succeeded:\n${out}${err}")
endif()
if(NOT "${out}${err}" MATCHES "${EXPECT}")
  message(FATAL_ERROR "failed (${rc}) without the expected message '${EXPECT}':\n${out}${err}")
endif()
message(STATUS "failed as expected (${rc})")
