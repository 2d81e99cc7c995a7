# SPDX-License-Identifier: Apache-2.0
# Runs mpi_fault_check under mpirun and checks what every healthy rank reported.
#   cmake -DCOMMAND=<mpirun;...;mpi_fault_check;--fault;F;--timeout;T;--report;DIR> -DREPORT=<DIR>
#         -DHEALTHY=<rank;rank...> -DEXPECT=<regex> -DTIMEOUT=<s> -DMIN_WAIT=<s> -DMAX_WAIT=<s>
#         -DMAX_CPU_FRACTION=<f> [-DLAUNCHER_KEEPS_GOING=ON] -P check_fault_reports.cmake
# Passes when the job exits non-zero, and each healthy rank wrote DIR/rank-R.txt saying it failed
# after between MIN_WAIT and MAX_WAIT seconds with an error matching EXPECT (one line), having used
# at most MAX_CPU_FRACTION of that time on the CPU (it slept while it waited, it did not spin).
cmake_minimum_required(VERSION 3.19)
file(REMOVE_RECURSE "${REPORT}")
file(MAKE_DIRECTORY "${REPORT}")
execute_process(COMMAND ${COMMAND} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE out TIMEOUT ${TIMEOUT})
string(REPLACE ";" " " shown "${COMMAND}")
message("${shown}\n-> ${rc}\n${out}")
# With orte_abort_on_non_zero_status 0, OpenMPI's mpirun exits 0 whatever its ranks return; the
# program writes a report only on its way to exit(1), so each report stands for a failed rank.
if(rc EQUAL 0 AND NOT LAUNCHER_KEEPS_GOING)
  message(FATAL_ERROR "the job exited 0; every healthy rank should have failed")
endif()
if(rc MATCHES "timeout")
  message(FATAL_ERROR "the job hung: still running after ${TIMEOUT} s")
endif()
foreach(rank IN LISTS HEALTHY)
  set(file "${REPORT}/rank-${rank}.txt")
  if(NOT EXISTS "${file}")
    message(FATAL_ERROR "rank ${rank} wrote no report: it did not notice the fault by itself")
  endif()
  file(STRINGS "${file}" lines)
  list(LENGTH lines count)
  list(GET lines 0 times)
  if(NOT count EQUAL 2 OR NOT times MATCHES "^wall ([0-9.e+-]+) cpu ([0-9.e+-]+)$")
    message(FATAL_ERROR "rank ${rank}: the report is not 'wall W cpu C' and a one-line error:\n${lines}")
  endif()
  set(wall "${CMAKE_MATCH_1}")
  set(cpu "${CMAKE_MATCH_2}")
  list(GET lines 1 error)
  if(NOT error MATCHES "${EXPECT}")
    message(FATAL_ERROR "rank ${rank}: the error does not match '${EXPECT}': ${error}")
  endif()
  # CMake's math() is integer-only: compare in milliseconds (the report prints 3 decimals).
  foreach(v wall cpu MIN_WAIT MAX_WAIT MAX_CPU_FRACTION)
    if(NOT "${${v}}" MATCHES "^([0-9]+)(\\.([0-9]*))?$")
      message(FATAL_ERROR "${v} is '${${v}}', not a decimal number")
    endif()
    string(SUBSTRING "${CMAKE_MATCH_3}000" 0 3 frac)
    math(EXPR ${v}_ms "${CMAKE_MATCH_1} * 1000 + 1${frac} - 1000")
  endforeach()
  math(EXPR cpu_limit_ms "${wall_ms} * ${MAX_CPU_FRACTION_ms} / 1000")
  message("rank ${rank}: waited ${wall} s, ${cpu} s of CPU (limit ${cpu_limit_ms} ms): ${error}")
  if(wall_ms LESS MIN_WAIT_ms OR wall_ms GREATER MAX_WAIT_ms)
    message(FATAL_ERROR "rank ${rank} failed after ${wall} s, outside [${MIN_WAIT}, ${MAX_WAIT}] s")
  endif()
  if(cpu_limit_ms LESS cpu_ms)
    message(FATAL_ERROR "rank ${rank} used ${cpu} s of CPU in ${wall} s of waiting: it spins")
  endif()
endforeach()
