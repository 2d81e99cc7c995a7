// SPDX-License-Identifier: Apache-2.0
// schedule_explorer: generate, verify and simulate any schedule policy, and print its predicted
// bubble, memory and weight versions, an ASCII timeline, a Chrome trace or one JSON object.
//   schedule_explorer --schedule 1f1b --stages 4 --microbatches 8 --timeline
//   schedule_explorer --compare --stages 4 --microbatches 8
//   schedule_explorer --schedule zb-h1 --stages 4 --microbatches 8 --write-plan mine.csv   (or mine.json; edit it, then)
//   schedule_explorer --plan mine.csv --cost-b 1 --cost-w 1 --timeline
#include <CLI/CLI.hpp>

#include <iostream>

#include "explorer.hpp"

int main(int argc, char** argv) {
  explorer::Options o;
  CLI::App app{"Generate, verify and simulate pipeline schedules (costs are per whole stage)."};
  app.add_option("--schedule", o.schedule, "one of: " + sch::policy_names());
  app.add_option("--stages,-p", o.stages, "pipeline stages");
  app.add_option("--microbatches,-m", o.microbatches, "microbatches per batch");
  app.add_option("--chunks,-v", o.chunks, "chunks per stage (default: the policy's own)");
  app.add_option("--batches", o.batches, "batches run without a flush (pipedream, 2bw; default 2)");
  app.add_option("--cost-f", o.costs.forward, "forward cost of a whole stage");
  app.add_option("--cost-b", o.costs.backward, "backward cost (input gradient when --cost-w > 0)");
  app.add_option("--cost-w", o.costs.weight, "weight-gradient cost; 0 folds it into --cost-b");
  app.add_option("--transfer", o.costs.transfer, "latency of a hand-over between stages");
  app.add_option("--all-to-all", o.costs.all_to_all,
                 "expert parallelism's all-to-alls per F and per B of a whole stage: exposed in an action alone, "
                 "hidden behind the partner's compute in an overlapped F&B pair (dualpipev)")
      ->check(CLI::NonNegativeNumber);
  app.add_flag("--timeline", o.timeline, "print an ASCII timeline");
  app.add_option("--trace", o.trace, "write a Chrome trace (Perfetto, chrome://tracing) to this file");
  app.add_flag("--json", o.json, "print one JSON object");
  app.add_flag("--compare", o.compare, "compare every schedule for these stages and microbatches");
  app.add_option("--plan", o.plan_file, "read a plan from this CSV or JSON (.json) file (io/plan_file.hpp), verify and simulate it");
  app.add_option("--steps", o.steps,
                 "flush schedules: this many steps back to back, as optimizer post-validation runs them (3 or more: "
                 "also the steady-state bubble)");
  app.add_option("--write-plan", o.write_plan, "write the plan to this CSV or JSON (.json) file (a starting point to edit)");
  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp& e) {
    return app.exit(e);
  } catch (const CLI::ParseError& e) {
    std::cerr << "schedule_explorer: " << e.what() << "\n";
    return 2;
  }
  try {
    return explorer::explore(o);
  } catch (const cupipe::error& e) {
    std::cerr << "schedule_explorer: " << e.message() << "\n";
    return 1;
  }
}
