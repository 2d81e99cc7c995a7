// SPDX-License-Identifier: Apache-2.0
// What a training step measured. Every figure here comes from clocks or allocators during the step;
// nothing is estimated.
#pragma once

#include <cstdint>
#include <limits>
#include <vector>

#include "cupipe/schedule/timeline.hpp"

namespace cupipe {

/// One action as it ran: worker (physical stage), what, and when, in seconds since the step began.
using ActionRecord = schedule::TimelineEvent;

struct StepStats {
  /// The step's loss: the mean over its samples. Flush schedules: the batch's mean loss. PipeDream
  /// and 2BW: every microbatch's loss was computed on its own weight version, and the figure is their
  /// sample-weighted mean over all of the step's batches.
  double loss = 0;
  /// Global gradient norm before clipping (flush schedules); NaN for asynchronous schedules, which
  /// clip each stage's gradient on its own.
  double grad_norm = std::numeric_limits<double>::quiet_NaN();
  /// From the first action's start to the last action's end. NaN where the pipeline does not time
  /// its actions (PipelineOptions::measure_actions off), as is the bubble; busy, idle and actions are
  /// then empty.
  double makespan_seconds = 0;
  std::vector<double> busy_seconds;  ///< per stage: time inside actions
  std::vector<double> idle_seconds;  ///< per stage: makespan - busy
  /// Sum of idle over stages * makespan: the measured bubble.
  double bubble_fraction = 0;
  std::vector<std::int64_t> peak_activation_bytes;  ///< per stage, from its allocator
  std::vector<std::int64_t> peak_weight_bytes;      ///< per stage, all versions held
  std::vector<int> peak_weight_versions;            ///< per stage
  /// Per worker: the bytes of the step's hand-overs it sent to other workers, as its transport moved
  /// them (packed where PipelineOptions::hand_over compresses a link); 0 for workers of other
  /// processes, which report their own.
  std::vector<std::int64_t> sent_bytes;
  std::vector<ActionRecord> actions;                ///< every action, in start order per stage
  std::int64_t samples = 0;
  /// Pipeline::train_steps with post-validation: this step's update, made before its global gradient
  /// norm was known, would have clipped (or the norm was not finite), so it was undone and redone as
  /// the flush does it, and the next step ran again.
  bool rolled_back = false;
  /// Data parallelism, Pipeline::train_step: the stage gradient sums over the replicas this process
  /// started inside the step, each as soon as its stage's last backward of the step was done, so
  /// that it ran while the worker did the rest of the step's backward (the stages of an interleaved
  /// or V-shaped schedule). 0 where the sums all ran at the update.
  int overlapped_gradient_sums = 0;
  /// ZeRO-3 (PipelineOptions::zero = 3): the gathers of a virtual stage's whole weights over the
  /// replicas this process ran in the step (pipeline/parameter_shards.hpp), and those of them started
  /// during an earlier action (prefetched); 0 without it.
  std::int64_t parameter_gathers = 0;
  std::int64_t prefetched_parameter_gathers = 0;

  /// busy / makespan for stage s.
  double utilisation(int s) const { return makespan_seconds > 0 ? busy_seconds[std::size_t(s)] / makespan_seconds : 0; }
};

}  // namespace cupipe
