# SPDX-License-Identifier: Apache-2.0
# cmake -DPREFIX=... -DFORBIDDEN='a|b' -P check_relocatable.cmake: fails if an installed CMake file
# names an absolute path of the machine that built it (the build, the source or a system library).
file(GLOB_RECURSE files ${PREFIX}/*.cmake)
if(NOT files)
  message(FATAL_ERROR "no CMake files installed under ${PREFIX}")
endif()
string(REPLACE "|" ";" FORBIDDEN "${FORBIDDEN}")
foreach(file IN LISTS files)
  file(READ ${file} text)
  foreach(path IN LISTS FORBIDDEN)
    string(FIND "${text}" "${path}" at)
    if(NOT at EQUAL -1)
      message(FATAL_ERROR "${file} names ${path}; the installed package must not carry paths of this machine")
    endif()
  endforeach()
endforeach()
