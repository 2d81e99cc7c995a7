# SPDX-License-Identifier: Apache-2.0
# The MPI check programs (tests/comm/mpi_*_check.cpp) and their tests: the pipeline, tensor, expert
# and context parallelism, ZeRO and checkpoint resharding across processes, progress and faults.
# Included by tests/comm/CMakeLists.txt where CUPIPE_MPI_CHECKS is on (cupipe_add_mpi_check and the
# launchers are defined there). CI's host stage turns it off: the ASan + UBSan stage of
# scripts/test.sh builds and runs these same checks, with the memory and UB checks on.

add_executable(mpi_pipeline_check mpi_pipeline_check.cpp)
target_link_libraries(mpi_pipeline_check PRIVATE cupipe::mpi)
target_compile_options(mpi_pipeline_check PRIVATE -Wall -Wextra)
foreach(config "1f1b;4" "interleaved;4" "1f1b;2" "interleaved;2")
  list(GET config 0 schedule)
  list(GET config 1 stages)
  cupipe_add_mpi_check("mpi:${schedule}_${stages}_stages_np4" EXPECT PASS REJECT "FAIL|DIFFERENT"
    COMMAND ${CUPIPE_MPIRUN} $<TARGET_FILE:mpi_pipeline_check> --schedule ${schedule} --stages ${stages}
            --checkpoint ${CMAKE_CURRENT_BINARY_DIR}/mpi_${schedule}_${stages})
endforeach()
# ZB-V across processes: a V-shaped placement's messages to the other process land as they are
# taken, its turns to itself as they are sent; the activation peaks must be the planner's exactly.
cupipe_add_mpi_check("mpi:zbv_2_stages_np4" EXPECT PASS REJECT "FAIL|DIFFERENT"
  COMMAND ${CUPIPE_MPIRUN} $<TARGET_FILE:mpi_pipeline_check> --schedule zbv --stages 2)

# Tensor parallelism on host ranks: the small GPT split over 2 ranks (x 2 replicas, which must not
# mix) and over 4, against the whole model in each process.
add_executable(mpi_tensor_parallel_check mpi_tensor_parallel_check.cpp)
target_link_libraries(mpi_tensor_parallel_check PRIVATE cupipe::mpi)
target_compile_options(mpi_tensor_parallel_check PRIVATE -Wall -Wextra)
foreach(tensor 2 4)
  cupipe_add_mpi_check("mpi:tensor_parallel_gpt_tp${tensor}_np4" EXPECT PASS REJECT "FAIL|DIFFERENT|NOT REFUSED"
    COMMAND ${CUPIPE_MPIRUN} $<TARGET_FILE:mpi_tensor_parallel_check> --tensor ${tensor})
endforeach()
# ... and in a Pipeline: TP 2 x PP 2, TP 2 x DP 2 (4 ranks), and TP 2 x PP 2 x DP 2 (8 ranks), against
# the whole model's pipeline in one process; checkpoints both ways; two also with ZeRO-1, one with
# ZeRO-2 (the vocabulary-split tied copies summed before the gradients' reduce-scatter), one with ZeRO-3; and TP 2 x
# PP 2 on Host<bfloat16, float> against the whole model in bf16, to bf16 accuracy, and TP 2 x DP 2 in
# bf16 with ZeRO-1 against the same without it; TP 2 x PP 2 in FP8 with delayed scaling, each weight's
# scale after a step the whole weight's (the amax reduction over the tensor-parallel group).
foreach(config "tp2_pp2_np4;4;2" "tp2_dp2_np4;4;1" "tp2_pp2_dp2_np8;8;2" "tp2_dp2_zero_np4;4;1;--zero"
               "tp2_pp2_dp2_zero_np8;8;2;--zero" "tp2_pp2_bf16_np4;4;2;--bf16" "tp2_dp2_zero_bf16_np4;4;1;--zero;--bf16"
               "tp2_pp2_fp8_np4;4;2;--fp8" "tp2_pp2_dp2_zero2_np8;8;2;--zero=2"
               "tp2_pp2_dp2_zero3_np8;8;2;--zero=3")
  list(GET config 0 name)
  list(GET config 1 processes)
  list(GET config 2 stages)
  set(extra "")
  list(LENGTH config fields)
  if(fields GREATER 3)
    list(SUBLIST config 3 -1 extra)
  endif()
  if(processes EQUAL 8)
    set(launcher ${CUPIPE_MPIRUN_NP8})
  else()
    set(launcher ${CUPIPE_MPIRUN})
  endif()
  cupipe_add_mpi_check("mpi:tensor_parallel_pipeline_${name}" EXPECT PASS REJECT "FAIL|DIFFERENT|NOT REFUSED"
    COMMAND ${launcher} $<TARGET_FILE:mpi_tensor_parallel_check> --tensor 2 --pipeline ${stages}
            --checkpoint ${CMAKE_CURRENT_BINARY_DIR}/tp_${name} ${extra})
endforeach()

# Checkpoints reshard: saved under each of 5 (DP, TP, PP) layouts, loaded under each other, the next
# step equals one process's (8 ranks).
add_executable(mpi_reshard_check mpi_reshard_check.cpp)
target_link_libraries(mpi_reshard_check PRIVATE cupipe::mpi)
target_compile_options(mpi_reshard_check PRIVATE -Wall -Wextra)
cupipe_add_mpi_check("mpi:checkpoints_reshard_between_5_layouts_np8" EXPECT "20 layout pairs: PASS" REJECT "FAIL|DIFFERENT"
  COMMAND ${CUPIPE_MPIRUN_NP8} $<TARGET_FILE:mpi_reshard_check> --checkpoint ${CMAKE_CURRENT_BINARY_DIR}/reshard)

# A GPT whose tied lm_head and wte sit on different ranks: 4 stages, and 2 stages x 2 replicas.
foreach(stages 4 2)
  cupipe_add_mpi_check("mpi:gpt_tied_${stages}_stages_np4" EXPECT PASS REJECT "FAIL|DIFFERENT"
    COMMAND ${CUPIPE_MPIRUN} $<TARGET_FILE:mpi_pipeline_check> --schedule gpt --stages ${stages})
endforeach()

# Packed sequences across processes: 2 stages x 2 replicas equal one process given the same borders,
# and stages given different borders all refuse the step.
cupipe_add_mpi_check("mpi:packed_gpt_2_stages_np4" EXPECT PASS REJECT "FAIL|DIFFERENT|NOT REFUSED"
  COMMAND ${CUPIPE_MPIRUN} $<TARGET_FILE:mpi_pipeline_check> --schedule packed --stages 2)

# Context parallelism: 2 stages x 2 data-parallel replicas x rings of 2 (8 ranks) and of 4 (16
# ranks) equal one process on whole sequences: losses, gradient norms, weights, predictions.
cupipe_add_mpi_check("mpi:context_parallel_gpt_cp2_np8" EXPECT PASS REJECT "FAIL|DIFFERENT|NOT REFUSED"
  COMMAND ${CUPIPE_MPIRUN_NP8} $<TARGET_FILE:mpi_pipeline_check> --schedule context --stages 2 --cp 2)
cupipe_add_mpi_check("mpi:context_parallel_gpt_cp4_np16" EXPECT PASS REJECT "FAIL|DIFFERENT|NOT REFUSED"
  COMMAND ${_mpi_np16} $<TARGET_FILE:mpi_pipeline_check> --schedule context --stages 2 --cp 4)

# Expert parallelism (moe/, layers/moe.hpp): a GPT whose MLPs are 4 experts, split over groups of EP
# replicas, equals the whole model in one process after 3 AdamW steps (float64, 1e-12): EP 2 x PP 2
# with a capacity that drops and checkpoints both ways (4 ranks), EP 4 x PP 2 dropless (8 ranks), and
# EP 2 x DP 4 on one stage, the experts' gradients summed over the 2 replicas that hold them (4 ranks).
# Each also shows that ranks with microbatches of different sizes all refuse, naming the ranks.
add_executable(mpi_expert_parallel_check mpi_expert_parallel_check.cpp)
target_link_libraries(mpi_expert_parallel_check PRIVATE cupipe::mpi)
target_compile_options(mpi_expert_parallel_check PRIVATE -Wall -Wextra)
cupipe_add_mpi_check("mpi:expert_parallel_gpt_ep2_pp2_np4" EXPECT PASS REJECT "FAIL|DIFFERENT|NOT REFUSED"
  COMMAND ${CUPIPE_MPIRUN} $<TARGET_FILE:mpi_expert_parallel_check> --experts 2 --pipeline 2
          --checkpoint ${CMAKE_CURRENT_BINARY_DIR}/ep2_pp2)
cupipe_add_mpi_check("mpi:expert_parallel_gpt_ep4_pp2_dropless_np8" EXPECT PASS REJECT "FAIL|DIFFERENT|NOT REFUSED"
  COMMAND ${CUPIPE_MPIRUN_NP8} $<TARGET_FILE:mpi_expert_parallel_check> --experts 4 --pipeline 2 --dropless)
cupipe_add_mpi_check("mpi:expert_parallel_gpt_ep2_dp4_np4" EXPECT PASS REJECT "FAIL|DIFFERENT|NOT REFUSED"
  COMMAND ${CUPIPE_MPIRUN} $<TARGET_FILE:mpi_expert_parallel_check> --experts 2 --pipeline 1)

# A send moves while its sender computes without calling MPI (the communicator's progress thread):
# 4 MiB to a rank that times its receive while the sender sleeps 400 ms; under this launcher's
# settings (shared memory without single-copy) it took 453 ms before the thread, about 20 ms after.
add_executable(mpi_progress_check mpi_progress_check.cpp)
target_link_libraries(mpi_progress_check PRIVATE cupipe::mpi)
target_compile_options(mpi_progress_check PRIVATE -Wall -Wextra)
cupipe_add_mpi_check("mpi:a_send_progresses_while_its_sender_computes" EXPECT PASS REJECT FAIL TIMEOUT 120
  COMMAND ${_mpi_launcher} ${MPIEXEC_NUMPROC_FLAG} 2 $<TARGET_FILE:mpi_progress_check>)
# A receive with a 60 s deadline stops within about 10 ms of interrupt_waits() from another thread
# (what the pipeline's abort calls), and the communicator receives the late message afterwards.
cupipe_add_mpi_check("mpi:interrupt_waits_stops_a_receive_at_once" EXPECT PASS REJECT FAIL TIMEOUT 120
  COMMAND ${_mpi_launcher} ${MPIEXEC_NUMPROC_FLAG} 2 $<TARGET_FILE:mpi_progress_check> --interrupt --bytes 65536)
# A 16 MiB sum, blocking and started, within 4 x MPI_Allreduce's time + 5 ms: its wait polls while
# the data move (comm/wait.hpp's poll_window), where sleeping between polls took 25-35 times as long.
# Alone (RUN_SERIAL): beside a busy test the polls' yields hand the cores away (117 and 278 ms against
# 13 ms for MPI_Allreduce, which spins, while a build ran beside it).
cupipe_add_mpi_check("mpi:a_large_sum_is_not_slowed_by_its_wait" EXPECT PASS REJECT FAIL TIMEOUT 120
  COMMAND ${_mpi_launcher} ${MPIEXEC_NUMPROC_FLAG} 2 $<TARGET_FILE:mpi_progress_check> --sum --bytes 16777216
  PROPERTIES RUN_SERIAL TRUE)

# ZeRO-1 (PipelineOptions::zero), 2 stages x 2 replicas: the single process's loss and weights, the
# optimizer state sharded over the replicas, and checkpoints that load into a single process and back;
# and the tied GPT, whose tied copies meet in the flush before the shards are updated.
cupipe_add_mpi_check("mpi:zero_1f1b_2_stages_np4" EXPECT PASS REJECT "FAIL|DIFFERENT"
  COMMAND ${CUPIPE_MPIRUN} $<TARGET_FILE:mpi_pipeline_check> --schedule 1f1b --stages 2 --zero
          --checkpoint ${CMAKE_CURRENT_BINARY_DIR}/mpi_zero)
cupipe_add_mpi_check("mpi:zero_gpt_tied_2_stages_np4" EXPECT PASS REJECT "FAIL|DIFFERENT"
  COMMAND ${CUPIPE_MPIRUN} $<TARGET_FILE:mpi_pipeline_check> --schedule gpt --stages 2 --zero)
# bf16 storage with ZeRO-1: each replica updates its shard of the fp32 master weights; the shards are
# gathered and every replica's weights in use are their rounding.
cupipe_add_mpi_check("mpi:zero_bf16_2_stages_np4" EXPECT PASS REJECT "FAIL|DIFFERENT"
  COMMAND ${CUPIPE_MPIRUN} $<TARGET_FILE:mpi_pipeline_check> --schedule bf16 --stages 2 --zero)

# ZeRO-2 (PipelineOptions::zero = 2): the same comparisons on 2 stages x 2 replicas, 1 stage x 4
# replicas and 2 interleaved stages x 2 replicas (two reduce-scatters in flight on each rank at
# once), each replica keeping its shard of the gradients between steps (measured by the allocator),
# their reduce-scatters started inside the step; the tied GPT, whose stages holding a tied copy
# reduce-scatter at the update, after the copies' sum; and bf16 storage with fp32 gradients.
# ZeRO-3 (zero = 3): the same again, each replica keeping its shard of the weights between steps too,
# and the gathers counted: once per step with one stage per rank; with two interleaved chunks per
# rank, at each change of chunk, or once per chunk with --keep-gathered (reshard_after_forward off),
# all but the first prefetched. The 2-stage runs' checkpoints load under the other ZeRO stages, and
# their next step is the run's.
foreach(zero 2 3)
  set(run ${CUPIPE_MPIRUN} $<TARGET_FILE:mpi_pipeline_check> --zero=${zero})
  cupipe_add_mpi_check("mpi:zero${zero}_1f1b_2_stages_np4" EXPECT PASS REJECT "FAIL|DIFFERENT"
    COMMAND ${run} --schedule 1f1b --stages 2 --checkpoint ${CMAKE_CURRENT_BINARY_DIR}/mpi_zero${zero})
  cupipe_add_mpi_check("mpi:zero${zero}_1f1b_1_stage_np4" EXPECT PASS REJECT "FAIL|DIFFERENT"
    COMMAND ${run} --schedule 1f1b --stages 1)
  cupipe_add_mpi_check("mpi:zero${zero}_interleaved_2_stages_np4" EXPECT PASS REJECT "FAIL|DIFFERENT"
    COMMAND ${run} --schedule interleaved --stages 2)
  cupipe_add_mpi_check("mpi:zero${zero}_gpt_tied_2_stages_np4" EXPECT PASS REJECT "FAIL|DIFFERENT"
    COMMAND ${run} --schedule gpt --stages 2)
  cupipe_add_mpi_check("mpi:zero${zero}_bf16_2_stages_np4" EXPECT PASS REJECT "FAIL|DIFFERENT"
    COMMAND ${run} --schedule bf16 --stages 2)
endforeach()
cupipe_add_mpi_check("mpi:zero3_interleaved_keep_gathered_2_stages_np4" EXPECT PASS REJECT "FAIL|DIFFERENT"
  COMMAND ${CUPIPE_MPIRUN} $<TARGET_FILE:mpi_pipeline_check> --schedule interleaved --stages 2 --zero=3 --keep-gathered)

# A rank that stops answering mid-step: the others fail with the transfer-timeout error naming the
# stage, the action and the peer, and the whole job ends (never hangs).
add_test(NAME "mpi:stalled_rank_fails_cleanly"
  COMMAND ${CMAKE_COMMAND} "-DCOMMAND=${CUPIPE_MPIRUN};$<TARGET_FILE:mpi_pipeline_check>;--schedule;1f1b;--stages;4;--stall"
    -DTIMEOUT=100 "-DEXPECT=worker [0-9], action [FB][0-9]+: waiting for the (activation|gradient) of microbatch [0-9]+ from worker [0-9]: not matched after"
    -P ${PROJECT_SOURCE_DIR}/tests/support/expect_failure.cmake)
set_tests_properties("mpi:stalled_rank_fails_cleanly" PROPERTIES LABELS mpi TIMEOUT 120)

# Ranks started with different schedules fail at once, every one of them, naming the setting: Pipeline
# compares the schedule, microbatches, seed and the plan's fingerprint before the first step (MPMD: two
# ranks run 1F1B, two GPipe, on the same 4 stages).
add_test(NAME "mpi:ranks_with_different_schedules_fail_at_once"
  COMMAND ${CMAKE_COMMAND}
    "-DCOMMAND=${_mpi_launcher};${MPIEXEC_NUMPROC_FLAG};2;$<TARGET_FILE:mpi_pipeline_check>;--schedule;1f1b;--stages;4;:;${MPIEXEC_NUMPROC_FLAG};2;$<TARGET_FILE:mpi_pipeline_check>;--schedule;gpipe;--stages;4"
    -DTIMEOUT=60 "-DEXPECT=ranks were started with different settings: rank 2 has schedule=gpipe but rank 0 has schedule=1f1b"
    -P ${PROJECT_SOURCE_DIR}/tests/support/expect_failure.cmake)
set_tests_properties("mpi:ranks_with_different_schedules_fail_at_once" PROPERTIES LABELS mpi TIMEOUT 90)

# Faults under mpirun (3 ranks, one stage each; the last rank fails in step 2, --timeout 3 s). Each
# healthy rank must fail by itself with a one-line error naming the problem within the timeout, and
# use at most 5% of a core while it waits (check_fault_reports.cmake reads what each rank measured).
# For the stalls the launcher is told not to end the job at the first failure
# (orte_abort_on_non_zero_status 0), so that every rank's own detection is what is tested; a killed
# rank ends the job through the launcher, at once (default mpirun; srun does the same with
# --kill-on-bad-exit).
# MAX_CPU_FRACTION: a rank that spins takes all the core it gets while it waits (a third of one even
# with 6 ranks on 2 cores); one that sleeps between polls measured 0.055 and 0.058 on the 2-core VM
# with both of these tests and a compile running at once (2026-12-02; the CPU counted includes step
# 2's compute before the stall), which failed the former limit of 0.05. 0.10 sits between.
add_executable(mpi_fault_check mpi_fault_check.cpp)
target_link_libraries(mpi_fault_check PRIVATE cupipe::mpi)
target_compile_options(mpi_fault_check PRIVATE -Wall -Wextra)
# stall-amax: FP8 delayed scaling's amax reduction over a tensor-parallel group of the 3 ranks.
foreach(case "stall-transfer;not matched after 3 s \\(transfer timeout" "stall-collective;a sum over all 3 ranks did not finish within 3 s \\(collective timeout\\): another rank stalled or died"
             "stall-amax;fp8 delayed scaling: the step's amax reduction over the tensor-parallel group \\(3 ranks, this one [01]\\) failed: rank [01]: a sum over the 3 tensor-parallel ranks of stage 0 of replica 0 did not finish within 3 s \\(collective timeout\\)")
  list(GET case 0 fault)
  list(GET case 1 expect)
  set(_report ${CMAKE_CURRENT_BINARY_DIR}/fault_${fault})
  add_test(NAME "mpi:${fault}_fails_every_rank_in_time"
    COMMAND ${CMAKE_COMMAND}
      "-DCOMMAND=${_mpi_np3};--mca;orte_abort_on_non_zero_status;0;$<TARGET_FILE:mpi_fault_check>;--fault;${fault};--timeout;3;--report;${_report}"
      -DREPORT=${_report} "-DHEALTHY=0;1" "-DEXPECT=${expect}" -DTIMEOUT=60 -DMIN_WAIT=2.9 -DMAX_WAIT=9
      -DMAX_CPU_FRACTION=0.10 -DLAUNCHER_KEEPS_GOING=ON -P ${CMAKE_CURRENT_SOURCE_DIR}/check_fault_reports.cmake)
  set_tests_properties("mpi:${fault}_fails_every_rank_in_time" PROPERTIES LABELS mpi TIMEOUT 90)
endforeach()
# The flight recorder across ranks: the last rank stalls inside its first forward of step 2 (F0);
# ranks 0 and 1 wait for it, time out after 2 s and dump; SIGUSR1 to mpirun reaches the stalled rank,
# whose watcher thread dumps while its worker sleeps; scripts/flight.py must then say that rank 2
# never sent and stopped in F0 (check_flight_report.py; about 5 s).
find_program(CUPIPE_PYTHON3 python3)
if(CUPIPE_PYTHON3)
  set(_flight ${CMAKE_CURRENT_BINARY_DIR}/flight_stall)
  add_test(NAME "mpi:flight_recorder_names_the_stalled_rank"
    COMMAND ${CUPIPE_PYTHON3} ${CMAKE_CURRENT_SOURCE_DIR}/check_flight_report.py --dir ${_flight}
      --merge ${PROJECT_SOURCE_DIR}/scripts/flight.py --stalled-rank 2 --stalled-action F0 --waiting-ranks 0,1 --
      ${_mpi_np3} --mca orte_abort_on_non_zero_status 0 $<TARGET_FILE:mpi_fault_check> --fault stall-transfer
      --timeout 2 --report ${_flight})
  set_tests_properties("mpi:flight_recorder_names_the_stalled_rank" PROPERTIES LABELS mpi TIMEOUT 90)
endif()
# --timeout 60: the job must end long before a rank's own timeout, and name the killed rank.
add_test(NAME "mpi:killed_rank_ends_the_job_at_once"
  COMMAND ${CMAKE_COMMAND} "-DCOMMAND=${_mpi_np3};$<TARGET_FILE:mpi_fault_check>;--fault;kill;--timeout;60;--report;${CMAKE_CURRENT_BINARY_DIR}"
    -DTIMEOUT=30 "-DEXPECT=process rank 2 with PID [0-9]+ on node [^ ]+ exited on signal 9"
    -P ${PROJECT_SOURCE_DIR}/tests/support/expect_failure.cmake)
set_tests_properties("mpi:killed_rank_ends_the_job_at_once" PROPERTIES LABELS mpi TIMEOUT 60)
