// SPDX-License-Identifier: Apache-2.0
// Several training steps as one plan, and the bubble of the steady state between them.
//
// With optimizer post-validation (PipelineOptions::post_validation) a worker applies its own update as
// soon as its last action of a step is done and goes straight on to the next step's actions: no flush
// separates two steps. repeat_steps() writes K steps of a flush plan as one plan (step t's microbatch
// j becomes K-step microbatch t*m + j, and every worker's list is its step list K times), which verify
// and simulate take like any plan; the runtime walks the same plan. steady_state_bubble() measures
// what the zero-bubble paper's "zero" refers to: the idle share of a worker's period from one
// step's first action to the next's, away from the first and last step.
#pragma once

#include <algorithm>
#include <span>
#include <vector>

#include "cupipe/core/error.hpp"
#include "cupipe/schedule/action.hpp"
#include "cupipe/schedule/timeline.hpp"
#include "cupipe/schedule/verify.hpp"

namespace cupipe::schedule {

/// `steps` copies of the one-step flush plan `plan`, back to back on every worker, as one plan of
/// `steps` batches. A plan that is not a one-batch flush plan, or steps < 1, is refused.
constexpr Plan repeat_steps(const Plan& plan, int steps) {
  if (plan.update != UpdateRule::flush || plan.config.batches != 1)
    CUPIPE_THROW("repeat_steps: only a one-batch flush plan repeats step after step (its update waits for the whole batch)");
  if (steps < 1) CUPIPE_THROW("repeat_steps: steps must be at least 1, got ", steps);
  Plan out = plan;
  out.config.batches = steps;
  const int m = plan.config.microbatches;
  for (std::size_t w = 0; w < plan.actions.size(); ++w) {
    auto& list = out.actions[w];
    list.clear();
    list.reserve(plan.actions[w].size() * static_cast<std::size_t>(steps));
    for (int t = 0; t < steps; ++t)
      for (Action a : plan.actions[w]) {
        a.microbatch += t * m;
        list.push_back(a);
      }
  }
  return out;
}

/// The step an action of a repeat_steps plan belongs to.
constexpr int step_of(const Action& a, int microbatches) { return a.microbatch / microbatches; }

/// Idle share of the steady state of consecutive steps, from events (simulated or measured) of a
/// repeat_steps plan with `microbatches` per step: for every worker and every step t in 1..steps-2,
/// the period from its first action of step t to its first action of step t+1, and the time it spent
/// inside step t's actions in that period; the bubble is total idle over total period. The first step
/// (the pipeline filling) and the last (draining, and followed by nothing) are left out, so steps
/// must be at least 3.
inline double steady_state_bubble(std::span<const TimelineEvent> events, int stages, int microbatches, int steps) {
  if (steps < 3) CUPIPE_THROW("steady_state_bubble: needs at least 3 steps (the first and the last are left out), got ", steps);
  constexpr double none = 1e300;
  const std::size_t n = static_cast<std::size_t>(stages) * static_cast<std::size_t>(steps);
  std::vector<double> first(n, none), busy(n, 0);
  for (const TimelineEvent& e : events) {
    const int t = e.microbatch / microbatches;
    if (e.stage < 0 || e.stage >= stages || t < 0 || t >= steps)
      CUPIPE_THROW("steady_state_bubble: an event of stage ", e.stage, ", microbatch ", e.microbatch, " is outside ", stages,
                  " stages and ", steps, " steps of ", microbatches, " microbatches");
    const std::size_t at = static_cast<std::size_t>(e.stage) * static_cast<std::size_t>(steps) + static_cast<std::size_t>(t);
    first[at] = std::min(first[at], e.start);
    busy[at] += e.end - e.start;
  }
  double idle = 0, period = 0;
  for (int s = 0; s < stages; ++s)
    for (int t = 1; t + 1 < steps; ++t) {
      const std::size_t at = static_cast<std::size_t>(s) * static_cast<std::size_t>(steps) + static_cast<std::size_t>(t);
      if (first[at] == none || first[at + 1] == none)
        CUPIPE_THROW("steady_state_bubble: stage ", s, " has no action in step ", first[at] == none ? t : t + 1);
      const double length = first[at + 1] - first[at];
      period += length;
      idle += length - busy[at];
    }
  return period > 0 ? idle / period : 0;
}

}  // namespace cupipe::schedule
