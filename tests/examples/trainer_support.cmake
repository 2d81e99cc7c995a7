# SPDX-License-Identifier: Apache-2.0
# Shared by the trainer tests (run_trainer.cmake, run_gpt_trainer.cmake): run TRAINER with `common`
# and more flags and read its JSON summary line (and `output`, all it printed); compare checkpoints' tensor bytes and losses.

# Runs the trainer with `common` and ARGN, under `launcher` (e.g. an mpirun command line) when that
# is set; sets `summary` to its last output line, which must be JSON.
function(run_trainer)
  string(REPLACE ";" " " shown "${ARGN}")
  string(TIMESTAMP started "%s")
  execute_process(COMMAND ${launcher} "${TRAINER}" ${common} ${ARGN} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  string(TIMESTAMP ended "%s")
  math(EXPR seconds "${ended} - ${started}")
  get_filename_component(name "${TRAINER}" NAME)
  message("$ ${name} ... ${shown}  [${seconds} s]\n${out}${err}")
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "${name} ${shown} exited ${rc}")
  endif()
  string(STRIP "${out}" out)
  string(REGEX MATCH "[^\n]*$" last "${out}")
  string(JSON type ERROR_VARIABLE json_error TYPE "${last}")
  if(json_error OR NOT type STREQUAL "OBJECT")
    message(FATAL_ERROR "the last line of the output is not a JSON object: '${last}' (${json_error})")
  endif()
  set(summary "${last}" PARENT_SCOPE)
  set(output "${out}${err}" PARENT_SCOPE)
endfunction()

# The tensor bytes of a safetensors file as hex: everything after the 8-byte length and the header.
function(tensor_bytes path out_var)
  file(READ "${path}" length_hex LIMIT 8 HEX)
  set(header_size 0)
  foreach(i RANGE 7 0 -1)  # little-endian u64
    math(EXPR at "${i} * 2")
    string(SUBSTRING "${length_hex}" ${at} 2 byte)
    math(EXPR header_size "${header_size} * 256 + 0x${byte}")
  endforeach()
  math(EXPR offset "8 + ${header_size}")
  file(READ "${path}" data OFFSET ${offset} HEX)
  set(${out_var} "${data}" PARENT_SCOPE)
endfunction()

# Fails unless checkpoints `a` and `b` (path prefixes) hold the same model and optimizer tensors,
# byte for byte: what a bit-exact resume must give.
function(expect_same_tensors a b)
  foreach(file safetensors state.safetensors)
    tensor_bytes("${a}.${file}" a_bytes)
    tensor_bytes("${b}.${file}" b_bytes)
    if(NOT a_bytes STREQUAL b_bytes)
      message(FATAL_ERROR "${a}.${file} and ${b}.${file} hold different tensors: the resume is not bit-exact")
    endif()
  endforeach()
endfunction()

# A non-negative decimal such as 5.0393136 as an integer count of millionths (5039313): CMake's
# arithmetic is integral.
function(millionths value out_var)
  if(NOT value MATCHES "^([0-9]+)(\\.([0-9]*))?$")
    message(FATAL_ERROR "'${value}' is not a plain non-negative decimal")
  endif()
  set(whole "${CMAKE_MATCH_1}")
  string(SUBSTRING "${CMAKE_MATCH_3}000000" 0 6 fraction)
  string(REGEX MATCH "[1-9][0-9]*$" fraction "${fraction}")  # no leading zeros; empty for 0
  if(fraction STREQUAL "")
    set(fraction 0)
  endif()
  math(EXPR result "${whole} * 1000000 + ${fraction}")
  set(${out_var} ${result} PARENT_SCOPE)
endfunction()

# Fails unless |a - b| <= b * ppm / 1e6 (to a millionth of a unit): `what` names the quantity.
function(expect_close what a b ppm)
  millionths("${a}" a_u)
  millionths("${b}" b_u)
  math(EXPR diff "${a_u} - ${b_u}")
  if(diff LESS 0)
    math(EXPR diff "-(${diff})")
  endif()
  math(EXPR bound "${b_u} * ${ppm} / 1000000 + 1")
  if(diff GREATER bound)
    message(FATAL_ERROR "${what}: ${a} against ${b}, more than ${ppm} parts per million apart")
  endif()
endfunction()

# Post-validation changes how steps overlap, never what they compute: a run with `--post-validation 4`
# and a plain run (both with `common`) must save the same tensor bytes and report the same
# `loss_key` in their summaries, and the first must report its rollbacks.
function(expect_post_validation_bitwise loss_key)
  run_trainer(--post-validation 4 --save "${WORK_DIR}/overlapped")
  string(JSON rollbacks ERROR_VARIABLE missing GET "${summary}" post_validation_rollbacks)
  if(missing)
    message(FATAL_ERROR "the summary has no 'post_validation_rollbacks': ${summary}")
  endif()
  string(JSON overlapped_loss GET "${summary}" ${loss_key})
  run_trainer(--save "${WORK_DIR}/plain")
  string(JSON plain_loss GET "${summary}" ${loss_key})
  expect_same_tensors("${WORK_DIR}/overlapped" "${WORK_DIR}/plain")
  if(NOT overlapped_loss STREQUAL plain_loss)
    message(FATAL_ERROR "${loss_key} ${overlapped_loss} with --post-validation 4 but ${plain_loss} without")
  endif()
  message("post-validation is bit-exact: equal model and optimizer tensors, ${loss_key} ${plain_loss}, ${rollbacks} rollbacks")
endfunction()

# The last summary (run_trainer's) is a --plan auto run's: it names a schedule matching `pattern` and
# a positive predicted step time; sets planned_schedule in the caller.
function(expect_planned_schedule pattern)
  string(JSON planned GET "${summary}" schedule)
  string(JSON predicted GET "${summary}" step_seconds_predicted)
  if(NOT planned MATCHES "${pattern}" OR NOT predicted GREATER 0)
    message(FATAL_ERROR "--plan auto chose '${planned}' (predicted ${predicted} s), expected ${pattern}: ${summary}")
  endif()
  set(planned_schedule "${planned}" PARENT_SCOPE)
endfunction()
