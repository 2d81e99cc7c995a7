// SPDX-License-Identifier: Apache-2.0
// How many weight versions each stage must hold, under the vertical-sync semantics the pipeline
// runtime implements. Depends only on the order of actions, not on their timing.
#pragma once

#include <algorithm>
#include <limits>
#include <vector>

#include "cupipe/schedule/action.hpp"

namespace cupipe::schedule {

/// Versions per stage, or the first action that needs a version its stage has not created yet.
struct WeightVersionAnalysis {
  std::vector<int> versions;  // [stage] -> most versions held at once
  bool feasible = true;
  int stage = -1;             // where infeasible: the stage, action, version needed and updates applied
  Action action{ActionKind::F, -1, -1};
  int needed = 0;
  int applied = 0;
};

namespace detail {

/// The version microbatch j runs on, on every stage (vertical sync).
constexpr std::vector<int> microbatch_versions(const Plan& plan) {
  const Config& c = plan.config;
  std::vector<int> version(static_cast<std::size_t>(c.total_microbatches()), 0);
  if (plan.update == UpdateRule::per_microbatch) {
    // Tagged at entry: the number of updates the first virtual stage's worker had applied before
    // it ran F_j there.
    int updates = 0;
    const ActionKind update_after = plan.split_backward ? ActionKind::W : ActionKind::B;
    const int entry_chunk = plan.placement.chunk_of(0);
    for (const Action& a : plan.actions[static_cast<std::size_t>(plan.placement.worker_of(0))]) {
      if (a.kind == ActionKind::F && a.chunk == entry_chunk) version[static_cast<std::size_t>(a.microbatch)] = updates;
      if (a.kind == update_after) ++updates;
    }
  } else if (plan.update == UpdateRule::double_buffered) {
    for (int j = 0; j < c.total_microbatches(); ++j)
      version[static_cast<std::size_t>(j)] = std::max(j / c.microbatches - 1, 0);
  }
  return version;
}

}  // namespace detail

/// The weight version microbatch j of a step runs on, everywhere (vertical sync), given the plan's
/// per-microbatch offsets (detail::microbatch_versions), the updates a stage had applied before the
/// step (`base`) and the batches finished before it. j = total_microbatches() asks for the next
/// step's first microbatch: the oldest version a stage must keep across steps. One rule for the
/// whole library: PipeDream adds the plan's offset to `base`; PipeDream-2BW runs batch t on version
/// max(t - 1, 0); flush schedules always use `base`.
constexpr int version_of(const Plan& plan, const std::vector<int>& offsets, int j, int base, long long batches_before) {
  switch (plan.update) {
    case UpdateRule::flush: return base;
    case UpdateRule::per_microbatch:
      return j < plan.config.total_microbatches() ? base + offsets[static_cast<std::size_t>(j)] : std::numeric_limits<int>::max();
    case UpdateRule::double_buffered:
      return static_cast<int>(std::max(batches_before + j / plan.config.microbatches - 1, 0LL));
  }
  return base;
}

/// Walks each stage's actions: the stage applies updates (after each B or W for PipeDream; after
/// its last one of batch t for 2BW) and must keep, at every moment, its latest version and every
/// version a microbatch between its F and its B still uses: latest - min(in flight) + 1.
constexpr WeightVersionAnalysis analyze_weight_versions(const Plan& plan) {
  const Config& c = plan.config;
  WeightVersionAnalysis out;
  out.versions.assign(static_cast<std::size_t>(c.stages), 1);
  if (plan.update == UpdateRule::flush) return out;
  const std::vector<int> version = detail::microbatch_versions(plan);
  const ActionKind release = plan.split_backward ? ActionKind::W : ActionKind::B;
  const int n = c.total_microbatches();
  for (int s = 0; s < c.stages; ++s) {
    // Microbatch j is in flight on the stage while it holds any of its chunks between F and B.
    std::vector<int> chunks_in_flight(static_cast<std::size_t>(n), 0);
    std::vector<int> released_in_batch(static_cast<std::size_t>(c.batches), 0);
    int latest = 0;
    int most = 1;
    for (const Action& a : plan.actions[static_cast<std::size_t>(s)]) {
      const auto j = static_cast<std::size_t>(a.microbatch);
      if (a.kind == ActionKind::F) {
        if (latest < version[j] && out.feasible) {
          out.feasible = false;
          out.stage = s;
          out.action = a;
          out.needed = version[j];
          out.applied = latest;
        }
        ++chunks_in_flight[j];
      } else if (a.kind == ActionKind::B) {
        --chunks_in_flight[j];
      }
      if (a.kind == release) {
        if (plan.update == UpdateRule::per_microbatch) {
          ++latest;
        } else if (++released_in_batch[j / static_cast<std::size_t>(c.microbatches)] == c.microbatches * c.chunks) {
          ++latest;
        }
      }
      int oldest = latest;
      for (int i = 0; i < n; ++i)
        if (chunks_in_flight[static_cast<std::size_t>(i)] > 0) oldest = std::min(oldest, version[static_cast<std::size_t>(i)]);
      most = std::max(most, latest - oldest + 1);
    }
    out.versions[static_cast<std::size_t>(s)] = most;
  }
  return out;
}

/// Weight versions each stage must hold: 1 for flush policies; see analyze_weight_versions.
constexpr std::vector<int> weight_versions(const Plan& plan) { return analyze_weight_versions(plan).versions; }
/// The weight versions each worker holds at run time: the plan's, where the plan covers one step; 2BW
/// also keeps W(t-1) across steps for the next step's first batch, so it holds 2 even where one
/// step's plan needs only 1.
constexpr std::vector<int> versions_held(const Plan& plan) {
  std::vector<int> versions = weight_versions(plan);
  if (plan.update == UpdateRule::double_buffered)
    for (int& held : versions) held = held < 2 ? 2 : held;
  return versions;
}

}  // namespace cupipe::schedule
