# SPDX-License-Identifier: Apache-2.0
# What the stand-in runs of scripts/gpu_check.sh share (gpu_check_dry.cmake, gpu_check_prebuilt.cmake):
#   check_run(label expected_rc args...)  runs the script with the stand-ins' PATH (${path}) and no GPU
#                                         for PyTorch; fails the test on another exit status
#   read_steps(out_dir var)               "name=STATUS" per row of steps.tsv; why_<name> holds each
#                                         row's last column
function(check_run label expect_rc)
  # No GPU for PyTorch either, where the machine has one: its steps would run.
  execute_process(COMMAND ${CMAKE_COMMAND} -E env "PATH=${path}" CUDA_VISIBLE_DEVICES= bash "${SCRIPT}" ${ARGN}
                  RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err TIMEOUT 60)
  message("$ gpu_check.sh ${ARGN}\n${out}${err}")
  if(NOT rc STREQUAL "${expect_rc}")
    message(FATAL_ERROR "${label}: gpu_check.sh exited '${rc}', expected ${expect_rc}")
  endif()
endfunction()

function(read_steps out_dir out_var)
  if(NOT EXISTS "${out_dir}/steps.tsv" OR NOT EXISTS "${out_dir}/report.md")
    message(FATAL_ERROR "no steps.tsv or report.md in ${out_dir}")
  endif()
  file(STRINGS "${out_dir}/steps.tsv" rows)
  set(summary "")
  foreach(row IN LISTS rows)
    string(REPLACE "\t" ";" cells "${row}")
    list(GET cells 0 name)
    list(GET cells 1 status)
    list(GET cells 3 why)
    list(APPEND summary "${name}=${status}")
    set(why_${name} "${why}" PARENT_SCOPE)
  endforeach()
  set(${out_var} "${summary}" PARENT_SCOPE)
endfunction()
