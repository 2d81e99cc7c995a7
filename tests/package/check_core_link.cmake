# SPDX-License-Identifier: Apache-2.0
# cmake -DBUILD_DIR=... -P check_core_link.cmake: runs the core-only consumer, then fails if its link
# command names BLAS, zlib, json or pthread.
execute_process(COMMAND ${BUILD_DIR}/core_consumer RESULT_VARIABLE rc)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "core_consumer exited with ${rc}")
endif()
set(link "")
if(EXISTS ${BUILD_DIR}/build.ninja)
  file(STRINGS ${BUILD_DIR}/build.ninja link REGEX "LINK_(LIBRARIES|FLAGS)")
elseif(EXISTS ${BUILD_DIR}/CMakeFiles/core_consumer.dir/link.txt)
  file(READ ${BUILD_DIR}/CMakeFiles/core_consumer.dir/link.txt link)
else()
  message(FATAL_ERROR "no link command found under ${BUILD_DIR}")
endif()
if(link MATCHES "(blas|libz\\.|-lz( |$)|json|pthread)")
  message(FATAL_ERROR "core_consumer links ${CMAKE_MATCH_1}: ${link}")
endif()
message(STATUS "core_consumer links nothing but the C++ runtime")
