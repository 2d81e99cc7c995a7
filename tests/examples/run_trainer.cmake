# SPDX-License-Identifier: Apache-2.0
# Runs mlp_fashion_mnist and checks its final JSON summary line.
#   cmake -DTRAINER=<path> -DDATA_DIR=<dir> -DWORK_DIR=<dir> -DMODE=learns|resume -P run_trainer.cmake
# learns: one short epoch must reach test_accuracy >= 0.6 (chance is 0.1), with every summary key.
# resume: 5 steps, save, resume for 5 more, save; against 10 straight steps, save: the two final
#         model files must hold the same tensor bytes (bit-exact resume through the command line).
# Without DATA_DIR it prints "SKIPPED: ..." for ctest's SKIP_REGULAR_EXPRESSION.
cmake_minimum_required(VERSION 3.19)
if(NOT IS_DIRECTORY "${DATA_DIR}")
  message("SKIPPED: ${DATA_DIR} is missing")
  return()
endif()
set(common --data "${DATA_DIR}" --schedule 1f1b --stages 2 --microbatches 4 --train-limit 4000 --test-limit 1000
           --progress none)

include(${CMAKE_CURRENT_LIST_DIR}/trainer_support.cmake)

file(REMOVE_RECURSE "${WORK_DIR}")
file(MAKE_DIRECTORY "${WORK_DIR}")
if(MODE STREQUAL "learns")
  run_trainer(--epochs 1)
  foreach(key test_accuracy train_loss epochs seconds samples_per_second bubble_fraction_measured schedule stages
              microbatches)
    string(JSON value ERROR_VARIABLE missing GET "${summary}" ${key})
    if(missing)
      message(FATAL_ERROR "the summary has no '${key}': ${summary}")
    endif()
  endforeach()
  string(JSON accuracy GET "${summary}" test_accuracy)
  string(JSON schedule GET "${summary}" schedule)
  string(JSON stages GET "${summary}" stages)
  if(NOT accuracy GREATER_EQUAL 0.6)
    message(FATAL_ERROR "test_accuracy ${accuracy} after one epoch on 4000 samples; expected at least 0.6 (chance: 0.1)")
  endif()
  if(NOT schedule STREQUAL "1f1b" OR NOT stages EQUAL 2)
    message(FATAL_ERROR "the summary reports schedule '${schedule}' on ${stages} stages, expected 1f1b on 2")
  endif()
  message("learned: test_accuracy ${accuracy}")
elseif(MODE STREQUAL "resume")
  run_trainer(--epochs 1 --max-steps 5 --save "${WORK_DIR}/first")
  run_trainer(--epochs 1 --max-steps 10 --resume "${WORK_DIR}/first" --save "${WORK_DIR}/resumed")
  string(JSON resumed_accuracy GET "${summary}" test_accuracy)
  run_trainer(--epochs 1 --max-steps 10 --save "${WORK_DIR}/straight")
  string(JSON straight_accuracy GET "${summary}" test_accuracy)
  expect_same_tensors("${WORK_DIR}/resumed" "${WORK_DIR}/straight")
  if(NOT resumed_accuracy STREQUAL straight_accuracy)
    message(FATAL_ERROR "test_accuracy ${resumed_accuracy} after resuming but ${straight_accuracy} straight")
  endif()
  message("resume is bit-exact: equal model and optimizer tensors, test_accuracy ${straight_accuracy} both ways")
else()
  message(FATAL_ERROR "MODE must be learns or resume, got '${MODE}'")
endif()
file(REMOVE_RECURSE "${WORK_DIR}")
