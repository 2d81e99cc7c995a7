# SPDX-License-Identifier: Apache-2.0
# scripts/gpu_check.sh --prebuilt without a GPU, against stand-ins for nvidia-smi, nvcc and cmake and
# stand-in packs laid out as scripts/gpu_pack.sh lays them out (gpu-pack/{build,lib,data}, .tar.xz):
#   cmake -DSCRIPT=<scripts/gpu_check.sh> -DWORK_DIR=<scratch folder> -P gpu_check_prebuilt.cmake
# 1. A pack whose programs start: no configure and no build (the stand-in cmake would leave a mark),
#    the step `prebuilt` passes, the tests and the GPT rows run the packed programs, and they see the
#    pack's lib/ on LD_LIBRARY_PATH.
# 2. A pack whose programs do not start (a missing shared library): `prebuilt` is FALLBACK with the
#    loader's words, and the script builds as without --prebuilt (configure and build run).
cmake_minimum_required(VERSION 3.19)
file(REMOVE_RECURSE "${WORK_DIR}")
set(bin "${WORK_DIR}/bin")
file(MAKE_DIRECTORY "${bin}")
set(exec_permissions OWNER_READ OWNER_WRITE OWNER_EXECUTE GROUP_READ GROUP_EXECUTE)
file(WRITE "${bin}/nvidia-smi" "#!/bin/sh\necho 'stand-in GPU, 0.0, 1 MiB, 1 MHz, 1 W'\n")
file(WRITE "${bin}/nvcc" "#!/bin/sh\necho 'Cuda compilation tools, release 0.0, V0.0.0'\n")
# Any configure or build leaves a mark (one line per call) and succeeds at once.
file(WRITE "${bin}/cmake" "#!/bin/sh\ncase \"$*\" in --version) echo 'cmake version 0.0' ;; *'--target help'*) ;; *) echo \"$*\" >>'${WORK_DIR}/cmake_calls' ;; esac\n")
foreach(tool nvidia-smi nvcc cmake)
  file(CHMOD "${bin}/${tool}" PERMISSIONS ${exec_permissions})
endforeach()
set(path "${bin}:$ENV{PATH}")

# make_pack(name program_body): gpu-pack/ with the two programs the script probes and runs, as
# shell scripts with the given body, packed into name.tar.xz.
function(make_pack name body)
  set(pack "${WORK_DIR}/${name}/gpu-pack")
  file(MAKE_DIRECTORY "${pack}/build/tests/cuda" "${pack}/build/bench/gpt_step" "${pack}/lib")
  file(WRITE "${pack}/manifest.txt" "commit: stand-in-${name}\n")
  foreach(program tests/cuda/test_cuda_ops bench/gpt_step/bench_gpt_step)
    file(WRITE "${pack}/build/${program}" "#!/bin/sh\n${body}\n")
    file(CHMOD "${pack}/build/${program}" PERMISSIONS ${exec_permissions})
  endforeach()
  execute_process(COMMAND ${CMAKE_COMMAND} -E tar cJf "${WORK_DIR}/${name}.tar.xz" gpu-pack
                  WORKING_DIRECTORY "${WORK_DIR}/${name}" RESULT_VARIABLE rc)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "could not pack ${name}")
  endif()
endfunction()

include(${CMAKE_CURRENT_LIST_DIR}/gpu_check_support.cmake)

# 1. Programs that start: each prints the library path it was given and passes.
make_pack(good "echo \"LD_LIBRARY_PATH=\$LD_LIBRARY_PATH\"\necho '{\"tokens_per_second\":1}'\nexit 0")
check_run("good pack" 0 --prebuilt "${WORK_DIR}/good.tar.xz" --steps build,test,gpt --build "${WORK_DIR}/unused_build"
          --out "${WORK_DIR}/good_out" --label prebuilt)
if(EXISTS "${WORK_DIR}/cmake_calls")
  file(READ "${WORK_DIR}/cmake_calls" calls)
  message(FATAL_ERROR "good pack: gpu_check.sh configured or built although the packed programs start:\n${calls}")
endif()
read_steps("${WORK_DIR}/good_out" steps)
list(GET steps 0 first)
list(GET steps 1 second)
if(NOT first STREQUAL "prebuilt=PASS" OR NOT second STREQUAL "test=PASS" OR NOT "gpt_bf16=PASS" IN_LIST steps)
  message(FATAL_ERROR "good pack: expected prebuilt, test and the GPT rows to pass on the packed programs; steps.tsv says ${steps}")
endif()
if(NOT why_prebuilt MATCHES "stand-in-good")
  message(FATAL_ERROR "good pack: the prebuilt step does not name the pack's commit: '${why_prebuilt}'")
endif()
file(READ "${WORK_DIR}/good_out/test.log" test_log)
if(NOT test_log MATCHES "LD_LIBRARY_PATH=[^\n]*gpu-pack/lib")
  message(FATAL_ERROR "good pack: the packed test did not get the pack's lib/ on LD_LIBRARY_PATH:\n${test_log}")
endif()

# 2. Programs that do not start: the loader's complaint, then a build here.
make_pack(broken "echo \"\$0: error while loading shared libraries: libstandin.so.1: cannot open shared object file\" >&2\nexit 127")
check_run("broken pack" 0 --prebuilt "${WORK_DIR}/broken.tar.xz" --steps build,test --build "${WORK_DIR}/fallback_build"
          --out "${WORK_DIR}/broken_out" --label prebuilt)
read_steps("${WORK_DIR}/broken_out" steps)
if(NOT steps STREQUAL "prebuilt=FALLBACK;configure=PASS;build=PASS;test=SKIP")
  message(FATAL_ERROR "broken pack: expected prebuilt to fail, then configure and build here; steps.tsv says ${steps}")
endif()
if(NOT why_prebuilt MATCHES "building here instead: .*libstandin.so.1")
  message(FATAL_ERROR "broken pack: the prebuilt step does not say why: '${why_prebuilt}'")
endif()
if(NOT EXISTS "${WORK_DIR}/cmake_calls")
  message(FATAL_ERROR "broken pack: gpu_check.sh did not build after the packed programs failed to start")
endif()
message("gpu_check.sh --prebuilt runs packed programs without building, and builds when they do not start")
