// SPDX-License-Identifier: Apache-2.0
// PipelineOptions: what a trainer sets when it builds a Pipeline (microbatches, seed, recompute,
// devices, deadlines, the communicator, post-validation, ZeRO-1). pipeline/checks.hpp checks them.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "cupipe/comm/communicator.hpp"
#include "cupipe/core/wire.hpp"
#include "cupipe/schedule/action.hpp"

namespace cupipe {

struct PipelineOptions {
  /// Microbatches per batch (flush schedules) or per update period (2BW).
  int microbatches = 1;
  /// Asynchronous schedules only: batches that one train_step runs without a flush (0: 1).
  int batches = 0;
  /// Seeds the parameter initialisation (identical to Network<Model>(seed)).
  std::uint64_t seed = 0;
  /// Throw when a microbatch's loss, or a flush update's global gradient norm, is not finite (the
  /// update is then not applied).
  bool check_finite = true;
  /// Virtual stages that keep only their input after forward and recompute it in backward.
  std::vector<int> recompute{};
  /// Device of each worker, for device backends (several workers may share one). Empty: device 0.
  std::vector<int> devices{};
  /// Packed sequences (core/documents.hpp): every train_step passes its batch's document borders,
  /// which the attention and position embedding layers follow (each document attends within itself,
  /// its positions from 0); across processes the stages agree on them each step, one sum of seven
  /// doubles over the stages (pipeline/documents.hpp).
  bool packed_sequences = false;
  /// Messages a worker's mailbox holds before senders wait; 0: enough for the schedule.
  std::size_t channel_capacity = 0;
  /// A receive (or a step's sends) waiting longer than this is an error naming the stage, action
  /// and peer; 0: no deadline. The default is the collective timeout's: a stage slower than 5
  /// minutes per action needs a longer one.
  double transfer_timeout_seconds = comm::Communicator::default_collective_timeout_seconds;
  /// Across processes: this process runs the stage the communicator's topology gives it, sends to
  /// and receives from the other stages through it, and sums gradients over its replicas. Null: all
  /// stages run in this process.
  std::shared_ptr<comm::Communicator> communicator{};
  /// The plan a schedule::UserPlan pipeline runs (io::load_plan reads one from a CSV or JSON file); its
  /// stages, chunks, microbatches, backward split and placement must match the pipeline's. Only
  /// UserPlan reads it.
  std::shared_ptr<const schedule::Plan> plan{};
  /// Flush schedules: optimizer post-validation in train_steps (Qi et al., zero bubble, section 4).
  /// Each worker applies its update as soon as its own part of a step is done, as if the global
  /// gradient norm did not clip, and goes on to the next step: no flush separates the steps. The norm
  /// is checked one step later; an update that should have clipped, or saw a non-finite gradient, is
  /// rolled back, redone as the flush does it, and the next step is run again. The weights and
  /// optimizer state are bitwise those of train_step after every step. Costs one copy of each
  /// stage's weights, gradients and optimizer state. All stages in this process; tied copies (GPT-2's
  /// wte and lm_head) on one worker, as V-shaped schedules place them.
  bool post_validation = false;
  /// The ZeRO stage (Rajbhandari et al., 2020), with data-parallel replicas across processes; 0: off.
  /// - 1 (or true): each replica keeps the optimizer state of 1/R of each stage's parameters (R
  ///   replicas); the gradients are reduce-scattered (each replica receives the sums of its shard
  ///   only), each replica updates its shard, and the updated shards are gathered over the replicas:
  ///   the traffic of one all-reduce, as without ZeRO. The optimizer state per replica falls by R.
  /// - 2: the summed gradients are kept as shards too (pipeline/gradient_shards.hpp). A stage's
  ///   backward still accumulates into its whole gradient buffer within a step; once the stage's
  ///   last B (or W) is done the buffer is reduce-scattered, while the worker goes on where the
  ///   communicator can start it (MpiCommunicator and NcclCommunicator can), and released. Between
  ///   steps and through the update a replica holds 1/R of the gradients. The communicator must
  ///   reduce-scatter. gradients() then reports the tied copies' gradients summed, as the update
  ///   uses them.
  /// - 3: the parameters are kept as shards too (pipeline/parameter_shards.hpp): between steps a
  ///   replica holds 1/R of each stage's weights (its float master values), which its optimizer
  ///   updates. A virtual stage's whole weights are gathered over the replicas before its first
  ///   forward or backward of a step and released where reshard_after_forward says; where the
  ///   communicator starts gathers (MpiCommunicator), the next stage's gather is prefetched during
  ///   the action before. The gather's unit is the virtual stage: a model cut into more virtual
  ///   stages per worker (Interleaved, the V schedules) holds fewer whole weights at once. The
  ///   communicator must reduce-scatter and gather; StepStats counts the gathers.
  /// The weights equal those without ZeRO to rounding (the norm and the tied copies' sums are added
  /// in another order; the update itself is element-wise, the gather copies). Flush schedules only,
  /// not with post_validation; the communicator must gather. Checkpoints hold the whole state, so
  /// they load under any ZeRO stage and replica count. Without replicas it changes nothing.
  int zero = 0;
  /// ZeRO-3 (zero = 3): a virtual stage's gathered weights are released after each of its actions
  /// whose worker goes on with another virtual stage (or ends its step), and gathered again before
  /// its next forward or backward (FSDP2's reshard_after_forward): a worker holds the whole weights
  /// of one virtual stage at a time, at the cost of a gather per change of stage. Off: a stage
  /// keeps them from its first gather of a step until the update (one gather per stage and step).
  /// With one virtual stage per worker both are the same within a step.
  bool reshard_after_forward = true;
  /// The first N train_steps (host batches) also run through the same model unpipelined, on one worker
  /// of the same backend, from the pipeline's weights and optimizer state; the loss, every tensor's
  /// gradient and its weights after the update must agree to the precision's bound, or the step throws
  /// naming the step, the tensor, its virtual stage and worker (pipeline/equivalence.hpp). Flush
  /// schedules in one process. 0: off.
  int check_equivalence = 0;
  /// The flight recorder (pipeline/flight_recorder.hpp; docs/trainer.md, "When a rank hangs"): a
  /// wait that times out, or SIGUSR1, writes each worker's last 64 actions and the message it waits
  /// for to stderr and to `flight_dir`/cupipe-flight-rank-R.json (empty: $CUPIPE_FLIGHT_DIR, else
  /// the working directory); `flight_on_signal`: SIGUSR1 dumps (where it has its default action).
  std::string flight_dir{};
  bool flight_on_signal = true;
  /// Time every action: StepStats' makespan, busy and idle per worker, the measured bubble and the
  /// action records (what a trace and pipeline::predicted read), from the host clock or, on CUDA,
  /// two events per action and a wait for them after the step. Off: nothing is recorded per action
  /// and those figures are NaN or empty; the loss, gradient norm and memory peaks stay. A trainer that
  /// prints only losses and its own step times turns it off.
  bool measure_actions = true;
  /// In one process (no communicator) with two or more workers and at least as many CPUs allowed to
  /// it: each worker's thread on its own share of those CPUs (pipeline::WorkerThreads; one CPU each
  /// where there are as many as workers), so that a worker woken by its neighbour's message runs at
  /// once instead of waiting on the neighbour's core (Linux's wake-affine placement; 2.5 ms stalls
  /// in a 12 ms MLP step on a 2-core VM). The caller's thread stays free. Across processes the
  /// launcher binds ranks (mpirun --bind-to), and this does nothing.
  bool pin_workers = true;
  /// Compressed hand-overs (pipeline/hand_over_wire.hpp): the precision each link between
  /// neighbouring virtual stages carries, activations forward and gradients back. Empty: full
  /// precision; one entry: every link; else entry k for the link between virtual stages k and k + 1.
  /// Wire::bf16 rounds each value to bfloat16; Wire::e4m3 scales the tensor to FP8 E4M3's range and
  /// rounds to it. Every backend computes with the values such a message delivers. With one backend
  /// the link sends the packed message (pipeline/wire_transport.hpp: fewer bytes, counted in
  /// StepStats::sent_bytes); with a backend per worker each message converts at full size.
  std::vector<Wire> hand_over{};
  /// Lay out each stage's per-microbatch buffers (forward records, output gradients, the loss's and
  /// the input gradients) in one block before a step (pipeline/activation_arena.hpp), so that an
  /// action takes them without the allocator. Off: each comes from the backend's pool, as before
  /// 2026-12; results are the same bitwise.
  bool planned_arena = true;
  /// Activation offload (schedule/offload.hpp): these virtual stages keep at most `offload_resident`
  /// forward records in the backend's memory between actions; after a forward, the records whose
  /// backward comes last go to host memory, and each comes back as its backward starts. Results are
  /// the same bitwise. The copies wait for the backend today (no copy stream yet); on the host backend
  /// the move is between two host buffers, for tests and plans. Not with recompute on the same stage;
  /// train_steps with post_validation keeps the records resident.
  std::vector<int> offload{};
  int offload_resident = 1;
  /// DualPipeV's overlapped F&B pairs with expert parallelism: the F runs on a second thread and the
  /// two take turns, so that one action's all-to-all is in flight while the other computes (on CUDA,
  /// while the other's kernels are queued and run on its own stream: pipeline/paired_turns.hpp; the
  /// communicator's paired_expert_group, MPI's or NCCL's). The numbers are the same bitwise. Off: the
  /// F, then the B.
  /// Off by default: where the ranks have no spare cores, the all-to-all is CPU work (MPI's
  /// shared-memory copies) and each hand-over waits for the scheduler, so the turns hide nothing and
  /// cost time (7% of the step on the 2-core VM with 4 ranks: docs/benchmarks.md). Turn it on where
  /// a rank's communication runs beside its compute (spare cores, a network that moves the data).
  bool paired_turns = false;
};


}  // namespace cupipe
