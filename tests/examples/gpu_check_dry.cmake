# SPDX-License-Identifier: Apache-2.0
# scripts/gpu_check.sh without a GPU, against stand-ins for nvidia-smi, nvcc and cmake on PATH: what a
# lease with a limit per call depends on, checked where CI runs.
#   cmake -DSCRIPT=<scripts/gpu_check.sh> -DWORK_DIR=<scratch folder> -P gpu_check_dry.cmake
# 1. Steps run in the order --steps gives (the build first): with no programs built, test, torch and
#    gpt each record a skip, in that order; the run passes, and --pack holds the report.
# 2. --deadline 30 (15 s kept for the report) with --steps gpt,build: the build comes first; the
#    stand-in configure, which sleeps 60 s, is stopped at the deadline (DEADLINE) 15 s in, the build
#    and gpt after it are skipped ("deadline"), the run fails, the report and the pack are still
#    written, and the whole run ends within 25 s.
cmake_minimum_required(VERSION 3.19)
file(REMOVE_RECURSE "${WORK_DIR}")
set(bin "${WORK_DIR}/bin")
file(MAKE_DIRECTORY "${bin}" "${WORK_DIR}/empty_build")
file(WRITE "${bin}/nvidia-smi" "#!/bin/sh\necho 'stand-in GPU, 0.0, 1 MiB, 1 MHz, 1 W'\n")
file(WRITE "${bin}/nvcc" "#!/bin/sh\necho 'Cuda compilation tools, release 0.0, V0.0.0'\n")
# The configure step sleeps; `cmake --version`, `cmake --build DIR --target help` (the NCCL probe) and
# the build answer at once.
file(WRITE "${bin}/cmake" "#!/bin/sh\ncase \"$*\" in --version) echo 'cmake version 0.0' ;; *--build*) ;; *) exec sleep 60 ;; esac\n")
foreach(tool nvidia-smi nvcc cmake)
  file(CHMOD "${bin}/${tool}" PERMISSIONS OWNER_READ OWNER_WRITE OWNER_EXECUTE GROUP_READ GROUP_EXECUTE)
endforeach()
set(path "${bin}:$ENV{PATH}")

include(${CMAKE_CURRENT_LIST_DIR}/gpu_check_support.cmake)

function(check_pack pack)
  file(MAKE_DIRECTORY "${pack}.unpacked")
  execute_process(COMMAND ${CMAKE_COMMAND} -E tar xzf "${pack}" WORKING_DIRECTORY "${pack}.unpacked" RESULT_VARIABLE rc)
  file(GLOB report "${pack}.unpacked/*/report.md")
  if(NOT rc EQUAL 0 OR NOT report)
    message(FATAL_ERROR "${pack} does not unpack to a folder holding report.md")
  endif()
endfunction()

# 1. The order of --steps, and the pack.
check_run("order" 0 --steps test,torch,gpt --build "${WORK_DIR}/empty_build" --out "${WORK_DIR}/order"
          --pack "${WORK_DIR}/order.tgz" --label dry)
read_steps("${WORK_DIR}/order" steps)
if(NOT steps STREQUAL "test=SKIP;torch=SKIP;gpt=SKIP")
  message(FATAL_ERROR "order: expected the steps test, torch, gpt, each skipped, in that order; steps.tsv says ${steps}")
endif()
check_pack("${WORK_DIR}/order.tgz")

# 2. The deadline.
string(TIMESTAMP t0 "%s")
check_run("deadline" 1 --steps gpt,build --build "${WORK_DIR}/deadline_build" --out "${WORK_DIR}/deadline" --deadline 30
          --pack "${WORK_DIR}/deadline.tgz" --label dry)
string(TIMESTAMP t1 "%s")
math(EXPR took "${t1} - ${t0}")
read_steps("${WORK_DIR}/deadline" steps)
if(NOT steps STREQUAL "configure=DEADLINE;build=SKIP;gpt=SKIP")
  message(FATAL_ERROR "deadline: expected configure stopped at the deadline, then build and gpt skipped; steps.tsv says ${steps}")
endif()
if(NOT why_build MATCHES "^deadline: 30 s" OR NOT why_gpt MATCHES "^deadline: 30 s")
  message(FATAL_ERROR "deadline: the skips do not give the deadline as their reason: '${why_build}', '${why_gpt}'")
endif()
if(took GREATER 25)
  message(FATAL_ERROR "deadline: a run with --deadline 30 took ${took} s")
endif()
check_pack("${WORK_DIR}/deadline.tgz")
message("gpu_check.sh runs its steps in the order given, keeps a deadline of 30 s (${took} s) and packs its report")
