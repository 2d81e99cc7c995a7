// SPDX-License-Identifier: Apache-2.0
// simulate: the predicted timing of a plan under per-action costs. Every action starts as soon as
// its stage is free and its inputs have arrived; the result is what the explorer prints and what
// the runtime's measurements are compared against. Labelled "simulated" wherever it is shown.
#pragma once

#include <algorithm>
#include <string>
#include <vector>

#include "cupipe/core/error.hpp"
#include "cupipe/schedule/action.hpp"
#include "cupipe/schedule/offload.hpp"
#include "cupipe/schedule/policy.hpp"
#include "cupipe/schedule/verify.hpp"
#include "cupipe/schedule/weights.hpp"

namespace cupipe::schedule {

/// Costs of one whole stage (all its layers); an interleaved chunk costs 1/V of them.
struct StageCosts {
  double forward = 1;
  double backward = 2;  // whole backward when weight == 0, else the input-gradient part
  double weight = 0;    // weight-gradient part; 0 means folded into backward
  /// The all-to-alls of one F (and as long again of one B) of the stage: expert parallelism's
  /// dispatch and combine. An F or B alone waits for them (they sit between its layers); in an
  /// overlapped F&B pair (DualPipeV) they run while the partner computes, so the pair takes the longer
  /// of its compute and its communication (DeepSeek's DualPipe). 0: no expert layers.
  double all_to_all = 0;
};

/// Per-action costs. `transfer` is the latency of a hand-over between different stages.
/// `per_stage`, when not empty, holds one entry per stage and overrides forward/backward/weight.
struct Costs {
  double forward = 1;
  double backward = 2;
  double weight = 0;
  double transfer = 0;
  /// How long a stage that sat idle waiting for another stage's message takes to start once the
  /// message arrives (a sleeping thread's wake-up); a stage still busy when it arrives pays nothing.
  double wake = 0;
  /// One forward record's copy between device and host memory, one way, for a whole stage (a
  /// chunk's is 1/V): what an action of an OffloadPlan adds per record it moves.
  double offload = 0;
  std::vector<StageCosts> per_stage{};
  /// One entry per virtual stage (stages x chunks), when not empty: overrides the rest, and an
  /// action of chunk c takes its own virtual stage's costs instead of 1/V of its stage's (a model
  /// split into chunks of different costs).
  std::vector<StageCosts> per_virtual_stage{};
  /// [microbatch][virtual stage], when not empty: overrides the rest, for microbatches of different
  /// sizes (a batch that does not split evenly).
  std::vector<std::vector<StageCosts>> per_microbatch{};
  /// StageCosts::all_to_all of every stage (last, so that the positional fields above keep their places).
  double all_to_all = 0;

  constexpr StageCosts of_stage(int stage) const {
    if (per_stage.empty()) return {forward, backward, weight, all_to_all};
    return per_stage[static_cast<std::size_t>(stage)];
  }
};

struct ActionTime {
  double start;
  double end;
};

/// Simulated timing of a plan. times[s][i] belongs to plan.actions[s][i].
struct SimResult {
  double makespan = 0;
  std::vector<double> busy;              // [stage]
  std::vector<double> idle;              // [stage] makespan - busy
  double bubble_fraction = 0;            // sum(idle) / (stages * makespan)
  std::vector<int> peak_activations;     // [stage] most (chunk, microbatch) pairs held from F to B (or W)
  std::vector<int> weight_versions;      // [stage]
  std::vector<double> exposed_communication;  // [stage] all-to-all time no compute hid (StageCosts::all_to_all)
  std::vector<std::vector<ActionTime>> times;

  constexpr double total_exposed_communication() const {
    double total = 0;
    for (double t : exposed_communication) total += t;
    return total;
  }

  constexpr double total_idle() const {
    double total = 0;
    for (double t : idle) total += t;
    return total;
  }
  constexpr int max_peak_activations() const {
    int most = 0;
    for (int a : peak_activations) most = std::max(most, a);
    return most;
  }
  constexpr int max_weight_versions() const {
    int most = 0;
    for (int v : weight_versions) most = std::max(most, v);
    return most;
  }
};

/// Peak in-flight activations per stage: (chunk, microbatch) pairs between F and B, or between F
/// and W when the backward is split (W still needs the layer inputs).
constexpr std::vector<int> peak_activations(const Plan& plan) {
  std::vector<int> peak(plan.actions.size(), 0);
  const ActionKind release = plan.split_backward ? ActionKind::W : ActionKind::B;
  for (std::size_t s = 0; s < plan.actions.size(); ++s) {
    int held = 0;
    for (const Action& a : plan.actions[s]) {
      if (a.kind == ActionKind::F) peak[s] = std::max(peak[s], ++held);
      if (a.kind == release) --held;
    }
  }
  return peak;
}

/// The share of a stage's costs one chunk's action takes: 1 where costs are given per virtual stage
/// or per microbatch, else 1/V.
constexpr double chunk_share(const Plan& plan, const Costs& costs) {
  return costs.per_microbatch.empty() && costs.per_virtual_stage.empty() ? 1.0 / plan.config.chunks : 1.0;
}

/// The costs that apply to action `a` of `stage`: its microbatch's, its virtual stage's or its stage's.
constexpr StageCosts costs_of(const Plan& plan, const Costs& costs, int stage, const Action& a) {
  const bool by_microbatch = !costs.per_microbatch.empty(), own = by_microbatch || !costs.per_virtual_stage.empty();
  const auto k = static_cast<std::size_t>(plan.virtual_stage(stage, a));
  return by_microbatch ? costs.per_microbatch[static_cast<std::size_t>(a.microbatch)][k]
         : own         ? costs.per_virtual_stage[k]
                       : costs.of_stage(stage);
}

/// How long one action computes on its stage (its all-to-alls aside).
constexpr double compute_duration(const Plan& plan, const Costs& costs, int stage, const Action& a) {
  const StageCosts stage_costs = costs_of(plan, costs, stage, a);
  const double per_chunk = chunk_share(plan, costs);
  switch (a.kind) {
    case ActionKind::F: return stage_costs.forward * per_chunk;
    case ActionKind::B:
      return (plan.split_backward ? stage_costs.backward : stage_costs.backward + stage_costs.weight) * per_chunk;
    case ActionKind::W: return stage_costs.weight * per_chunk;
  }
  return 0;
}

/// One action's all-to-all time (an F's or a B's; a W has none).
constexpr double communication(const Plan& plan, const Costs& costs, int stage, const Action& a) {
  return a.kind == ActionKind::W ? 0.0 : costs_of(plan, costs, stage, a).all_to_all * chunk_share(plan, costs);
}

/// How long one action takes on its stage alone: its compute, then its all-to-alls.
constexpr double duration(const Plan& plan, const Costs& costs, int stage, const Action& a) {
  return compute_duration(plan, costs, stage, a) + communication(plan, costs, stage, a);
}

namespace detail {
/// Costs given per stage, per virtual stage or per microbatch must have one entry for each.
constexpr void check_costs(const Config& c, const Costs& costs) {
  const auto p = static_cast<std::size_t>(c.stages);
  if (!costs.per_stage.empty() && costs.per_stage.size() != p)
    CUPIPE_THROW("costs.per_stage holds ", costs.per_stage.size(), " entries, expected one per stage (", p, ")");
  if (!costs.per_virtual_stage.empty() && costs.per_virtual_stage.size() != static_cast<std::size_t>(c.virtual_stages()))
    CUPIPE_THROW("costs.per_virtual_stage holds ", costs.per_virtual_stage.size(), " entries, expected one per virtual stage (",
                 c.virtual_stages(), ")");
  if (costs.per_microbatch.empty()) return;
  if (costs.per_microbatch.size() != static_cast<std::size_t>(c.total_microbatches()))
    CUPIPE_THROW("costs.per_microbatch holds ", costs.per_microbatch.size(), " microbatches, expected ", c.total_microbatches());
  for (const auto& row : costs.per_microbatch)
    if (row.size() != static_cast<std::size_t>(c.virtual_stages()))
      CUPIPE_THROW("costs.per_microbatch holds a row of ", row.size(), " entries, expected one per virtual stage (",
                   c.virtual_stages(), ")");
}
}  // namespace detail

/// Simulates a plan. Throws cupipe::error (a compile error in constant evaluation) when the plan
/// cannot run, with verify's reason. With `offload` (plan_offload of this plan), an action that
/// moves records takes Costs::offload longer per record, as the runtime's synchronous copies do,
/// and the peak activations are the records resident on the device.
constexpr SimResult simulate(const Plan& plan, const Costs& costs, const OffloadPlan* offload = nullptr) {
  const Config& c = plan.config;
  const auto p = static_cast<std::size_t>(c.stages);
  detail::check_costs(c, costs);
  constexpr double unknown = -1;
  std::vector<double> end(static_cast<std::size_t>(detail::action_slots(c)), unknown);
  SimResult out;
  out.busy.assign(p, 0);
  out.exposed_communication.assign(p, 0);
  out.times.resize(p);
  std::vector<double> free_at(p, 0);
  std::vector<std::size_t> next(p, 0);
  std::vector<double> pair_exposed(p, -1);  // an overlapped F's pair: the communication its B leaves exposed
  for (bool progress = true; progress;) {
    progress = false;
    for (std::size_t s = 0; s < p; ++s) {
      const auto& list = plan.actions[s];
      const int stage = static_cast<int>(s);
      for (; next[s] < list.size(); ++next[s]) {
        const Action& a = list[next[s]];
        double ready = free_at[s];
        // When x's input is there (unknown: not yet simulated), and whether another stage sent it.
        struct Arrival {
          double at;
          bool from_another;
        };
        const auto arrival = [&](const Action& x) -> Arrival {
          const detail::Dependency in = detail::input_of(plan, stage, x);
          if (!in.exists) return {0.0, false};
          const double at = end[static_cast<std::size_t>(detail::slot_of(plan, in.stage, in.peer))];
          const bool another = in.stage != stage;
          return {at == unknown ? unknown : at + (another ? costs.transfer : 0), another};
        };
        // A stage idle until the message arrives starts `wake` after it.
        const auto wait_for = [&](const Arrival& in) {
          if (in.at > ready) ready = in.at + (in.from_another ? costs.wake : 0.0);
        };
        const Arrival input = arrival(a);
        if (input.at == unknown) break;
        // An overlapped F starts together with its B (verify has checked that one follows).
        if (a.overlap && next[s] + 1 < list.size()) {
          const Arrival partner = arrival(list[next[s] + 1]);
          if (partner.at == unknown) break;
          // The later of the two wakes the stage.
          wait_for(partner.at > input.at ? partner : input);
        } else {
          wait_for(input);
        }
        // B of the last virtual stage and W consume this stage's own F or B, done earlier in order.
        double length = compute_duration(plan, costs, stage, a);
        double exposed = communication(plan, costs, stage, a);
        // An overlapped pair's all-to-alls run while its partner computes: the B after this F ends
        // when the later of the pair's compute and its communication does.
        if (a.overlap && next[s] + 1 < list.size()) {
          const Action& b = list[next[s] + 1];
          exposed = std::max(0.0, exposed + communication(plan, costs, stage, b) - length -
                                      compute_duration(plan, costs, stage, b));
          pair_exposed[s] = exposed;
          exposed = 0;
        } else if (pair_exposed[s] >= 0) {
          exposed = pair_exposed[s];
          pair_exposed[s] = -1;
        }
        length += exposed;
        out.exposed_communication[s] += exposed;
        if (offload != nullptr) length += offload->copies(stage, next[s]) * costs.offload * chunk_share(plan, costs);
        out.times[s].push_back({ready, ready + length});
        end[static_cast<std::size_t>(detail::slot_of(plan, stage, a))] = ready + length;
        free_at[s] = ready + length;
        out.busy[s] += length;
        progress = true;
      }
    }
  }
  for (std::size_t s = 0; s < p; ++s) {
    if (next[s] < plan.actions[s].size()) {
      const VerifyResult why = verify(plan);
      CUPIPE_THROW("simulate: the plan cannot run: ", why.message());
    }
    out.makespan = std::max(out.makespan, free_at[s]);
  }
  out.idle.assign(p, 0);
  for (std::size_t s = 0; s < p; ++s) out.idle[s] = out.makespan - out.busy[s];
  out.bubble_fraction = out.makespan > 0 ? out.total_idle() / (static_cast<double>(p) * out.makespan) : 0;
  if (offload != nullptr && !offload->empty()) out.peak_activations = offload->peak_resident;
  else out.peak_activations = peak_activations(plan);
  out.weight_versions = weight_versions(plan);
  return out;
}

/// The plan with its overlapped F&B pairs taken apart (each action alone, in the same order): what
/// the pairing hides, beside the plan itself.
constexpr Plan without_pairs(Plan plan) {
  for (auto& list : plan.actions)
    for (Action& a : list) a.overlap = false;
  return plan;
}

/// Whether any action of the plan is an overlapped F paired with the B after it.
constexpr bool has_pairs(const Plan& plan) {
  for (const auto& list : plan.actions)
    for (const Action& a : list)
      if (a.overlap) return true;
  return false;
}

/// Generates a policy's plan and simulates it.
template <SchedulePolicy Policy>
constexpr SimResult simulate(int stages, int microbatches, const Costs& costs, int chunks = Policy::chunks,
                             int batches = Policy::default_batches) {
  return simulate(generate<Policy>(Config{stages, microbatches, chunks, batches}), costs);
}

}  // namespace cupipe::schedule
