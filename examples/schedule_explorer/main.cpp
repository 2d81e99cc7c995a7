// SPDX-License-Identifier: Apache-2.0
// schedule_explorer: generate, verify and simulate any schedule policy, and print its predicted
// bubble, memory and weight versions, an ASCII timeline, a Chrome trace or one JSON object.
//   schedule_explorer --schedule 1f1b --stages 4 --microbatches 8 --timeline
//   schedule_explorer --compare --stages 4 --microbatches 8
#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <string>

#include "cupipe/schedule/schedule.hpp"

namespace sch = cupipe::schedule;

namespace {

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
};

sch::Config config_for(const Options& o, const sch::PolicyInfo& policy) {
  const int chunks = policy.id == sch::PolicyId::interleaved ? (o.chunks > 0 ? o.chunks : policy.default_chunks)
                                                               : (o.chunks > 0 ? o.chunks : 1);
  return {o.stages, o.microbatches, chunks, o.batches > 0 ? o.batches : policy.default_batches};
}

template <class T>
std::string join(const std::vector<T>& values) {
  std::string out;
  for (const T& v : values) out += (out.empty() ? "" : " ") + std::to_string(v);
  return out;
}

std::string fixed(double value, int digits) {
  char text[64];
  std::snprintf(text, sizeof text, "%.*f", digits, value);
  return text;
}

/// Generates, verifies and simulates; throws cupipe::error with the reason when anything fails.
std::pair<sch::Plan, sch::SimResult> run(const sch::PolicyInfo& policy, const sch::Config& config, const sch::Costs& costs) {
  sch::Plan plan = sch::generate(policy.id, config);
  if (const sch::VerifyResult ok = sch::verify(plan); !ok) CUPIPE_THROW("the plan failed verification: ", ok.message());
  sch::SimResult sim = sch::simulate(plan, costs);
  return {std::move(plan), std::move(sim)};
}

void print_compare(const Options& o) {
  std::printf("simulated (predicted), stages %d, microbatches %d, costs F=%g B=%g W=%g transfer=%g per stage\n",
              o.stages, o.microbatches, o.costs.forward, o.costs.backward, o.costs.weight, o.costs.transfer);
  std::printf("%-12s %6s %7s %10s %9s %16s %15s\n", "schedule", "chunks", "batches", "makespan", "bubble",
              "peak activations", "weight versions");
  for (const sch::PolicyInfo& policy : sch::all_policies) {
    const sch::Config config = config_for(o, policy);
    if (const sch::Rejection why = sch::rejection(policy.id, config); why != sch::Rejection::none) {
      std::printf("%-12s rejected: %s\n", std::string(policy.name).c_str(), std::string(sch::explain(why)).c_str());
      continue;
    }
    const auto [plan, sim] = run(policy, config, o.costs);
    std::printf("%-12s %6d %7d %10s %9s %16d %15d\n", std::string(policy.name).c_str(), config.chunks, config.batches,
                fixed(sim.makespan, 2).c_str(), fixed(sim.bubble_fraction, 4).c_str(), sim.max_peak_activations(),
                sim.max_weight_versions());
  }
  std::printf("bubble = idle / (stages x makespan); peak activations = most microbatch-chunks held between F and B\n"
              "(or W) on any stage; async policies (pipedream, 2bw) run `batches` batches without a flush.\n");
}

int explore(const Options& o) {
  if (o.compare) {
    print_compare(o);
    return 0;
  }
  const sch::PolicyInfo& policy = sch::info(sch::parse_policy(o.schedule));
  const sch::Config config = config_for(o, policy);
  const auto [plan, sim] = run(policy, config, o.costs);
  if (o.json) {
    const nlohmann::json out{{"schedule", policy.name},
                             {"stages", config.stages},
                             {"microbatches", config.microbatches},
                             {"chunks", config.chunks},
                             {"makespan", sim.makespan},
                             {"bubble_fraction", sim.bubble_fraction},
                             {"idle_per_stage", sim.idle},
                             {"peak_activations", sim.peak_activations},
                             {"weight_versions", sim.weight_versions}};
    std::cout << out.dump() << "\n";
  } else {
    std::printf("%s: stages %d, microbatches %d, chunks %d, batches %d (simulated, predicted)\n",
                std::string(policy.name).c_str(), config.stages, config.microbatches, config.chunks, config.batches);
    std::printf("  makespan          %s\n  bubble fraction   %s\n  idle per stage    %s\n",
                fixed(sim.makespan, 3).c_str(), fixed(sim.bubble_fraction, 4).c_str(),
                [&] {
                  std::string out;
                  for (double idle : sim.idle) out += (out.empty() ? "" : " ") + fixed(idle, 2);
                  return out;
                }().c_str());
    std::printf("  peak activations  %s\n  weight versions   %s\n", join(sim.peak_activations).c_str(),
                join(sim.weight_versions).c_str());
  }
  const auto events = sch::timeline_events(plan, sim);
  if (o.timeline) std::cout << "\n" << sch::ascii_timeline(events, config.stages);
  if (!o.trace.empty()) {
    std::ofstream file(o.trace);
    if (!file) CUPIPE_THROW("cannot write the trace to '", o.trace, "'");
    // One unit of simulated time is shown as one millisecond.
    file << sch::chrome_trace_json(events, "simulated (predicted): " + std::string(policy.name), 1e3);
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  CLI::App app{"Generate, verify and simulate pipeline schedules (costs are per whole stage)."};
  app.add_option("--schedule", o.schedule, "gpipe, 1f1b, interleaved, pipedream, 2bw, zb-h1 or zb-h2");
  app.add_option("--stages,-p", o.stages, "pipeline stages");
  app.add_option("--microbatches,-m", o.microbatches, "microbatches per batch");
  app.add_option("--chunks,-v", o.chunks, "chunks per stage (interleaved only; default 2)");
  app.add_option("--batches", o.batches, "batches run without a flush (pipedream, 2bw; default 2)");
  app.add_option("--cost-f", o.costs.forward, "forward cost of a whole stage");
  app.add_option("--cost-b", o.costs.backward, "backward cost (input gradient when --cost-w > 0)");
  app.add_option("--cost-w", o.costs.weight, "weight-gradient cost; 0 folds it into --cost-b");
  app.add_option("--transfer", o.costs.transfer, "latency of a hand-over between stages");
  app.add_flag("--timeline", o.timeline, "print an ASCII timeline");
  app.add_option("--trace", o.trace, "write a Chrome trace (Perfetto, chrome://tracing) to this file");
  app.add_flag("--json", o.json, "print one JSON object");
  app.add_flag("--compare", o.compare, "compare every schedule for these stages and microbatches");
  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp& e) {
    return app.exit(e);
  } catch (const CLI::ParseError& e) {
    std::cerr << "schedule_explorer: " << e.what() << "\n";
    return 2;
  }
  try {
    return explore(o);
  } catch (const cupipe::error& e) {
    std::cerr << "schedule_explorer: " << e.message() << "\n";
    return 1;
  }
}
