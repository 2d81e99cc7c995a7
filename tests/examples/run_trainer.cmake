# SPDX-License-Identifier: Apache-2.0
# Runs mlp_fashion_mnist and checks its final JSON summary line.
#   cmake -DTRAINER=<path> -DDATA_DIR=<dir> -DWORK_DIR=<dir> -DMODE=learns|resume|plan|post_validation|bf16|bf16_schedules|bf16_cuda|cuda_schedules|stage_backends|stage_backends_cuda -P run_trainer.cmake
# learns: one short epoch must reach test_accuracy >= 0.6 (chance is 0.1), with every summary key; its
#         first 3 steps run with --check-equivalence (float, against the model on one worker).
# resume: 5 steps, save, resume for 5 more, save; against 10 straight steps, save: the two final
#         model files must hold the same tensor bytes (bit-exact resume through the command line).
# plan: --plan auto picks a layout for 2 workers and reports its predicted and measured step times.
# post_validation: 10 steps in groups of 4, 4 and 2 with --post-validation 4 (ZB-H1, steps overlap)
#         against 10 plain steps: the saved model and optimizer tensors must be bitwise equal.
# bf16: --precision bf16 learns (one epoch, test_accuracy >= 0.6), resumes bit-exactly from its own
#         fp32 checkpoint (master weights and optimizer state), an fp32 run resumes from it, and
#         --plan auto plans it among every schedule.
# bf16_schedules: --precision bf16 under interleaved and ZBV writes 1F1B's tensors bit for bit (10
#         steps); under 2BW one epoch lands within 10% of fp32 2BW's test accuracy.
# bf16_cuda: --precision bf16 --backend cuda (Cuda<bfloat16, float>) learns in one epoch; prints
#         "SKIPPED: ..." without a usable GPU.
# cuda_schedules: on CUDA, in fp32 and in bf16, interleaved and ZBV write 1F1B's tensors bit for bit
#         (10 steps) and 2BW learns in one epoch; "SKIPPED: ..." without a usable GPU.
# stage_backends: --stage-backends host:bf16,host (a bf16 and an fp32 stage in one pipeline) learns,
#         resumes bit-exactly, and an fp32 run resumes from its checkpoint; split at layer 4 it learns;
#         --plan auto plans the unequal stages and reports the split it chose.
# stage_backends_cuda: --stage-backends host,cuda learns in one epoch, cuda,host split at layer 4 too, and
#         --plan auto gives the GPU stage the larger share; "SKIPPED: ..." without a GPU.
# hand_over: --hand-over e4m3 (FP8 hand-overs between the stages) learns in one epoch; an unknown
#         precision is refused naming the choices.
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
  run_trainer(--epochs 1 --check-equivalence 3)
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
elseif(MODE STREQUAL "plan")
  # --plan auto: the planner chooses the layout from a profile of this machine, and the summary gives
  # the planned step time next to the measured one.
  set(common --data "${DATA_DIR}" --train-limit 2048 --test-limit 500 --progress none)
  run_trainer(--plan auto --workers 2 --epochs 1 --batch 128)
  foreach(key step_seconds_predicted step_seconds_measured)
    string(JSON value ERROR_VARIABLE missing GET "${summary}" ${key})
    if(missing OR NOT value GREATER 0)
      message(FATAL_ERROR "the summary has no positive '${key}': ${summary}")
    endif()
  endforeach()
  string(JSON stages GET "${summary}" stages)
  if(stages LESS 1 OR stages GREATER 2)
    message(FATAL_ERROR "--plan auto --workers 2 chose ${stages} stages: ${summary}")
  endif()
  message("planned: ${summary}")
elseif(MODE STREQUAL "bf16")
  run_trainer(--epochs 1 --precision bf16)
  string(JSON accuracy GET "${summary}" test_accuracy)
  string(JSON precision GET "${summary}" precision)
  if(NOT precision STREQUAL "bf16")
    message(FATAL_ERROR "the summary reports precision '${precision}', expected bf16: ${summary}")
  endif()
  if(NOT accuracy GREATER_EQUAL 0.6)
    message(FATAL_ERROR "bf16: test_accuracy ${accuracy} after one epoch on 4000 samples; expected at least 0.6")
  endif()
  run_trainer(--epochs 1 --precision bf16 --max-steps 5 --save "${WORK_DIR}/first")
  run_trainer(--epochs 1 --precision bf16 --max-steps 10 --resume "${WORK_DIR}/first" --save "${WORK_DIR}/resumed")
  run_trainer(--epochs 1 --precision bf16 --max-steps 10 --save "${WORK_DIR}/straight")
  expect_same_tensors("${WORK_DIR}/resumed" "${WORK_DIR}/straight")
  # The checkpoint holds fp32 master weights: an fp32 run takes it up.
  run_trainer(--epochs 1 --max-steps 10 --resume "${WORK_DIR}/first")
  string(JSON fp32_precision GET "${summary}" precision)
  if(NOT fp32_precision STREQUAL "fp32")
    message(FATAL_ERROR "resuming in fp32 reported precision '${fp32_precision}'")
  endif()
  # --plan auto profiles the model in bf16 and chooses among every schedule.
  set(common --data "${DATA_DIR}" --train-limit 2048 --test-limit 500 --progress none)
  run_trainer(--epochs 1 --precision bf16 --plan auto --workers 2 --batch 128)
  expect_planned_schedule("^(gpipe|1f1b|interleaved|bfs|zb-h1|zb-h2|zbv|v-half|v-min|dualpipev|pipedream|2bw)$")
  message("bf16 learned (test_accuracy ${accuracy}), resumed bit-exactly, its checkpoint loaded into an fp32 run, and "
          "--plan auto chose ${planned_schedule}")
elseif(MODE STREQUAL "bf16_schedules")
  # Every schedule trains in bf16. The synchronous ones equal 1F1B: 10 steps of interleaved (two
  # chunks per worker) and of ZBV (V-shaped, zero bubble) write 1F1B's tensors bit for bit (the
  # library's bf16 pipelines equal the bf16 Network under each). The asynchronous 2BW updates with
  # delayed weights, so one epoch of it learns less than 1F1B's: in bf16 as much as in fp32.
  set(common --data "${DATA_DIR}" --stages 2 --microbatches 4 --train-limit 4000 --test-limit 1000 --progress none)
  foreach(schedule 1f1b interleaved zbv)
    run_trainer(--epochs 1 --precision bf16 --schedule ${schedule} --max-steps 10 --save "${WORK_DIR}/${schedule}")
    string(JSON precision GET "${summary}" precision)
    string(JSON ran GET "${summary}" schedule)
    if(NOT precision STREQUAL "bf16" OR NOT ran STREQUAL schedule)
      message(FATAL_ERROR "--precision bf16 --schedule ${schedule}: the summary reports ${precision}, ${ran}: ${summary}")
    endif()
  endforeach()
  expect_same_tensors("${WORK_DIR}/interleaved" "${WORK_DIR}/1f1b")
  expect_same_tensors("${WORK_DIR}/zbv" "${WORK_DIR}/1f1b")
  run_trainer(--epochs 1 --schedule 2bw)
  string(JSON fp32_accuracy GET "${summary}" test_accuracy)
  run_trainer(--epochs 1 --precision bf16 --schedule 2bw)
  string(JSON accuracy GET "${summary}" test_accuracy)
  string(JSON precision GET "${summary}" precision)
  # 0.512 in bf16 and 0.527 in fp32 when written (chance is 0.1).
  if(NOT precision STREQUAL "bf16" OR NOT accuracy GREATER_EQUAL 0.4)
    message(FATAL_ERROR "bf16 2bw: precision ${precision}, test_accuracy ${accuracy} after one epoch; expected bf16 and at least 0.4")
  endif()
  expect_close("bf16 2bw against fp32 2bw test accuracy after one epoch" "${accuracy}" "${fp32_accuracy}" 100000)
  message("bf16 interleaved and zbv wrote 1f1b's tensors bit for bit; bf16 2bw learned: test_accuracy ${accuracy} (fp32 ${fp32_accuracy})")
elseif(MODE STREQUAL "hand_over")
  run_trainer(--epochs 1 --hand-over e4m3)
  string(JSON accuracy GET "${summary}" test_accuracy)
  if(NOT accuracy GREATER_EQUAL 0.6)
    message(FATAL_ERROR "test_accuracy ${accuracy} after one epoch with e4m3 hand-overs; expected at least 0.6")
  endif()
  execute_process(COMMAND "${TRAINER}" ${common} --epochs 1 --hand-over fp8 RESULT_VARIABLE rc OUTPUT_VARIABLE out
                  ERROR_VARIABLE err)
  if(rc EQUAL 0 OR NOT "${out}${err}" MATCHES "not one of full, bf16, e4m3")
    message(FATAL_ERROR "--hand-over fp8 exited ${rc} without naming the choices: ${out}${err}")
  endif()
  message("learned with e4m3 hand-overs: test_accuracy ${accuracy}")
elseif(MODE STREQUAL "stage_backends")
  # One stage in bf16 and the other in fp32, in one pipeline: it learns, resumes bit-exactly, and its
  # checkpoint (fp32 master weights) loads into an all-fp32 run.
  run_trainer(--epochs 1 --stage-backends host:bf16,host)
  string(JSON accuracy GET "${summary}" test_accuracy)
  string(JSON precision GET "${summary}" precision)
  if(NOT precision STREQUAL "host:bf16,host" OR NOT accuracy GREATER_EQUAL 0.6)
    message(FATAL_ERROR "--stage-backends host:bf16,host: precision '${precision}', test_accuracy ${accuracy} after one "
                        "epoch on 4000 samples; expected host:bf16,host and at least 0.6: ${summary}")
  endif()
  run_trainer(--epochs 1 --stage-backends host,host:bf16 --max-steps 5 --save "${WORK_DIR}/first")
  run_trainer(--epochs 1 --stage-backends host,host:bf16 --max-steps 10 --resume "${WORK_DIR}/first" --save "${WORK_DIR}/resumed")
  run_trainer(--epochs 1 --stage-backends host,host:bf16 --max-steps 10 --save "${WORK_DIR}/straight")
  expect_same_tensors("${WORK_DIR}/resumed" "${WORK_DIR}/straight")
  run_trainer(--epochs 1 --max-steps 10 --resume "${WORK_DIR}/first")
  # The other split this build compiles: stage 1 from layer 4 learns as well.
  run_trainer(--epochs 1 --stage-backends host,host:bf16 --split-at 4)
  string(JSON split_accuracy GET "${summary}" test_accuracy)
  string(JSON split GET "${summary}" split_at)
  if(NOT split EQUAL 4 OR NOT split_accuracy GREATER_EQUAL 0.6 OR
     NOT output MATCHES "stage 0: Linear<784, 1024>, ReLU, Linear<1024, 512>, ReLU\n")
    message(FATAL_ERROR "--split-at 4: split_at ${split}, test_accuracy ${split_accuracy}; expected stage 1 from layer 4 "
                        "and at least 0.6: ${output}")
  endif()
  # --plan auto times each stage's backend and chooses the schedule, the microbatches and the split
  # for stages of unequal speed; it prints the FLOP-balanced split's prediction beside its own.
  set(common --data "${DATA_DIR}" --train-limit 2048 --test-limit 500 --progress none)
  run_trainer(--plan auto --stage-backends host,host:bf16 --epochs 1 --batch 128)
  string(JSON split GET "${summary}" split_at)
  string(JSON planned GET "${summary}" step_seconds_predicted)
  if(NOT planned GREATER 0 OR NOT output MATCHES "2 stages of unequal speed \\(host,host:bf16" OR
     NOT output MATCHES "worker 1 \\(host:bf16\\): peak" OR NOT output MATCHES "best: [a-z0-9 =-]* split=0,${split},7" OR
     NOT output MATCHES "the FLOP-balanced split \\(stage 1 from layer 2\\) on these stages: [a-z0-9 =,.+%-]*ms predicted")
    message(FATAL_ERROR "--plan auto --stage-backends host,host:bf16 did not report the unequal stages' plan: ${output}")
  endif()
  message("a bf16 stage beside an fp32 one learned (test_accuracy ${accuracy}), resumed bit-exactly, and its "
          "checkpoint loaded into an fp32 run; split at layer 4 it learned (${split_accuracy}); --plan auto chose "
          "stage 1 from layer ${split}")
elseif(MODE STREQUAL "stage_backends_cuda")
  execute_process(COMMAND "${TRAINER}" ${common} --epochs 1 --stage-backends host,cuda --max-steps 1 RESULT_VARIABLE rc
                  OUTPUT_VARIABLE out ERROR_VARIABLE err)
  if(NOT rc EQUAL 0 AND err MATCHES "cudaErrorNoDevice|cudaErrorInsufficientDriver|no CUDA-capable device")
    message("SKIPPED: no usable GPU: ${err}")
    return()
  endif()
  run_trainer(--epochs 1 --stage-backends host,cuda)
  string(JSON accuracy GET "${summary}" test_accuracy)
  if(NOT accuracy GREATER_EQUAL 0.6)
    message(FATAL_ERROR "--stage-backends host,cuda: test_accuracy ${accuracy} after one epoch on 4000 samples; "
                        "expected at least 0.6: ${summary}")
  endif()
  # The other compiled split, GPU first: stage 1 (the CPU's) from layer 4 learns as well.
  run_trainer(--epochs 1 --stage-backends cuda,host --split-at 4)
  string(JSON split_accuracy GET "${summary}" test_accuracy)
  if(NOT split_accuracy GREATER_EQUAL 0.6)
    message(FATAL_ERROR "--stage-backends cuda,host --split-at 4: test_accuracy ${split_accuracy}; expected at least 0.6")
  endif()
  # --plan auto times the GPU stage on the GPU: far faster than the CPU, it takes the larger share,
  # so with the GPU first the CPU stage starts at layer 4 (its last two Linears, 0.13 of the 1.3
  # million multiply-adds a row).
  set(common --data "${DATA_DIR}" --train-limit 2048 --test-limit 500 --progress none)
  run_trainer(--plan auto --stage-backends cuda,host --epochs 1 --batch 128)
  string(JSON split GET "${summary}" split_at)
  string(JSON planned GET "${summary}" step_seconds_predicted)
  string(JSON measured GET "${summary}" step_seconds_measured)
  if(NOT split EQUAL 4 OR NOT planned GREATER 0 OR NOT output MATCHES "2 stages of unequal speed \\(cuda,host" OR
     NOT output MATCHES "worker 0 \\(cuda\\): peak")
    message(FATAL_ERROR "--plan auto --stage-backends cuda,host: split_at ${split}, expected 4: ${output}")
  endif()
  message("a CPU stage and a GPU stage learned together (test_accuracy ${accuracy}), split at layer 4 too "
          "(${split_accuracy}); --plan auto put the CPU stage from layer 4 on, step ${planned} s predicted, "
          "${measured} s measured")
elseif(MODE STREQUAL "post_validation")
  set(common --data "${DATA_DIR}" --schedule zb-h1 --stages 2 --microbatches 4 --train-limit 4000 --test-limit 500
             --progress none --epochs 1 --max-steps 10)
  expect_post_validation_bitwise(train_loss)
elseif(MODE STREQUAL "bf16_cuda")
  execute_process(COMMAND "${TRAINER}" ${common} --epochs 1 --precision bf16 --backend cuda RESULT_VARIABLE rc
                  OUTPUT_VARIABLE out ERROR_VARIABLE err)
  if(NOT rc EQUAL 0 AND err MATCHES "cudaErrorNoDevice|cudaErrorInsufficientDriver|no CUDA-capable device")
    message("SKIPPED: no usable GPU: ${err}")
    return()
  endif()
  run_trainer(--epochs 1 --precision bf16 --backend cuda)
  string(JSON precision GET "${summary}" precision)
  string(JSON accuracy GET "${summary}" test_accuracy)
  if(NOT precision STREQUAL "bf16" OR NOT accuracy GREATER_EQUAL 0.6)
    message(FATAL_ERROR "bf16 on CUDA: precision '${precision}', test_accuracy ${accuracy} after one epoch on 4000 "
                        "samples; expected bf16 and at least 0.6")
  endif()
  message("bf16 on CUDA learned: test_accuracy ${accuracy}")
elseif(MODE STREQUAL "cuda_schedules")
  # Every schedule trains on CUDA in both precisions (trainer_cuda.cu, trainer_cuda_other.cu). In each,
  # 10 steps of interleaved and of ZBV write 1F1B's tensors bit for bit (the same kernels on the same
  # microbatch shapes, whatever the split into chunks), and 2BW (asynchronous) learns in one epoch.
  execute_process(COMMAND "${TRAINER}" ${common} --epochs 1 --max-steps 1 --backend cuda RESULT_VARIABLE rc
                  OUTPUT_VARIABLE out ERROR_VARIABLE err)
  if(NOT rc EQUAL 0 AND err MATCHES "cudaErrorNoDevice|cudaErrorInsufficientDriver|no CUDA-capable device")
    message("SKIPPED: no usable GPU: ${err}")
    return()
  endif()
  set(common --data "${DATA_DIR}" --stages 2 --microbatches 4 --train-limit 4000 --test-limit 1000 --progress none
             --backend cuda)
  foreach(precision fp32 bf16)
    foreach(schedule 1f1b interleaved zbv)
      run_trainer(--epochs 1 --precision ${precision} --schedule ${schedule} --max-steps 10
                  --save "${WORK_DIR}/${precision}_${schedule}")
      string(JSON ran GET "${summary}" schedule)
      string(JSON ran_precision GET "${summary}" precision)
      if(NOT ran STREQUAL schedule OR NOT ran_precision STREQUAL precision)
        message(FATAL_ERROR "--precision ${precision} --schedule ${schedule} on CUDA: the summary reports ${ran_precision}, ${ran}")
      endif()
    endforeach()
    expect_same_tensors("${WORK_DIR}/${precision}_interleaved" "${WORK_DIR}/${precision}_1f1b")
    expect_same_tensors("${WORK_DIR}/${precision}_zbv" "${WORK_DIR}/${precision}_1f1b")
    run_trainer(--epochs 1 --precision ${precision} --schedule 2bw)
    string(JSON accuracy GET "${summary}" test_accuracy)
    if(NOT accuracy GREATER_EQUAL 0.4)
      message(FATAL_ERROR "${precision} 2bw on CUDA: test_accuracy ${accuracy} after one epoch; expected at least 0.4")
    endif()
    message("on CUDA in ${precision}, interleaved and zbv wrote 1f1b's tensors bit for bit; 2bw learned: test_accuracy ${accuracy}")
  endforeach()
else()
  message(FATAL_ERROR "MODE must be learns, resume, plan, post_validation, bf16, bf16_schedules, bf16_cuda, cuda_schedules, stage_backends or stage_backends_cuda, got '${MODE}'")
endif()
file(REMOVE_RECURSE "${WORK_DIR}")
