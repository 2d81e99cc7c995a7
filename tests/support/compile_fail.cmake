# SPDX-License-Identifier: Apache-2.0
# Usage: cmake -DCOMPILER=... -DSOURCE=... -DINCLUDE=... -DEXPECT=regex [-DMAX_ERRORS=n] -P compile_fail.cmake
# MAX_ERRORS: at most this many `error:` lines (one mistake, one sentence: no cascade after it).
execute_process(
  COMMAND ${COMPILER} -std=c++20 -fsyntax-only -I${INCLUDE} -I${EXTRA_INCLUDE} ${SOURCE}
  RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
if(rc EQUAL 0)
  message(FATAL_ERROR "expected ${SOURCE} to fail to compile, but it compiled")
endif()
if(NOT "${out}${err}" MATCHES "${EXPECT}")
  message(FATAL_ERROR "compilation failed, but without the expected message '${EXPECT}':\n${out}${err}")
endif()
if(DEFINED MAX_ERRORS AND NOT MAX_ERRORS STREQUAL "")
  string(REGEX MATCHALL "error:" errors "${out}${err}")
  list(LENGTH errors count)
  if(count GREATER MAX_ERRORS)
    message(FATAL_ERROR "compilation failed with the expected message, but with ${count} errors (at most ${MAX_ERRORS}):\n${out}${err}")
  endif()
endif()
message(STATUS "failed to compile as expected, with: ${EXPECT}")
