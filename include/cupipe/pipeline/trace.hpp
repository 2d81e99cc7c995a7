// SPDX-License-Identifier: Apache-2.0
// Timelines of measured steps: the measured actions next to the simulator's prediction for the same
// costs (each stage's measured mean F, B and W), as a Chrome trace or an ASCII chart. Event names
// are the action labels ("F3", "B3", "W3"), the same names the CUDA backend gives its NVTX ranges.
#pragma once

#include <array>
#include <string>
#include <vector>

#include "cupipe/pipeline/stats.hpp"
#include "cupipe/schedule/simulate.hpp"
#include "cupipe/schedule/timeline.hpp"

namespace cupipe {

inline std::vector<schedule::TimelineEvent> timeline_events(const StepStats& stats) {
  return {stats.actions.begin(), stats.actions.end()};
}

/// Each stage's measured mean F, B and W durations, scaled to whole-stage costs (an interleaved
/// chunk's action is 1/V of a stage's), in the simulator's cost form.
inline schedule::Costs measured_costs(const StepStats& stats, int stages, int chunks) {
  schedule::Costs costs;
  costs.per_stage.resize(std::size_t(stages));
  for (int s = 0; s < stages; ++s) {
    std::array<double, 3> sum{};
    std::array<int, 3> count{};
    for (const ActionRecord& r : stats.actions)
      if (r.stage == s) {
        sum[std::size_t(r.kind)] += r.end - r.start;
        ++count[std::size_t(r.kind)];
      }
    auto mean = [&](int k) { return count[std::size_t(k)] ? chunks * sum[std::size_t(k)] / count[std::size_t(k)] : 0.0; };
    costs.per_stage[std::size_t(s)] = {mean(0), mean(1), mean(2)};
  }
  return costs;
}

/// The simulator's prediction for `plan` with the step's measured costs.
inline schedule::SimResult predicted(const schedule::Plan& plan, const StepStats& stats) {
  return schedule::simulate(plan, measured_costs(stats, plan.config.stages, plan.config.chunks));
}

/// Chrome trace JSON with two process groups: "measured" and "simulated (predicted)".
inline std::string measured_trace_json(const schedule::Plan& plan, const StepStats& stats) {
  const std::vector<schedule::TimelineEvent> measured = timeline_events(stats);
  const schedule::SimResult prediction = predicted(plan, stats);
  const std::vector<schedule::TimelineEvent> simulated = schedule::timeline_events(plan, prediction);
  const std::array<schedule::TraceGroup, 2> groups{
      schedule::TraceGroup{"measured", measured, 1e6},
      schedule::TraceGroup{"simulated (predicted from measured mean costs)", simulated, 1e6}};
  return schedule::chrome_trace_json(groups);
}

/// ASCII chart of the measured step (one column = the shortest action).
inline std::string measured_ascii_timeline(const StepStats& stats, int stages) {
  const std::vector<schedule::TimelineEvent> events = timeline_events(stats);
  return schedule::ascii_timeline(events, stages);
}

}  // namespace cupipe
