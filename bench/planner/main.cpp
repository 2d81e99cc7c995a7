// SPDX-License-Identifier: Apache-2.0
// planner_check: the planner's predictions against measured runs on the host backend, in one run.
//
//   planner_check --model mlp [--devices 2] [--batch 256]   every layout the planner reports for the
//                                                           model, predicted and measured, one table
//   planner_check --sweep                                   20 configurations (model, devices, batch):
//                                                           every layout measured, the planner's choice
//                                                           against the best measured one and against
//                                                           the "microbatch of sqrt(batch) samples" rule
//   planner_check --model gpt --host-cache                  a few layouts with HostBlockCache off and on,
//                                                           alternating
//   mpirun -np 4 planner_check --mpi                        across processes, with data-parallel
//                                                           replicas (the nap model; mpi.cpp), against
//                                                           the "two devices per stage" rule too
//
// Models: nap (fixed-duration sleeping layers), mlp (the Fashion-MNIST MLP), gpt (gpt::tiny). The cost
// model is calibrated here first (every layer profiled at the batch and at a quarter of it, the loss,
// the optimizer step), then the planner searches the layouts this program can run: the stage counts
// compiled in, one process (no replicas), the split partition<> gives. Devices are the workers; on
// a CPU use at most one per core (sleeping layers excepted). Each layout runs --steps steps (3) in
// --rounds passes over all the layouts (3), each pass with its own warm-up step; the measured step
// is the median wall time of train_step, the activation peak the allocator's most. With --model, each
// pass after the first calibrates again just before it, and the table sets each pass against its
// own calibration beside the error against the first (--no-recalibrate: not): a VM's speed drifts
// over minutes, and that column tells the drift from the cost model's error.
#include <CLI/CLI.hpp>
#include <sys/prctl.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "check.hpp"

using namespace planner_check;

namespace {

ModelCheck find_model(const std::string& name) {
  if (name == "nap") return nap_check();
  if (name == "mlp") return mlp_check();
  if (name == "gpt") return gpt_check();
  CUPIPE_THROW("--model ", name, ": expected nap, mlp or gpt");
}

bool include_asynchronous = false;

planner::Request request_for(const ModelCheck& model, const planner::CostModel& costs, int devices, index_t batch,
                             int max_microbatches) {
  planner::Request r;
  r.asynchronous = include_asynchronous;
  r.model = costs;
  r.devices = devices;
  r.batch = batch;
  r.stage_counts = model.stage_counts;
  r.max_replicas = 1;
  r.all_devices = false;
  r.one_process = true;
  r.split = model.split;
  r.max_microbatches = max_microbatches;
  return r;
}

std::string kib(const std::vector<double>& bytes) {
  std::string out;
  char cell[32];
  for (double b : bytes) {
    std::snprintf(cell, sizeof cell, "%s%.1f", out.empty() ? "" : " / ", b / 1024);
    out += cell;
  }
  return out;
}

/// Per layout of a report, its predicted step for one pass (NaN: not predicted).
using PassPrediction = std::function<std::vector<double>(int pass)>;

/// Every layout of `report`, in o.rounds passes over all of them that share o.steps (each pass
/// its own warm-up): the median over the passes, the largest peaks. With `predict`, each pass
/// first asks it for every layout's prediction (Row::pass_predicted).
std::vector<Row> measure_all(const ModelCheck& model, const planner::Report& report, index_t batch, const RunOptions& o,
                             const PassPrediction& predict = {}) {
  const int steps = std::max(1, o.steps), rounds = std::clamp(o.rounds, 1, steps);
  RunOptions pass = o;
  std::vector<std::vector<Measured>> passes(report.ranked.size());
  std::vector<std::vector<double>> predicted(report.ranked.size());
  for (int r = 0; r < rounds; ++r) {
    if (predict) {
      const std::vector<double> p = predict(r);
      for (std::size_t i = 0; i < report.ranked.size(); ++i) predicted[i].push_back(i < p.size() ? p[i] : std::nan(""));
    }
    for (std::size_t i = 0; i < report.ranked.size(); ++i) {
      pass.steps = steps / rounds + (r < steps % rounds ? 1 : 0);  // the passes share the steps
      passes[i].push_back(model.run(report.ranked[i], batch, pass));
      std::fprintf(stderr, "\rpass %d of %d: %zu/%zu layouts measured", r + 1, rounds, i + 1, report.ranked.size());
    }
  }
  std::fprintf(stderr, "\n");
  std::vector<Row> rows;
  for (std::size_t i = 0; i < report.ranked.size(); ++i) rows.push_back({report.ranked[i], combined(passes[i]), predicted[i]});
  return rows;
}

int check_model(const std::string& name, int devices, index_t batch, int max_microbatches, const RunOptions& o) {
  const ModelCheck model = find_model(name);
  if (batch == 0) batch = model.default_batch;
  const std::vector<int> counts = planner::planned_microbatch_counts(model.stage_counts, batch, max_microbatches);
  const planner::CostModel costs = model.calibrate(batch, counts);
  std::printf("calibrated cost model (per layer, ms for %lld rows, of it fixed):\n", (long long)costs.profiled_rows);
  for (const planner::LayerCost& l : costs.layers)
    std::printf("  %-28s F %.4f (%.4f)  B %.4f (%.4f)  W %.4f (%.4f)\n", l.name.c_str(), l.forward * 1e3, l.forward_fixed * 1e3,
                l.backward_input * 1e3, l.backward_input_fixed * 1e3, l.backward_weight * 1e3, l.backward_weight_fixed * 1e3);
  std::printf("  optimizer step: %.3g ns per parameter; step overhead %.3f ms; %.1f us per action; hand-over %.1f us + "
              "%.2f GB/s; a waiting worker wakes %.1f us after a post\n\n",
              costs.update_seconds_per_param * 1e9, costs.step_overhead_seconds * 1e3, costs.action_overhead_seconds * 1e6,
              costs.link_latency * 1e6, costs.link_bytes_per_second / 1e9, costs.wake_seconds * 1e6);
  if (costs.contention.size() > 1) {
    std::printf("  an action takes");
    for (std::size_t n = 1; n < costs.contention.size(); ++n) std::printf(" x%.3f with %zu workers busy%s", costs.contention[n], n + 1, n + 1 < costs.contention.size() ? "," : "");
    std::printf(" (against one alone)\n\n");
  }
  const planner::Report report = plan(request_for(model, costs, devices, batch, max_microbatches));
  std::printf("### %s: %d devices, batch %lld\n\n%s\n", model.description.c_str(), devices, (long long)batch,
              ("```\n" + planner::describe(report, costs) + "```").c_str());
  // Each pass after the first calibrates again just before it and predicts the same layouts with
  // that: what the error is with the machine's speed of the moment (a VM's drifts over minutes),
  // beside the error against the first calibration (what --plan auto would see).
  const PassPrediction predict = [&](int pass) {
    std::vector<double> out;
    if (pass == 0) {
      for (const planner::Layout& l : report.ranked) out.push_back(l.step_seconds);
      return out;
    }
    const planner::Report now = plan(request_for(model, model.calibrate(batch, counts), devices, batch, max_microbatches));
    for (const planner::Layout& l : report.ranked) {
      out.push_back(std::nan(""));
      for (const planner::Layout& a : now.ranked)
        if (a.describe() == l.describe()) out.back() = a.step_seconds;
    }
    return out;
  };
  const std::vector<Row> rows = measure_all(model, report, batch, o, o.recalibrate ? predict : PassPrediction{});
  std::printf("\n| layout | predicted step ms | measured step ms | error | passes apart | error, each pass against a calibration just "
              "before it | predicted activations KiB per worker | measured | worst error | within any timing's bounds |\n"
              "|---|---|---|---|---|---|---|---|---|---|\n");
  int time_ok = 0, paired_ok = 0, memory_ok = 0, bounded = 0, misses_bounded = 0;
  double worst_time = 0, worst_memory = 0;
  std::vector<double> widths, spreads;  // per worker of each layout: high / low - 1; per layout: passes apart
  for (const Row& r : rows) {
    char paired[32] = "-";
    if (std::isfinite(r.paired_time_error())) std::snprintf(paired, sizeof paired, "%+.1f%%", 100 * r.paired_time_error());
    std::printf("| %s | %.2f | %.2f | %+.1f%% | %.1f%% | %s | %s | %s | %+.1f%% | %s |\n", r.layout.describe().c_str(),
                r.layout.step_seconds * 1e3, r.measured.step_seconds * 1e3, 100 * r.time_error(), 100 * r.pass_spread(), paired,
                kib(r.layout.peak_activation_bytes).c_str(),
                kib(r.measured.peak_activation_bytes).c_str(), 100 * r.memory_error(),
                r.within_bounds() ? "yes" : ("no: " + kib(r.layout.peak_activation_low_bytes) + " to " + kib(r.layout.peak_activation_high_bytes)).c_str());
    time_ok += std::abs(r.time_error()) <= 0.10;
    paired_ok += std::abs(r.paired_time_error()) <= 0.10;  // false for NaN
    spreads.push_back(r.pass_spread());
    memory_ok += std::abs(r.memory_error()) <= 0.05;
    bounded += r.within_bounds();
    for (std::size_t w = 0; w < r.layout.peak_activation_low_bytes.size(); ++w)
      widths.push_back(r.layout.peak_activation_high_bytes[w] / r.layout.peak_activation_low_bytes[w] - 1);
    misses_bounded += std::abs(r.memory_error()) > 0.05 && r.within_bounds();
    if (std::abs(r.time_error()) > std::abs(worst_time)) worst_time = r.time_error();
    if (std::abs(r.memory_error()) > std::abs(worst_memory)) worst_memory = r.memory_error();
  }
  std::printf("\nstep time within 10%%: %d of %zu layouts (worst %+.1f%%); activation peak within 5%%: %d of %zu (worst %+.1f%%); "
              "within the bounds of every timing: %d of %zu (of the %zu peaks off by over 5%%, %d)\n",
              time_ok, rows.size(), 100 * worst_time, memory_ok, rows.size(), 100 * worst_memory, bounded, rows.size(),
              rows.size() - std::size_t(memory_ok), misses_bounded);
  if (o.recalibrate)
    std::printf("step time within 10%% with each pass against a calibration made just before it: %d of %zu layouts\n", paired_ok,
                rows.size());
  if (!spreads.empty())
    std::printf("the same layout's passes apart (slowest over fastest): %.1f%% (median), %.1f%% (most)\n",
                100 * cupipe::detail::median(spreads), 100 * *std::max_element(spreads.begin(), spreads.end()));
  if (!widths.empty()) {
    const auto tight = std::count_if(widths.begin(), widths.end(), [](double x) { return x < 1e-9; });
    std::printf("the bounds: equal (no race) for %td of %zu workers; the high bound over the low by %.1f%% (median), %.1f%% (most)\n",
                tight, widths.size(), 100 * cupipe::detail::median(widths), 100 * *std::max_element(widths.begin(), widths.end()));
  }
  // Did the machine change speed while the layouts ran? The same calibration again, after them:
  // its predictions for the same layouts against the first's (a diagnostic; the counts above use
  // the first calibration only, as --plan auto would).
  const planner::CostModel again = model.calibrate(batch, counts);
  const planner::Report second = plan(request_for(model, again, devices, batch, max_microbatches));
  std::vector<double> ratios;
  for (const Row& r : rows)
    for (const planner::Layout& l : second.ranked)
      if (l.describe() == r.layout.describe()) ratios.push_back(l.step_seconds / r.layout.step_seconds);
  if (!ratios.empty())
    std::printf("calibrated again after the measurements: its predictions are %+.1f%% of the first's (median over %zu layouts)\n",
                100 * (cupipe::detail::median(ratios) - 1), ratios.size());
  return 0;
}

/// The candidate microbatch count whose microbatch is nearest sqrt(batch) samples.
int sqrt_rule(index_t batch, const std::vector<Row>& rows) {
  const double target = double(batch) / std::sqrt(double(batch));
  int best = 1;
  for (const Row& r : rows)
    if (std::abs(double(r.layout.microbatches) - target) < std::abs(double(best) - target)) best = r.layout.microbatches;
  return best;
}

int sweep(int max_microbatches, const RunOptions& o) {
  struct Config {
    std::string model;
    int devices;
    index_t batch;
  };
  std::vector<Config> configs;
  for (int devices : {1, 2, 4})
    for (index_t batch : {8, 16, 32, 64}) configs.push_back({"nap", devices, batch});
  for (int devices : {1, 2})
    for (index_t batch : {64, 256, 1024}) configs.push_back({"mlp", devices, batch});
  for (index_t batch : {4, 16}) configs.push_back({"gpt", 2, batch});
  std::printf("| model | devices | batch | layouts | planner's choice | its measured ms | best measured | ms | choice / best | the two again, side by side | sqrt(batch) rule: m | its best ms | rule / best |\n"
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|\n");
  int within = 0;
  double worst = 0;
  for (const Config& c : configs) {
    const ModelCheck model = find_model(c.model);
    // Calibrated at this configuration's batch (and a quarter of it).
    const planner::CostModel costs = model.calibrate(c.batch, planner::planned_microbatch_counts(model.stage_counts, c.batch, max_microbatches));
    const planner::Report report = plan(request_for(model, costs, c.devices, c.batch, max_microbatches));
    const std::vector<Row> rows = measure_all(model, report, c.batch, o);
    const Row* best = &rows.front();
    for (const Row& r : rows)
      if (r.measured.step_seconds < best->measured.step_seconds) best = &r;
    const Row& chosen = rows.front();  // the planner's ranking: best predicted first
    const double ratio = chosen.measured.step_seconds / best->measured.step_seconds;
    // The fastest of ~100 noisy measurements is biased low (the winner's curse): where it is not
    // the planner's choice, the two run again side by side, alternating, 3 rounds each, and the
    // ratio of their medians is the one the bound is checked on.
    double side_by_side = 1.0;
    if (best != &chosen) {
      std::vector<double> mine, theirs;
      for (int round = 0; round < 3; ++round) {
        mine.push_back(model.run(chosen.layout, c.batch, o).step_seconds);
        theirs.push_back(model.run(best->layout, c.batch, o).step_seconds);
      }
      std::sort(mine.begin(), mine.end());
      std::sort(theirs.begin(), theirs.end());
      side_by_side = mine[1] / theirs[1];
    }
    // The rule fixes m and leaves the rest to the measurements: its best measured layout.
    const int m = sqrt_rule(c.batch, rows);
    const Row* rule = nullptr;
    for (const Row& r : rows)
      if (r.layout.microbatches == m && (!rule || r.measured.step_seconds < rule->measured.step_seconds)) rule = &r;
    within += side_by_side <= 1.05;
    worst = std::max(worst, side_by_side);
    std::printf("| %s | %d | %lld | %zu | %s | %.2f | %s | %.2f | %.3f | %.3f | %d | %.2f | %.3f |\n", c.model.c_str(), c.devices,
                (long long)c.batch, rows.size(), chosen.layout.describe().c_str(), chosen.measured.step_seconds * 1e3,
                best->layout.describe().c_str(), best->measured.step_seconds * 1e3, ratio, side_by_side, m,
                rule->measured.step_seconds * 1e3, rule->measured.step_seconds / best->measured.step_seconds);
    std::fflush(stdout);
  }
  std::printf("\nthe planner's choice within 5%% of the best measured layout (side by side): %d of %zu configurations "
              "(worst %.3f)\n",
              within, configs.size(), worst);
  return 0;
}

/// --host-cache: a few layouts of `name` with HostBlockCache off and on, alternating, 5 rounds:
/// what reusing freed host blocks saves a step (side by side, one run).
int host_cache_ab(const std::string& name, index_t batch, const RunOptions& o) {
  const ModelCheck model = find_model(name);
  if (batch == 0) batch = model.default_batch;
  std::printf("### %s, batch %lld: HostBlockCache off and on, alternating, 5 rounds (median of each)\n\n"
              "| layout | cache off ms | cache on ms | on / off |\n|---|---|---|---|\n",
              model.description.c_str(), (long long)batch);
  struct Case {
    const char* schedule;
    int stages, microbatches;
  };
  for (const Case& c : {Case{"gpipe", 1, 1}, Case{"1f1b", 1, 4}, Case{"zb-h1", 2, 4}}) {
    planner::Layout layout;
    layout.schedule = c.schedule;
    layout.stages = c.stages;
    layout.microbatches = c.microbatches;
    std::vector<double> off, on;
    for (int round = 0; round < 5; ++round) {
      HostBlockCache::instance().set_capacity(0);
      off.push_back(model.run(layout, batch, o).step_seconds);
      HostBlockCache::instance().set_capacity(std::size_t(1) << 30);
      on.push_back(model.run(layout, batch, o).step_seconds);
    }
    std::sort(off.begin(), off.end());
    std::sort(on.begin(), on.end());
    std::printf("| %s | %.2f | %.2f | %.3f |\n", layout.describe().c_str(), off[2] * 1e3, on[2] * 1e3, on[2] / off[2]);
    std::fflush(stdout);
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"The planner's predictions against measured runs (cupipe, host backend)"};
  std::string model = "nap";
  int devices = 0, max_microbatches = 16;
  index_t batch = 0;
  bool run_sweep = false, across_processes = false, host_cache = false;
  std::vector<index_t> mpi_batches{8, 16, 32, 64};
  RunOptions o;
  app.add_option("--model", model, "nap, mlp or gpt")->capture_default_str();
  app.add_option("--devices", devices, "workers (default: 4 for nap, else the cores, at most 2)");
  app.add_option("--batch", batch, "samples per batch (default: the model's)");
  app.add_option("--max-microbatches", max_microbatches, "most microbatches the planner tries")->capture_default_str();
  app.add_option("--steps", o.steps, "measured steps per layout (after one warm-up step per pass)")->capture_default_str();
  app.add_option("--rounds", o.rounds, "passes over every layout that share the steps (each its own warm-up); the median")
      ->capture_default_str();
  app.add_flag("!--no-recalibrate", o.recalibrate,
               "--model: do not calibrate again before each pass after the first (the paired error column)");
  app.add_flag("--sweep", run_sweep, "20 configurations, every layout measured");
  app.add_flag("--host-cache", host_cache, "the model's step with HostBlockCache off and on, side by side");
  app.add_flag("--asynchronous", include_asynchronous, "plan PipeDream and 2BW layouts too");
  app.add_flag("--mpi", across_processes, "under mpirun: each process a device, layouts with replicas (the nap model)");
  app.add_option("--mpi-batches", mpi_batches, "with --mpi: the batches to plan and measure")->capture_default_str();
  CLI11_PARSE(app, argc, argv);
  try {
    backend::Host<float>::set_blas_threads(1);  // a worker is a core
    // The sleeping layers' sleeps end within microseconds, not the default 50 us of timer slack;
    // the pipeline's threads inherit the setting.
    prctl(PR_SET_TIMERSLACK, 1UL, 0UL, 0UL, 0UL);
    if (across_processes) {
#if CUPIPE_HAS_MPI
      return mpi_sweep(argc, argv, max_microbatches, o, mpi_batches);
#else
      CUPIPE_THROW("--mpi: this planner_check was built without MPI (install libopenmpi-dev and reconfigure)");
#endif
    }
    if (run_sweep) return sweep(max_microbatches, o);
    if (host_cache) return host_cache_ab(model, batch, o);
    if (devices == 0) devices = model == "nap" ? 4 : int(std::clamp(std::thread::hardware_concurrency(), 1u, 2u));
    return check_model(model, devices, batch, max_microbatches, o);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "planner_check: %s\n", e.what());
    return 1;
  }
}
