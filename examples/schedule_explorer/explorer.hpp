// SPDX-License-Identifier: Apache-2.0
// The schedule explorer's work, over any list of policies (the library's by default): generate,
// verify and simulate, then print a comparison table, one policy's figures, a timeline or a trace.
#pragma once

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "cupipe/io/plan_file.hpp"
#include "cupipe/schedule/registry.hpp"
#include "cupipe/schedule/schedule.hpp"

namespace sch = cupipe::schedule;

namespace explorer {

struct Options {
  std::string schedule = "1f1b";
  int stages = 4;
  int microbatches = 8;
  int chunks = 0;   // 0: the policy's default (2 for interleaved)
  int batches = 0;  // 0: the policy's default (2 for PipeDream and 2BW, else 1)
  sch::Costs costs{1, 2, 0, 0};
  bool timeline = false;
  bool json = false;
  bool compare = false;
  std::string trace;
  std::string plan_file;   // read, verify and simulate this plan instead of generating one
  std::string write_plan;  // write the plan shown to this CSV file
  int steps = 1;           // flush plans: this many steps back to back, as post-validation runs them
};

/// The steady-state bubble of `steps` post-validated steps of a flush plan (steps >= 3).
inline double steady_bubble(const sch::Plan& one, int steps, const sch::Costs& costs) {
  const sch::Plan plan = sch::repeat_steps(one, steps);
  return sch::steady_state_bubble(sch::timeline_events(plan, sch::simulate(plan, costs)), one.config.stages,
                                  one.config.microbatches, steps);
}

/// The options' configuration for a policy: its own chunk and batch counts unless given.
inline sch::Config config_for(const Options& o, const sch::PolicyInfo& policy) {
  return {o.stages, o.microbatches, o.chunks > 0 ? o.chunks : policy.default_chunks,
          o.batches > 0 ? o.batches : policy.default_batches};
}

template <class T>
inline std::string join(const std::vector<T>& values) {
  std::string out;
  for (const T& v : values) {
    if (!out.empty()) out += ' ';
    out += std::to_string(v);
  }
  return out;
}

inline std::string fixed(double value, int digits) {
  char text[64];
  std::snprintf(text, sizeof text, "%.*f", digits, value);
  return text;
}

/// Generates, verifies and simulates; throws cupipe::error with the reason when anything fails.
inline std::pair<sch::Plan, sch::SimResult> run(const sch::PolicyInfo& policy, const sch::Config& config,
                                                const sch::Costs& costs) {
  sch::Plan plan = policy.generate(config);
  if (const sch::VerifyResult ok = sch::verify(plan); !ok) CUPIPE_THROW("the plan failed verification: ", ok.message());
  sch::SimResult sim = sch::simulate(plan, costs);
  return {std::move(plan), std::move(sim)};
}

/// "exposed all-to-all 12.00 (20.00 with every F&B pair taken apart)", or its first part for a
/// plan without pairs.
inline std::string exposed_text(const sch::Plan& plan, const sch::SimResult& sim, const sch::Costs& costs) {
  std::string out = fixed(sim.total_exposed_communication(), 2);
  if (sch::has_pairs(plan))
    out += " (" + fixed(sch::simulate(sch::without_pairs(plan), costs).total_exposed_communication(), 2) +
           " with every F&B pair taken apart)";
  return out;
}

template <class List = sch::Policies>
void print_compare(const Options& o) {
  std::printf("simulated (predicted), stages %d, microbatches %d, costs F=%g B=%g W=%g transfer=%g per stage\n",
              o.stages, o.microbatches, o.costs.forward, o.costs.backward, o.costs.weight, o.costs.transfer);
  const bool steady = o.steps >= 3;
  std::printf("%-12s %6s %7s %10s %9s %16s %15s%s\n", "schedule", "chunks", "batches", "makespan", "bubble",
              "peak activations", "weight versions", steady ? "   steady bubble" : "");
  for (const sch::PolicyInfo& policy : sch::policy_table<List>()) {
    const sch::Config config = config_for(o, policy);
    if (const std::string_view why = policy.check(config); !why.empty()) {
      std::printf("%-12s rejected: %s\n", std::string(policy.name).c_str(), std::string(why).c_str());
      continue;
    }
    const auto [plan, sim] = run(policy, config, o.costs);
    std::string steady_cell;
    if (steady)
      steady_cell = "   " + (plan.update == sch::UpdateRule::flush ? fixed(steady_bubble(plan, o.steps, o.costs), 4) : std::string("-"));
    if (o.costs.all_to_all > 0) steady_cell += "   exposed all-to-all " + exposed_text(plan, sim, o.costs);
    std::printf("%-12s %6d %7d %10s %9s %16d %15d%s\n", std::string(policy.name).c_str(), config.chunks, config.batches,
                fixed(sim.makespan, 2).c_str(), fixed(sim.bubble_fraction, 4).c_str(), sim.max_peak_activations(),
                sim.max_weight_versions(), steady_cell.c_str());
  }
  if (o.costs.all_to_all > 0)
    std::printf("exposed all-to-all = the all-to-all time (--all-to-all %g per F and per B of a stage) that no compute\n"
                "hid, summed over stages: an F or B alone waits for its own; an overlapped F&B pair takes the longer of\n"
                "its compute and its communication.\n",
                o.costs.all_to_all);
  std::printf("bubble = idle / (stages x makespan); peak activations = most microbatch-chunks held between F and B\n"
              "(or W) on any stage; async policies (pipedream, 2bw) run `batches` batches without a flush.\n");
  if (steady)
    std::printf("steady bubble = idle share of steps 1..%d of %d steps run back to back with optimizer post-validation\n"
                "(no flush between steps; flush schedules only).\n",
                o.steps - 2, o.steps);
}

template <class List = sch::Policies>
int explore(const Options& o) {
  if (o.compare) {
    print_compare<List>(o);
    return 0;
  }
  std::string name;
  sch::Plan plan;
  if (!o.plan_file.empty()) {
    name = "plan " + o.plan_file;
    plan = cupipe::io::load_plan(o.plan_file);
    if (const sch::VerifyResult ok = sch::verify(plan); !ok)
      CUPIPE_THROW(o.plan_file, ": the plan failed verification: ", ok.message());
  } else {
    const sch::PolicyInfo policy = sch::find_policy<List>(o.schedule);
    name = policy.name;
    plan = run(policy, config_for(o, policy), o.costs).first;
  }
  CUPIPE_REQUIRE(o.steps >= 1, "--steps must be at least 1, got ", o.steps);
  if (!o.write_plan.empty()) cupipe::io::save_plan(plan, o.write_plan);  // one step: what UserPlan runs
  if (o.steps > 1) {
    // Post-validated steps back to back: one plan, verified like any other.
    plan = sch::repeat_steps(plan, o.steps);
    if (const sch::VerifyResult ok = sch::verify(plan); !ok)
      CUPIPE_THROW(o.steps, " steps back to back failed verification: ", ok.message());
    name += " x " + std::to_string(o.steps) + " steps";
  }
  const sch::Config config = plan.config;
  const sch::SimResult sim = sch::simulate(plan, o.costs);
  const bool steady = o.steps >= 3;
  const double steady_bubble =
      steady ? sch::steady_state_bubble(sch::timeline_events(plan, sim), config.stages, config.microbatches, o.steps) : 0;
  if (o.json) {
    const nlohmann::json out{{"schedule", name},
                             {"stages", config.stages},
                             {"microbatches", config.microbatches},
                             {"chunks", config.chunks},
                             {"makespan", sim.makespan},
                             {"bubble_fraction", sim.bubble_fraction},
                             {"idle_per_stage", sim.idle},
                             {"peak_activations", sim.peak_activations},
                             {"weight_versions", sim.weight_versions},
                             {"steps", o.steps}};
    nlohmann::json with = out;
    if (steady) with["steady_state_bubble"] = steady_bubble;
    if (o.costs.all_to_all > 0) {
      with["exposed_all_to_all"] = sim.total_exposed_communication();
      with["exposed_all_to_all_per_stage"] = sim.exposed_communication;
      with["exposed_all_to_all_without_pairs"] = sch::simulate(sch::without_pairs(plan), o.costs).total_exposed_communication();
    }
    std::cout << with.dump() << "\n";
  } else {
    std::printf("%s: stages %d, microbatches %d, chunks %d, batches %d (simulated, predicted)\n",
                name.c_str(), config.stages, config.microbatches, config.chunks, config.batches);
    std::printf("  makespan          %s\n  bubble fraction   %s\n  idle per stage    %s\n",
                fixed(sim.makespan, 3).c_str(), fixed(sim.bubble_fraction, 4).c_str(),
                [&] {
                  std::string out;
                  for (double idle : sim.idle) {
                    if (!out.empty()) out += ' ';
                    out += fixed(idle, 2);
                  }
                  return out;
                }().c_str());
    std::printf("  peak activations  %s\n  weight versions   %s\n", join(sim.peak_activations).c_str(),
                join(sim.weight_versions).c_str());
    if (steady)
      std::printf("  steady bubble     %s (steps 1..%d, post-validated, no flush between steps)\n",
                  fixed(steady_bubble, 4).c_str(), o.steps - 2);
    if (o.costs.all_to_all > 0) std::printf("  exposed all-to-all %s\n", exposed_text(plan, sim, o.costs).c_str());
  }
  const auto events = sch::timeline_events(plan, sim);
  if (o.timeline) std::cout << "\n" << sch::ascii_timeline(events, config.stages);
  if (!o.trace.empty()) {
    std::ofstream file(o.trace);
    if (!file) CUPIPE_THROW("cannot write the trace to '", o.trace, "'");
    // One unit of simulated time is shown as one millisecond.
    file << sch::chrome_trace_json(events, "simulated (predicted): " + name, 1e3);
  }
  return 0;
}

}  // namespace explorer

