// SPDX-License-Identifier: Apache-2.0
// The vocabulary of a schedule: actions, the configuration a policy is asked for, and the plan it
// produces. A plan is plain data, computed by constexpr code, so a trainer can static_assert it.
#pragma once

#include <cstdint>
#include <vector>

#include "cupipe/schedule/placement.hpp"

namespace cupipe::schedule {

/// B is the whole backward unless the plan splits it; then B computes the input gradient only and W
/// the weight gradient (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024).
enum class ActionKind : std::uint8_t { F, B, W };

/// The one-letter name of an action kind, as traces, timelines and errors print it.
constexpr char kind_letter(ActionKind kind) { return "FBW"[static_cast<int>(kind)]; }

/// One unit of work on one worker. `chunk` is the LOCAL chunk index on the worker (0..V-1); the
/// plan's placement says which virtual stage that is. F of virtual stage k feeds k+1, B flows back.
/// `overlap` marks an F that runs together with the worker's next action, a B (DualPipe's F&B,
/// PyTorch's OVERLAP_F_B): the pair starts once both inputs are there. The host backend runs the two
/// back to back, the CUDA backend on two streams; verify and simulate treat them as one step.
struct Action {
  ActionKind kind;
  int microbatch;
  int chunk;
  bool overlap = false;

  friend constexpr bool operator==(const Action&, const Action&) = default;
};

/// What a policy is asked to schedule. Asynchronous policies (PipeDream, 2BW) run
/// batches*microbatches microbatches without a flush; microbatch ids are global.
struct Config {
  int stages;
  int microbatches;
  int chunks = 1;
  int batches = 1;

  constexpr int total_microbatches() const { return batches * microbatches; }
  constexpr int virtual_stages() const { return stages * chunks; }
  friend constexpr bool operator==(const Config&, const Config&) = default;
};

/// When a stage applies its optimizer step: once per batch after a flush, after each of its
/// microbatches' backward (PipeDream), or once per batch into a second buffer (PipeDream-2BW).
enum class UpdateRule : std::uint8_t { flush, per_microbatch, double_buffered };

/// A schedule: for every worker, the ordered list of actions it runs, and where each virtual stage lives.
struct Plan {
  Config config;
  std::vector<std::vector<Action>> actions;  // [worker] -> ordered list
  bool split_backward;
  UpdateRule update;
  Placement placement;
  /// Messages one channel (a sender, a receiver, a direction) must hold before the receiver takes
  /// them: 1 for every plan whose receiver takes each message before the next one arrives; more for
  /// plans, like breadth-first, whose first worker runs every forward of a chunk before it takes
  /// the next chunk's inputs. verify checks the plan under this depth; the runtime's channels must
  /// hold at least this many.
  int channel_depth = 1;

  /// The virtual stage an action of worker `w` runs.
  constexpr int virtual_stage(int w, const Action& a) const { return placement.virtual_stage(w, a.chunk); }
};

namespace detail {

/// Dense index of (kind, virtual stage, microbatch), for per-action tables.
constexpr int action_slot(const Config& config, ActionKind kind, int virtual_stage_index, int microbatch) {
  return (static_cast<int>(kind) * config.virtual_stages() + virtual_stage_index) * config.total_microbatches() +
         microbatch;
}

constexpr int action_slots(const Config& config) { return 3 * config.virtual_stages() * config.total_microbatches(); }

}  // namespace detail
}  // namespace cupipe::schedule
