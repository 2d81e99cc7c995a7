# SPDX-License-Identifier: Apache-2.0
# Usage: cmake -DCOMPILER=... -DSOURCE=... -DINCLUDE=... -DEXPECT=regex -P compile_fail.cmake
execute_process(
  COMMAND ${COMPILER} -std=c++20 -fsyntax-only -I${INCLUDE} -I${EXTRA_INCLUDE} ${SOURCE}
  RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
if(rc EQUAL 0)
  message(FATAL_ERROR "expected ${SOURCE} to fail to compile, but it compiled")
endif()
if(NOT "${out}${err}" MATCHES "${EXPECT}")
  message(FATAL_ERROR "compilation failed, but without the expected message '${EXPECT}':\n${out}${err}")
endif()
message(STATUS "failed to compile as expected, with: ${EXPECT}")
