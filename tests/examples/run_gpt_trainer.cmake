# SPDX-License-Identifier: Apache-2.0
# Runs gpt_train on Debian's fortunes and checks its final JSON summary line.
#   cmake -DTRAINER=<path> -DDATA_DIR=<dir> -DWORK_DIR=<dir> -DMODE=learns|resume -P run_gpt_trainer.cmake
# learns: 200 steps of the tiny preset, 1F1B on 2 stages: the held-out loss must end below the unigram
#         baseline (a model that ignores context), and a sample must be printed.
# resume: 6 steps, save, resume to 12, save; against 12 straight steps: the same tensor bytes in both
#         files (weights with nanoGPT's names, AdamW state) and the same data position.
# Without DATA_DIR it prints "SKIPPED: ..." for ctest's SKIP_REGULAR_EXPRESSION.
cmake_minimum_required(VERSION 3.19)
if(NOT IS_DIRECTORY "${DATA_DIR}")
  message("SKIPPED: ${DATA_DIR} is missing")
  return()
endif()
include(${CMAKE_CURRENT_LIST_DIR}/trainer_support.cmake)
set(common --data "${DATA_DIR}" --schedule 1f1b --stages 2 --microbatches 4 --batch 16 --progress none)

file(REMOVE_RECURSE "${WORK_DIR}")
file(MAKE_DIRECTORY "${WORK_DIR}")
if(MODE STREQUAL "learns")
  run_trainer(--steps 200 --warmup 20 --lr 3e-3 --eval-every 100 --eval-batches 4 --sample 60)
  foreach(key held_out_loss held_out_bits_per_byte unigram_loss train_loss steps seconds tokens_per_second
              bubble_fraction_measured curve)
    string(JSON value ERROR_VARIABLE missing GET "${summary}" ${key})
    if(missing)
      message(FATAL_ERROR "the summary has no '${key}': ${summary}")
    endif()
  endforeach()
  string(JSON held_out GET "${summary}" held_out_loss)
  string(JSON unigram GET "${summary}" unigram_loss)
  string(JSON points LENGTH "${summary}" curve)
  if(NOT held_out LESS unigram)
    message(FATAL_ERROR "held-out loss ${held_out} after 200 steps is not below the unigram baseline ${unigram}")
  endif()
  if(NOT points EQUAL 2)
    message(FATAL_ERROR "expected 2 evaluations on the curve (steps 100 and 200), got ${points}")
  endif()
  message("learned: held-out loss ${held_out} < unigram ${unigram}")
elseif(MODE STREQUAL "resume")
  set(schedule --steps 12 --warmup 4 --eval-every 0 --eval-batches 1 --sample 0)
  run_trainer(${schedule} --max-steps 6 --save "${WORK_DIR}/first")
  run_trainer(${schedule} --resume "${WORK_DIR}/first" --save "${WORK_DIR}/resumed")
  string(JSON resumed_loss GET "${summary}" held_out_loss)
  run_trainer(${schedule} --save "${WORK_DIR}/straight")
  string(JSON straight_loss GET "${summary}" held_out_loss)
  expect_same_tensors("${WORK_DIR}/resumed" "${WORK_DIR}/straight")
  if(NOT resumed_loss STREQUAL straight_loss)
    message(FATAL_ERROR "held-out loss after resuming ${resumed_loss}, straight ${straight_loss}")
  endif()
  message("resumed bit-exactly: held-out loss ${resumed_loss}")
else()
  message(FATAL_ERROR "MODE must be learns or resume, got '${MODE}'")
endif()
