# SPDX-License-Identifier: Apache-2.0
# Runs gpt_train on Debian's fortunes and checks its final JSON summary line.
#   cmake -DTRAINER=<path> -DDATA_DIR=<dir> -DWORK_DIR=<dir>
#         -DMODE=learns|resume|data_parallel|experts|experts_data_parallel|cuda|bf16_cuda|plan|pack|post_validation|bf16|bf16_schedules|fp8|cuda_schedules [-DBF16=0|1]
#         [-DMPIRUN=<mpirun command line, ;-separated>] [-DHOST_TRAINER=<path>] -P run_gpt_trainer.cmake
# learns: 100 steps of the tiny preset, 1F1B on 2 stages: the held-out loss must end below the unigram
#         baseline (a model that ignores context), and a sample must be printed. With -DBF16=1 (a
#         trainer built with bf16 host training) the same 100 steps with --precision bf16 (Host<bfloat16,
#         float>) also learn and end within 1.5% of the fp32 run.
# resume: 6 steps, save, resume to 12, save; against 12 straight steps: the same tensor bytes in both
#         files (weights with nanoGPT's names, AdamW state) and the same data position (the shuffled
#         windows' generator, epoch and batch); resuming with the other --data-order is refused.
# data_parallel: 2 stages x 2 replicas under MPIRUN (4 processes, --batch 8: 4 sequences each) for 6
#         steps, then the same flags in one process with 2 stages: the replicas together take the one
#         process's step, so the held-out and training losses agree to 2 parts per million (float
#         sums in another order), and the 4-process run writes a checkpoint; with --zero the same
#         losses to 1 part per million; 2 stages x 2 tensor-parallel ranks (--tp 2) equal one process
#         to 2 parts per million; with -DBF16=1 (a trainer built with bf16) the same --tp 2 run in
#         bf16 equals one bf16 process to 0.1%, 50 steps of --precision fp8-block end within 1% of
#         one process and of fp8-delayed (its amax reduced over the tensor-parallel group) within 3%; with --hand-over e4m3 (packed messages between the
#         processes) 2 replicas equal one process with the same links to 2 parts per million; 2
#         stages x rings of 2 context-parallel ranks (--cp 2) equal one process to 2 parts per
#         million, and sample the same text (the logits of the last position shared round the ring).
# cuda:   20 steps of the tiny preset with --backend cuda, then on the host: losses within 0.5%
#         (float32 either way, other summation orders), and the summary's MFU in (0, 1). Prints
#         "SKIPPED: ..." when the CUDA runtime finds no usable GPU.
# bf16:   --precision bf16 resumes bit-exactly, an fp32 run resumes from its checkpoint, and --plan auto
#         plans among the schedules bf16 trains with (that it learns is checked in learns, with -DBF16=1).
# bf16_schedules: --precision bf16 under ZBV writes the tensors 1F1B writes, bit for bit.
# fp8:    --precision fp8-block under GPipe writes 1F1B's tensors bit for bit, and not bf16's;
#         --precision fp8-delayed trains 8 steps.
# cuda_schedules: the same on CUDA in bf16 and in fp32 (--math fp32); "SKIPPED: ..." without a GPU.
# bf16_cuda: 20 steps with --backend cuda --precision bf16 (MFU in (0, 1)), then, given
#         -DHOST_TRAINER=<a gpt_train with bf16 host training>, the same on the host: held-out
#         losses within 2%. "SKIPPED: ..." without a usable GPU.
# pack:   --pack (documents begin at fortune's '%' lines): 60 steps learn, the borders change the
#         losses, and packed steps overlap with --post-validation bit-exactly.
# experts: --experts 8 --top-k 2 --capacity 1.25: 100 steps learn, the slots routed, dropped and kept
#         add up, --top-k 1 drops nothing, and 3 + 3 steps resumed equal 6 straight under ZB-H1.
# experts_data_parallel: the same with 2 stages x 2 replicas under MPIRUN, also as one expert-parallel
#         group of 2 (--ep 2), against one process: the held-out loss to 2 parts per million, the same
#         slots dropped and load per expert; with --ep 2 the all-to-all time measured and printed, and
#         the exposed part of it no more than the whole; DualPipeV with --ep 2, its pairs taking turns
#         (--paired-turns: some all-to-alls run beside the paired action) and not: the same tensors,
#         and the held-out loss of one process to 2 parts per million.
# post_validation: 10 steps of ZBV (tied wte and lm_head on worker 0) with --post-validation 4, an
#         evaluation after step 5 cutting the groups to 4, 1, 4, 1, against 10 plain steps: the same
#         tensor bytes and the same held-out loss.
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
  run_trainer(--steps 100 --warmup 10 --lr 3e-3 --eval-every 50 --eval-batches 4 --sample 60)
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
    message(FATAL_ERROR "held-out loss ${held_out} after 100 steps is not below the unigram baseline ${unigram}")
  endif()
  if(NOT points EQUAL 2)
    message(FATAL_ERROR "expected 2 evaluations on the curve (steps 50 and 100), got ${points}")
  endif()
  message("learned: held-out loss ${held_out} < unigram ${unigram}")
  if(BF16)
    # The same 100 steps in bf16: it learns too, and lands within 1.5% of fp32 (0.36% apart when
    # written, 2.917 against 2.907 with a unigram baseline of 3.312; the 1,000-step curves of both
    # are in docs/benchmarks.md). 100 steps, not 200: the margin over the baseline was already 0.4
    # nats at 100, and the test is CI's longest (177 s of two threads at 200).
    set(fp32_held_out "${held_out}")
    run_trainer(--steps 100 --warmup 10 --lr 3e-3 --eval-every 50 --eval-batches 4 --sample 0 --precision bf16)
    string(JSON precision GET "${summary}" precision)
    string(JSON held_out GET "${summary}" held_out_loss)
    if(NOT precision STREQUAL "bf16")
      message(FATAL_ERROR "the summary reports precision '${precision}', expected bf16: ${summary}")
    endif()
    if(NOT held_out LESS unigram)
      message(FATAL_ERROR "bf16: held-out loss ${held_out} after 100 steps is not below the unigram baseline ${unigram}")
    endif()
    expect_close("bf16 against fp32 held-out loss after 100 steps" "${held_out}" "${fp32_held_out}" 15000)
    message("bf16 learned too: held-out loss ${held_out} (fp32 ${fp32_held_out})")
  endif()
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
  # The data position is a place in one order of the windows: resuming in the other is refused.
  execute_process(COMMAND "${TRAINER}" ${common} ${schedule} --resume "${WORK_DIR}/first" --data-order in-order
                  RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  if(rc EQUAL 0 OR NOT err MATCHES "the checkpoint's windows came in --data-order shuffled, this run's in in-order")
    message(FATAL_ERROR "resuming a shuffled run with --data-order in-order: exit ${rc}, '${err}'")
  endif()
  message("resumed bit-exactly: held-out loss ${resumed_loss}")
elseif(MODE STREQUAL "data_parallel")
  set(flags --batch 8 --steps 6 --warmup 2 --eval-every 3 --eval-batches 1 --sample 0 --timeout 120)
  set(launcher ${MPIRUN})
  run_trainer(${flags} --dp 2 --save "${WORK_DIR}/dp")
  string(JSON replicas GET "${summary}" data_parallel)
  if(NOT replicas EQUAL 2)
    message(FATAL_ERROR "the 4-process run reports ${replicas} data-parallel replicas, expected 2")
  endif()
  string(JSON dp_held_out GET "${summary}" held_out_loss)
  string(JSON dp_train GET "${summary}" train_loss)
  foreach(array optimizer gradient weight)
    string(JSON dp_${array} GET "${summary}" ${array}_bytes)
  endforeach()
  string(JSON dp_sent GET "${summary}" sent_bytes_per_step)
  if(NOT EXISTS "${WORK_DIR}/dp.safetensors" OR NOT EXISTS "${WORK_DIR}/dp.state.safetensors")
    message(FATAL_ERROR "the 4-process run did not write ${WORK_DIR}/dp.safetensors and dp.state.safetensors")
  endif()
  # ZeRO-1 to -3: the same losses to rounding (the reduce-scatter adds the norm and the tied copies
  # in another order). Between steps rank 0 keeps about half the AdamW state (ZeRO-1), of the
  # gradients too (ZeRO-2) and of the weights too (ZeRO-3), and the whole of the others.
  foreach(zero 1 2 3)
    run_trainer(${flags} --dp 2 --zero=${zero} --save "${WORK_DIR}/zero${zero}")
    string(JSON held_out GET "${summary}" held_out_loss)
    string(JSON train GET "${summary}" train_loss)
    expect_close("held-out loss with --zero=${zero} against without" "${held_out}" "${dp_held_out}" 1)
    expect_close("training loss with --zero=${zero} against without" "${train}" "${dp_train}" 1)
    set(stage 0)
    set(kept "")
    foreach(array optimizer gradient weight)
      math(EXPR stage "${stage} + 1")
      string(JSON got GET "${summary}" ${array}_bytes)
      math(EXPR twice "2 * ${got}")
      math(EXPR bound "${dp_${array}} + 64")  # each stage's shard is at most ceil(n / 2) values
      if(stage LESS_EQUAL zero AND (twice GREATER bound OR NOT got GREATER 0))
        message(FATAL_ERROR "--zero=${zero}: rank 0 keeps ${got} bytes of ${array}s, not about half of ${dp_${array}}")
      elseif(stage GREATER zero AND NOT got EQUAL dp_${array})
        message(FATAL_ERROR "--zero=${zero}: rank 0 keeps ${got} bytes of ${array}s, not the ${dp_${array}} of no ZeRO")
      endif()
      string(APPEND kept " ${array}s ${got} (${dp_${array}} without)")
    endforeach()
    message("ZeRO-${zero}: held-out loss ${held_out} (${dp_held_out} without); bytes on rank 0 between steps:${kept}")
  endforeach()
  # Tensor parallelism: 2 stages x 2 tensor-parallel ranks (4 processes), from the same initial
  # weights, takes the one process's steps (checked below).
  run_trainer(${flags} --tp 2 --save "${WORK_DIR}/tp")
  string(JSON tp_ranks GET "${summary}" tensor_parallel)
  if(NOT tp_ranks EQUAL 2)
    message(FATAL_ERROR "the --tp 2 run reports ${tp_ranks} tensor-parallel ranks, expected 2")
  endif()
  string(JSON tp_held_out GET "${summary}" held_out_loss)
  string(JSON tp_train GET "${summary}" train_loss)
  # Context parallelism: 2 stages x rings of 2 (4 processes), each rank holding two of the four
  # chunks of every sequence, takes the one process's steps (checked below) and samples its text.
  run_trainer(${flags} --cp 2 --sample 24)
  string(JSON cp_ranks GET "${summary}" context_parallel)
  if(NOT cp_ranks EQUAL 2)
    message(FATAL_ERROR "the --cp 2 run reports ${cp_ranks} context-parallel ranks, expected 2")
  endif()
  string(JSON cp_held_out GET "${summary}" held_out_loss)
  string(JSON cp_train GET "${summary}" train_loss)
  if(NOT output MATCHES "--- sample [^\n]*\n(.*)\n---\n")
    message(FATAL_ERROR "the --cp 2 run printed no sample")
  endif()
  set(cp_sample "${CMAKE_MATCH_1}")
  # Compressed hand-overs between processes: the packed e4m3 messages (pipeline/wire_transport.hpp)
  # cross MPI. Each replica's 4 sequences make 4 microbatches of one sequence, as one process's 8
  # sequences in 8 microbatches (below) do, so every message holds the same values and has the same
  # scale.
  run_trainer(${flags} --dp 2 --hand-over e4m3)
  string(JSON e4m3_held_out GET "${summary}" held_out_loss)
  string(JSON e4m3_train GET "${summary}" train_loss)
  # Rank 0 (stage 0) sends its activations: packed, a quarter of fp32's bytes and a header each.
  string(JSON e4m3_sent GET "${summary}" sent_bytes_per_step)
  math(EXPR e4m3_sent_x3 "3 * ${e4m3_sent}")
  if(NOT e4m3_sent GREATER 0 OR NOT e4m3_sent_x3 LESS dp_sent)
    message(FATAL_ERROR "--hand-over e4m3: rank 0 sent ${e4m3_sent} bytes a step, not under a third of the ${dp_sent} at full precision")
  endif()
  if(BF16)
    # bf16 storage with 2 tensor-parallel ranks: each rank's bf16 part is widened, summed in fp32 and
    # rounded once, where one process rounds the whole GEMM once: equal to bf16 accuracy, not bitwise.
    run_trainer(${flags} --tp 2 --precision bf16)
    string(JSON tp_bf16_held_out GET "${summary}" held_out_loss)
    # FP8 under pipeline and tensor parallelism (issue #59): 2 stages x 2 tensor-parallel ranks, 50
    # steps of block scaling, which has no amax to reduce, so no collective of its own to hang on.
    # A split weight's 128 x 128 blocks are not the whole one's: close to one process, not equal.
    run_trainer(--batch 8 --steps 50 --warmup 5 --eval-every 50 --eval-batches 1 --sample 0 --timeout 120 --tp 2
                --precision fp8-block)
    string(JSON tp_fp8_held_out GET "${summary}" held_out_loss)
    string(JSON unigram GET "${summary}" unigram_loss)
    if(NOT tp_fp8_held_out LESS unigram)
      message(FATAL_ERROR "fp8-block, 2 stages x 2 tensor-parallel ranks: held-out loss ${tp_fp8_held_out} after 50 steps "
                          "is not below the unigram baseline ${unigram}")
    endif()
    # Delayed scaling has the amax reduction: once per update over each stage's tensor-parallel
    # group, so a split tensor is scaled as the whole one (from step 2; step 1 scales each part by
    # its own amax). 50 steps, against one process within 3%, the issue's bound for this recipe:
    # one scale per tensor quantises coarsely, and early training amplifies the sums' other order
    # (measured 1.2% apart at 50 steps, 0.03% at 10; block scaling 0.11% at 50).
    run_trainer(--batch 8 --steps 50 --warmup 5 --eval-every 50 --eval-batches 1 --sample 0 --timeout 120 --tp 2
                --precision fp8-delayed)
    string(JSON tp_delayed_held_out GET "${summary}" held_out_loss)
  endif()
  set(launcher "")
  if(BF16)
    run_trainer(${flags} --precision bf16)
    string(JSON one_bf16_held_out GET "${summary}" held_out_loss)
    expect_close("bf16 held-out loss, 2 tensor-parallel ranks against one process" "${tp_bf16_held_out}"
                 "${one_bf16_held_out}" 1000)
    message("bf16: 2 tensor-parallel ranks ~ one process: held-out loss ${tp_bf16_held_out} and ${one_bf16_held_out}")
    run_trainer(--batch 8 --steps 50 --warmup 5 --eval-every 50 --eval-batches 1 --sample 0 --precision fp8-block)
    string(JSON one_fp8_held_out GET "${summary}" held_out_loss)
    # Within 3%, as delayed scaling: 50 steps amplify the split's other FP8 roundings chaotically, so
    # the distance depends on the BLAS's kernels: 0.11% apart with AVX-512's (SkylakeX), 1.45% with
    # OpenBLAS's SSE3 fallback (Prescott: 3.1943 against 3.1487; backend/host/blas_core.hpp).
    expect_close("fp8-block held-out loss after 50 steps, 2 tensor-parallel ranks against one process" "${tp_fp8_held_out}"
                 "${one_fp8_held_out}" 30000)
    message("fp8-block: 2 stages x 2 tensor-parallel ranks ~ one process after 50 steps: held-out loss ${tp_fp8_held_out} "
            "and ${one_fp8_held_out}")
    run_trainer(--batch 8 --steps 50 --warmup 5 --eval-every 50 --eval-batches 1 --sample 0 --precision fp8-delayed)
    string(JSON one_delayed_held_out GET "${summary}" held_out_loss)
    expect_close("fp8-delayed held-out loss after 50 steps, 2 tensor-parallel ranks against one process"
                 "${tp_delayed_held_out}" "${one_delayed_held_out}" 30000)
    message("fp8-delayed: 2 stages x 2 tensor-parallel ranks ~ one process after 50 steps: held-out loss "
            "${tp_delayed_held_out} and ${one_delayed_held_out}")
  endif()
  run_trainer(${flags} --hand-over e4m3 --microbatches 8)
  string(JSON one_e4m3_held_out GET "${summary}" held_out_loss)
  string(JSON one_e4m3_train GET "${summary}" train_loss)
  expect_close("e4m3 hand-overs: held-out loss, 2 replicas over MPI against one process" "${e4m3_held_out}"
               "${one_e4m3_held_out}" 2)
  expect_close("e4m3 hand-overs: training loss, 2 replicas over MPI against one process" "${e4m3_train}"
               "${one_e4m3_train}" 2)
  message("e4m3 hand-overs over MPI = one process: held-out loss ${e4m3_held_out} and ${one_e4m3_held_out}")
  run_trainer(${flags} --sample 24)
  string(JSON one_held_out GET "${summary}" held_out_loss)
  string(JSON one_train GET "${summary}" train_loss)
  if(NOT output MATCHES "--- sample [^\n]*\n(.*)\n---\n" OR NOT CMAKE_MATCH_1 STREQUAL cp_sample)
    message(FATAL_ERROR "the --cp 2 run sampled '${cp_sample}', one process '${CMAKE_MATCH_1}'")
  endif()
  expect_close("held-out loss, rings of 2 context-parallel ranks against one process" "${cp_held_out}" "${one_held_out}" 2)
  expect_close("training loss, rings of 2 context-parallel ranks against one process" "${cp_train}" "${one_train}" 2)
  message("rings of 2 context-parallel ranks = one process: held-out loss ${cp_held_out} and ${one_held_out}, the same sample")
  expect_close("held-out loss, 2 tensor-parallel ranks against one process" "${tp_held_out}" "${one_held_out}" 2)
  expect_close("training loss, 2 tensor-parallel ranks against one process" "${tp_train}" "${one_train}" 2)
  message("2 tensor-parallel ranks = one process: held-out loss ${tp_held_out} and ${one_held_out}")
  expect_close("held-out loss, 2 replicas against one process" "${dp_held_out}" "${one_held_out}" 2)
  expect_close("training loss, 2 replicas against one process" "${dp_train}" "${one_train}" 2)
  message("2 replicas = one process: held-out loss ${dp_held_out} and ${one_held_out}")
elseif(MODE STREQUAL "cuda" OR MODE STREQUAL "bf16_cuda")
  set(flags --batch 8 --steps 20 --warmup 5 --eval-every 0 --eval-batches 2 --sample 0)
  # Exact fp32 GEMMs for the comparison with the host (the CUDA default is TF32); bf16 GEMMs are bf16.
  set(device_flags --backend cuda --math fp32)
  if(MODE STREQUAL "bf16_cuda")
    set(device_flags --backend cuda --precision bf16)
  endif()
  execute_process(COMMAND "${TRAINER}" ${common} ${flags} ${device_flags} RESULT_VARIABLE rc OUTPUT_VARIABLE out
                  ERROR_VARIABLE err)
  if(NOT rc EQUAL 0 AND err MATCHES "cudaErrorNoDevice|cudaErrorInsufficientDriver|no CUDA-capable device")
    message("SKIPPED: no usable GPU: ${err}")
    return()
  endif()
  if(MODE STREQUAL "bf16_cuda")
    # Cuda<bfloat16, float> against Host<bfloat16, float>: both round every stored value once, in
    # other summation orders, so a value may land a bf16 ulp (0.4%) apart; after 20 steps the
    # held-out losses agree to 2%. A host build with bf16 (not flush-only) is needed for the oracle.
    run_trainer(${flags} ${device_flags})
    string(JSON cuda_held_out GET "${summary}" held_out_loss)
    string(JSON precision GET "${summary}" precision)
    string(JSON mfu GET "${summary}" mfu)
    if(NOT precision STREQUAL "bf16" OR NOT mfu GREATER 0 OR NOT mfu LESS 1)
      message(FATAL_ERROR "--precision bf16 --backend cuda: precision '${precision}', MFU ${mfu}: ${summary}")
    endif()
    if(NOT HOST_TRAINER)
      message("bf16 on CUDA: held-out loss ${cuda_held_out}, MFU ${mfu} (no bf16 host trainer to compare with)")
      return()
    endif()
    set(TRAINER "${HOST_TRAINER}")
    run_trainer(${flags} --precision bf16)
    string(JSON host_held_out GET "${summary}" held_out_loss)
    expect_close("bf16 held-out loss, CUDA against host" "${cuda_held_out}" "${host_held_out}" 20000)
    message("bf16: CUDA = host to bf16 accuracy: held-out loss ${cuda_held_out} and ${host_held_out}; MFU ${mfu}")
    return()
  endif()
  run_trainer(${flags} --backend cuda --math fp32)
  string(JSON cuda_held_out GET "${summary}" held_out_loss)
  string(JSON mfu GET "${summary}" mfu)
  if(NOT mfu GREATER 0 OR NOT mfu LESS 1)
    message(FATAL_ERROR "MFU ${mfu} is not in (0, 1)")
  endif()
  run_trainer(${flags})
  string(JSON host_held_out GET "${summary}" held_out_loss)
  expect_close("held-out loss, CUDA against host" "${cuda_held_out}" "${host_held_out}" 5000)
  message("CUDA = host: held-out loss ${cuda_held_out} and ${host_held_out}; MFU ${mfu}")
elseif(MODE STREQUAL "plan")
  # --plan auto: the planner chooses the layout from a profile of this machine; the summary gives the
  # planned step time next to the measured one.
  set(common --data "${DATA_DIR}" --batch 8 --progress none)
  run_trainer(--plan auto --workers 2 --steps 12 --eval-batches 1 --sample 0)
  foreach(key step_seconds_predicted step_seconds_measured)
    string(JSON value ERROR_VARIABLE missing GET "${summary}" ${key})
    if(missing OR NOT value GREATER 0)
      message(FATAL_ERROR "the summary has no positive '${key}': ${summary}")
    endif()
  endforeach()
  message("planned: ${summary}")
  # A two-chunk schedule on 2 workers reports one measured peak per worker (it indexed past the
  # workers' contexts, reading 4 virtual stages, until --plan auto chose ZBV).
  run_trainer(--schedule interleaved --stages 2 --microbatches 4 --steps 2 --eval-batches 1 --sample 0)
  string(JSON workers LENGTH "${summary}" peak_bytes_measured)
  if(NOT workers EQUAL 2)
    message(FATAL_ERROR "interleaved on 2 stages reported ${workers} peaks, expected 2: ${summary}")
  endif()
elseif(MODE STREQUAL "pack")
  # Documents begin at fortune's '%' lines: 60 packed steps learn (the held-out loss, taken with the
  # same borders, ends below the unigram baseline), the borders change training (5 steps packed and
  # unpacked end on other losses), and packed steps overlap with post-validation bit-exactly.
  run_trainer(--pack --steps 60 --warmup 10 --lr 3e-3 --eval-every 0 --eval-batches 4 --sample 0)
  string(JSON packed GET "${summary}" packed)
  string(JSON held_out GET "${summary}" held_out_loss)
  string(JSON unigram GET "${summary}" unigram_loss)
  if(NOT packed OR NOT held_out LESS unigram OR NOT output MATCHES "packed sequences: a document begins at each token 37 \\(")
    message(FATAL_ERROR "--pack: packed ${packed}, held-out loss ${held_out} (unigram ${unigram}) after 60 steps: ${output}")
  endif()
  run_trainer(--pack --steps 5 --eval-every 0 --eval-batches 1 --sample 0)
  string(JSON packed_loss GET "${summary}" train_loss)
  run_trainer(--steps 5 --eval-every 0 --eval-batches 1 --sample 0)
  string(JSON plain_loss GET "${summary}" train_loss)
  if(packed_loss STREQUAL plain_loss)
    message(FATAL_ERROR "--pack: 5 steps end on train loss ${packed_loss}, as without it")
  endif()
  set(common --data "${DATA_DIR}" --schedule zbv --stages 2 --microbatches 4 --batch 8 --progress none
             --steps 10 --warmup 2 --eval-every 5 --eval-batches 1 --sample 0 --pack)
  expect_post_validation_bitwise(held_out_loss)
  message("packed: held-out loss ${held_out} < unigram ${unigram} after 60 steps; 5 steps: ${packed_loss} packed, "
          "${plain_loss} not")
elseif(MODE STREQUAL "experts")
  # --experts 8 --top-k 2 --capacity 1.25 (every second block's MLP 8 experts): 100 steps learn, the
  # capacity drops slots, and every slot is accounted for (routed = steps x tokens x k x MoE blocks,
  # the load per expert summing to what was kept); the log prints the experts' line. --top-k 1 is
  # dropless. 3 + 3 steps resumed equal 6 straight, bit for bit (the experts' tensors by name).
  set(moe --experts 8 --top-k 2 --capacity 1.25)
  run_trainer(${moe} --steps 100 --warmup 10 --lr 3e-3 --eval-every 0 --eval-batches 4 --sample 0 --progress lines)
  string(JSON held_out GET "${summary}" held_out_loss)
  string(JSON unigram GET "${summary}" unigram_loss)
  string(JSON routed GET "${summary}" moe routed_slots)
  string(JSON dropped GET "${summary}" moe dropped_slots)
  string(JSON balance GET "${summary}" moe balance_loss_per_layer)
  string(JSON loads LENGTH "${summary}" moe load)
  set(kept 0)
  math(EXPR last "${loads} - 1")
  foreach(e RANGE ${last})
    string(JSON load GET "${summary}" moe load ${e})
    math(EXPR kept "${kept} + ${load}")
  endforeach()
  math(EXPR expect_routed "100 * 16 * 64 * 2 * 2")
  math(EXPR expect_kept "${routed} - ${dropped}")
  if(NOT held_out LESS unigram OR NOT routed EQUAL expect_routed OR NOT dropped GREATER 0 OR NOT kept EQUAL expect_kept
     OR NOT loads EQUAL 8 OR NOT balance GREATER 0 OR NOT output MATCHES "mixture of experts: the MLP of blocks 1, 3 is 8 experts"
     OR NOT output MATCHES "\n  experts: balance loss [0-9.]+ per layer \\(1: even\\), z-loss [0-9.]+, aux loss [0-9.]+ a step; [0-9.]+% of slots dropped")
    message(FATAL_ERROR "--experts: held-out ${held_out} (unigram ${unigram}), routed ${routed} (expected ${expect_routed}), "
                        "dropped ${dropped}, kept ${kept} of ${expect_kept} in ${loads} experts, balance ${balance}: ${output}")
  endif()
  run_trainer(--experts 8 --top-k 1 --steps 3 --eval-every 0 --eval-batches 1 --sample 0)
  string(JSON top1_dropped GET "${summary}" moe dropped_slots)
  if(NOT top1_dropped EQUAL 0)
    message(FATAL_ERROR "--experts 8 --top-k 1 (dropless) dropped ${top1_dropped} slots")
  endif()
  set(schedule ${moe} --steps 6 --warmup 2 --eval-every 0 --eval-batches 1 --sample 0)
  run_trainer(${schedule} --max-steps 3 --save "${WORK_DIR}/first")
  run_trainer(${schedule} --resume "${WORK_DIR}/first" --save "${WORK_DIR}/resumed")
  run_trainer(${schedule} --schedule zb-h1 --save "${WORK_DIR}/straight")  # B and W split: the same tensors
  expect_same_tensors("${WORK_DIR}/resumed" "${WORK_DIR}/straight")
  message("experts: held-out ${held_out} < unigram ${unigram} after 100 steps, ${dropped} of ${routed} slots dropped")
elseif(MODE STREQUAL "experts_data_parallel")
  # 2 stages x 2 replicas with experts against one process: the same losses to 2 parts per million,
  # and, routing being per sequence, exactly the same slots dropped and the same load per expert.
  set(flags --experts 8 --top-k 2 --capacity 1.25 --batch 8 --steps 6 --warmup 2 --eval-every 0 --eval-batches 1 --sample 0
            --timeout 120)
  set(launcher ${MPIRUN})
  run_trainer(${flags} --dp 2)
  string(JSON dp_held_out GET "${summary}" held_out_loss)
  string(JSON dp_dropped GET "${summary}" moe dropped_slots)
  string(JSON dp_load GET "${summary}" moe load)
  # The same 2 replicas as one expert-parallel group (--ep 2: each holds 4 of every MoE block's 8
  # experts, the tokens travel by all-to-all): the same again, and the measured all-to-all reported.
  run_trainer(${flags} --dp 2 --ep 2 --progress lines)
  string(JSON ep_held_out GET "${summary}" held_out_loss)
  string(JSON ep_dropped GET "${summary}" moe dropped_slots)
  string(JSON ep_load GET "${summary}" moe load)
  string(JSON ep_seconds GET "${summary}" moe all_to_all_seconds_per_step_per_rank)
  string(JSON ep_exposed GET "${summary}" moe exposed_all_to_all_seconds_per_step_per_rank)
  if(NOT ep_seconds GREATER 0 OR NOT ep_exposed GREATER 0 OR ep_exposed GREATER ep_seconds
     OR NOT output MATCHES "\n  experts: all-to-all [0-9.]+ ms a step per rank, [0-9.]+ ms of it exposed \\(measured")
    message(FATAL_ERROR "--ep 2: all-to-all ${ep_seconds} s a step, ${ep_exposed} s of it exposed: ${output}")
  endif()
  # DualPipeV with the same group: its overlapped F&B pairs take turns at the all-to-alls (some of
  # them run while the paired action computes), or run back to back; the same tensors either way.
  # (Not in a build with some schedules only: the sanitizer job's trainer has 1F1B alone.)
  if(NOT TRAINER_SUBSET)
    run_trainer(${flags} --dp 2 --ep 2 --schedule dualpipev --microbatches 4 --paired-turns --progress lines --save "${WORK_DIR}/turns")
    string(JSON dual_held_out GET "${summary}" held_out_loss)
    string(JSON beside GET "${summary}" moe all_to_alls_beside_partner)
    string(JSON all_to_alls GET "${summary}" moe all_to_alls)
    if(NOT beside GREATER 0 OR NOT output MATCHES "all-to-alls ran while the paired action computed")
      message(FATAL_ERROR "--schedule dualpipev --ep 2: ${beside} of ${all_to_alls} all-to-alls beside the partner: ${output}")
    endif()
    run_trainer(${flags} --dp 2 --ep 2 --schedule dualpipev --microbatches 4 --save "${WORK_DIR}/back_to_back")
    string(JSON plain_beside GET "${summary}" moe all_to_alls_beside_partner)
    if(NOT plain_beside EQUAL 0)
      message(FATAL_ERROR "without --paired-turns: ${plain_beside} all-to-alls beside the partner")
    endif()
    expect_same_tensors("${WORK_DIR}/turns" "${WORK_DIR}/back_to_back")
  endif()
  set(launcher "")
  run_trainer(${flags})
  string(JSON held_out GET "${summary}" held_out_loss)
  string(JSON dropped GET "${summary}" moe dropped_slots)
  string(JSON load GET "${summary}" moe load)
  expect_close("held-out loss of 2 replicas with experts against one process" "${dp_held_out}" "${held_out}" 2)
  expect_close("held-out loss of 2 expert-parallel replicas against one process" "${ep_held_out}" "${held_out}" 2)
  if(NOT TRAINER_SUBSET)
    expect_close("held-out loss of DualPipeV's 2 expert-parallel replicas against one process" "${dual_held_out}" "${held_out}" 2)
  endif()
  if(NOT dp_dropped EQUAL dropped OR NOT dp_load STREQUAL load OR NOT ep_dropped EQUAL dropped OR NOT ep_load STREQUAL load)
    message(FATAL_ERROR "2 replicas dropped ${dp_dropped} slots with load ${dp_load}, 2 expert-parallel ones ${ep_dropped} "
                        "with ${ep_load}; one process ${dropped} with ${load}")
  endif()
  message("experts, 2 replicas: held-out ${dp_held_out}, with --ep 2 ${ep_held_out} (one process ${held_out}), ${dropped} "
          "slots dropped in all three; all-to-all ${ep_seconds} s a step per rank, ${ep_exposed} s exposed")
elseif(MODE STREQUAL "post_validation")
  set(common --data "${DATA_DIR}" --schedule zbv --stages 2 --microbatches 4 --batch 8 --progress none
             --steps 10 --warmup 2 --eval-every 5 --eval-batches 1 --sample 0)
  expect_post_validation_bitwise(held_out_loss)
elseif(MODE STREQUAL "bf16")
  # Host<bfloat16, float>: 6 + 6 steps resumed equal 12 straight; an fp32 run takes up the bf16
  # checkpoint (fp32 master weights).
  set(schedule --precision bf16 --steps 12 --warmup 4 --eval-every 0 --eval-batches 1 --sample 0)
  run_trainer(${schedule} --max-steps 6 --save "${WORK_DIR}/first")
  run_trainer(${schedule} --resume "${WORK_DIR}/first" --save "${WORK_DIR}/resumed")
  run_trainer(${schedule} --save "${WORK_DIR}/straight")
  expect_same_tensors("${WORK_DIR}/resumed" "${WORK_DIR}/straight")
  run_trainer(--steps 12 --warmup 4 --eval-every 0 --eval-batches 1 --sample 0 --resume "${WORK_DIR}/first")
  string(JSON fp32_precision GET "${summary}" precision)
  if(NOT fp32_precision STREQUAL "fp32")
    message(FATAL_ERROR "resuming in fp32 reported precision '${fp32_precision}'")
  endif()
  # --plan auto profiles the bf16 model and chooses among every schedule.
  set(common --data "${DATA_DIR}" --batch 8 --progress none)
  run_trainer(--precision bf16 --plan auto --workers 2 --steps 6 --eval-batches 1 --sample 0)
  expect_planned_schedule("^(gpipe|1f1b|interleaved|bfs|zb-h1|zb-h2|zbv|v-half|v-min|dualpipev|pipedream|2bw)$")
  message("bf16 resumed bit-exactly, its checkpoint loaded into an fp32 run, and --plan auto chose ${planned_schedule}")
elseif(MODE STREQUAL "fp8")
  # The host's FP8 emulation (backend::HostFp8): block scaling keeps no state, so GPipe writes the
  # tensors 1F1B writes, bit for bit, and they differ from bf16's (the GEMMs ran in FP8); delayed
  # scaling trains too. That FP8 tracks bf16's loss curve is test_fp8's, and the 600-step figures
  # are in docs/benchmarks.md.
  set(schedule --steps 8 --warmup 2 --eval-every 0 --eval-batches 1 --sample 0)
  run_trainer(${schedule} --precision fp8-block --schedule 1f1b --save "${WORK_DIR}/block_1f1b")
  string(JSON precision GET "${summary}" precision)
  if(NOT precision STREQUAL "fp8-block")
    message(FATAL_ERROR "the summary reports precision '${precision}', expected fp8-block: ${summary}")
  endif()
  if(NOT output MATCHES "FP8 \\(fp8-block, emulated on the CPU\\)")
    message(FATAL_ERROR "the run does not say it trains in FP8:\n${output}")
  endif()
  run_trainer(${schedule} --precision fp8-block --schedule gpipe --save "${WORK_DIR}/block_gpipe")
  expect_same_tensors("${WORK_DIR}/block_gpipe" "${WORK_DIR}/block_1f1b")
  run_trainer(${schedule} --precision bf16 --schedule 1f1b --save "${WORK_DIR}/bf16")
  tensor_bytes("${WORK_DIR}/bf16.safetensors" bf16_bytes)
  tensor_bytes("${WORK_DIR}/block_1f1b.safetensors" block_bytes)
  if(bf16_bytes STREQUAL block_bytes)
    message(FATAL_ERROR "--precision fp8-block wrote bf16's tensors: nothing ran in FP8")
  endif()
  run_trainer(${schedule} --precision fp8-delayed --schedule 1f1b)
  string(JSON loss GET "${summary}" train_loss)
  if(NOT (loss GREATER 0 AND loss LESS 6))
    message(FATAL_ERROR "fp8-delayed: training loss ${loss} after 8 steps (a uniform guess is 5.55)")
  endif()
  message("fp8-block: gpipe wrote 1f1b's tensors bit for bit, not bf16's; fp8-delayed trained to ${loss}")
elseif(MODE STREQUAL "bf16_schedules" OR MODE STREQUAL "cuda_schedules")
  # Every schedule trains in bf16: 12 steps of ZBV (a V-shaped zero-bubble schedule, two chunks per
  # worker, tied wte and lm_head on worker 0) write the tensors 1F1B's write, bit for bit (the
  # library's bf16 pipelines equal the bf16 Network under every synchronous schedule). The
  # asynchronous schedules refuse the tied model in any precision (gpt_train_pipedream_tied).
  # cuda_schedules: the same on CUDA (trainer_cuda.cu, trainer_cuda_other.cu) in bf16 and in fp32
  # (exact fp32 GEMMs), or "SKIPPED: ..." without a usable GPU.
  set(common --data "${DATA_DIR}" --stages 2 --microbatches 4 --batch 16 --progress none)
  set(runs bf16)
  if(MODE STREQUAL "cuda_schedules")
    set(runs "bf16 --backend cuda" "fp32 --backend cuda --math fp32")
    execute_process(COMMAND "${TRAINER}" ${common} --steps 1 --eval-every 0 --eval-batches 1 --sample 0 --backend cuda
                    RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
    if(NOT rc EQUAL 0 AND err MATCHES "cudaErrorNoDevice|cudaErrorInsufficientDriver|no CUDA-capable device")
      message("SKIPPED: no usable GPU: ${err}")
      return()
    endif()
  endif()
  foreach(run IN LISTS runs)
    separate_arguments(run_flags UNIX_COMMAND "${run}")
    list(GET run_flags 0 precision_wanted)
    string(MAKE_C_IDENTIFIER "${run}" tag)
    set(schedule --precision ${run_flags} --steps 12 --warmup 4 --eval-every 0 --eval-batches 1 --sample 0)
    run_trainer(${schedule} --schedule 1f1b --save "${WORK_DIR}/${tag}_1f1b")
    run_trainer(${schedule} --schedule zbv --save "${WORK_DIR}/${tag}_zbv")
    string(JSON precision GET "${summary}" precision)
    string(JSON ran GET "${summary}" schedule)
    if(NOT precision STREQUAL precision_wanted OR NOT ran STREQUAL "zbv")
      message(FATAL_ERROR "--precision ${run} --schedule zbv: the summary reports ${precision}, ${ran}: ${summary}")
    endif()
    expect_same_tensors("${WORK_DIR}/${tag}_zbv" "${WORK_DIR}/${tag}_1f1b")
    message("${run}: zbv wrote the tensors 1f1b wrote, bit for bit")
  endforeach()
else()
  message(FATAL_ERROR "MODE must be learns, resume, data_parallel, cuda, bf16_cuda, plan, post_validation, bf16, bf16_schedules or cuda_schedules, got '${MODE}'")
endif()
