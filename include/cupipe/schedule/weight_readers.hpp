// SPDX-License-Identifier: Apache-2.0
// Which virtual stage's weights a worker's actions read next, looked ahead over its plan: a forward
// or backward reads its stage's weights, a W (zero bubble's weight gradient) reads none. ZeRO-3's
// gathers and releases follow it at run time (pipeline::ParameterShards), and the planner counts
// them with it (planner::detail::gathered_params), so the two agree by construction.
#pragma once

#include <cstddef>
#include <vector>

#include "cupipe/schedule/action.hpp"

namespace cupipe::schedule {

/// For each action i of one worker:
struct WeightReaders {
  /// the virtual stage of the worker's first forward or backward after action i; -1: none;
  std::vector<int> next_reader;
  /// the virtual stage of its first forward or backward after action i on another stage than that
  /// of the last forward or backward at or before i (the stage whose weights it holds then): the
  /// weights worth fetching ahead; -1: none.
  std::vector<int> prefetch;
};

inline WeightReaders weight_readers(const Plan& plan, int w) {
  const std::vector<Action>& actions = plan.actions[std::size_t(w)];
  const std::size_t n = actions.size();
  WeightReaders out{std::vector<int>(n, -1), std::vector<int>(n, -1)};
  std::vector<int> holding(n, -1);
  for (std::size_t i = 0, last = std::size_t(-1); i < n; ++i) {
    if (actions[i].kind != ActionKind::W) last = i;
    if (last != std::size_t(-1)) holding[i] = plan.virtual_stage(w, actions[last]);
  }
  // Of the forwards and backwards after action i: the first one's stage, and the first one's on
  // another stage than that.
  int first = -1, other = -1;
  for (std::size_t i = n; i-- > 0;) {
    out.next_reader[i] = first;
    out.prefetch[i] = first != holding[i] ? first : other;
    if (actions[i].kind == ActionKind::W) continue;
    const int v = plan.virtual_stage(w, actions[i]);
    if (first != v) other = first;
    first = v;
  }
  return out;
}

}  // namespace cupipe::schedule
