// SPDX-License-Identifier: Apache-2.0
// Measured against predicted: every schedule policy of the library on the host runtime, with layers
// whose F, B and W are sleeps of known length, so the measured bubble can be set beside the
// simulator's and the published formula's in one run. Prints one markdown table.
//   schedule_timing [--stages 4] [--microbatches 8] [--unit-ms 4] [--fbw 1:1:1] [--runs 3] [--steps K]
// Per stage F, B and W take unit times the --fbw ratios (a chunk of a 2-chunk schedule takes half);
// schedules that do not split the backward run B and W together. Asynchronous schedules (pipedream, 2bw) run 2 batches a step.
// The reported run of each schedule is the one with the median makespan.
// --steps K (K >= 3): optimizer post-validation instead. Each flush schedule runs K steps back to back
// (Pipeline::train_steps, PipelineOptions::post_validation) and the table gives the steady-state
// bubble (schedule::steady_state_bubble: steps 1..K-2) measured and simulated (on K steps as one
// plan), the median of --runs runs.
#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <sstream>
#include <string>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

#include "cupipe/cupipe.hpp"
#include "identity_layers.hpp"

using namespace cupipe;

namespace {

using Host = backend::Host<double>;

/// Sleep lengths in microseconds, per virtual stage, set before each schedule runs.
struct Durations {
  std::atomic<int> forward{0}, input_grad{0}, weight_grad{0};
};
std::array<Durations, 16> durations;

void nap(int us) { std::this_thread::sleep_for(std::chrono::microseconds(us)); }

/// An identity of known duration with one parameter, so its weight gradient (W) is a real action.
template <int Id>
struct NapHooks {
  static void forward(const auto&) { nap(durations[Id].forward); }
  static void backward_input(const auto&) { nap(durations[Id].input_grad); }
  static void backward_weight(const auto&) { nap(durations[Id].weight_grad); }
};
template <int Id>
struct Nap : test::IdentityWithWeight<NapHooks<Id>> {
  static std::string describe() { return "Nap<" + std::to_string(Id) + ">"; }
};

/// The model's fixed input width, ahead of Nap<0> (the first layer of a model has no input gradient
/// to compute, and Nap<0>'s must run).
struct Entry : test::Identity<> {
  static constexpr index_t in_features = 4;
  static constexpr double forward_flops_per_sample(index_t) { return 4; }
  static std::string describe() { return "Entry<4>"; }
};

template <class Seq>
struct nap_stages_impl;
template <std::size_t... I>
struct nap_stages_impl<std::index_sequence<I...>> {
  using type = StageList<Stage<Entry, Nap<0>>, Stage<Nap<int(I) + 1>>...>;
};
template <int N>
using NapStages = typename nap_stages_impl<std::make_index_sequence<std::size_t(N - 1)>>::type;

struct Options {
  int stages = 4;
  int microbatches = 8;
  double unit_ms = 4;
  std::array<double, 3> fbw{1, 1, 1};  // F, B, W of a stage, in units
  int runs = 3;
  int steps = 0;  // >= 3: post-validated steady state
};

/// The published bubble fraction for per-stage costs F, B, W, and where it comes from.
struct Published {
  double bubble;
  const char* formula;
};

Published published(std::string_view name, int p, int m, int chunks, int batches, std::array<double, 3> fbw) {
  const double pm1 = p - 1, f = fbw[0], b = fbw[1], w = fbw[2];
  const double work = m * (f + b + w);  // per worker and batch
  const auto idle = [&](double per_worker) { return per_worker / (work + per_worker); };
  if (name == "gpipe" || name == "1f1b") return {pm1 / (m + pm1), "(p-1)/(m+p-1)"};
  if (name == "interleaved" || name == "bfs") return {pm1 / (chunks * m + pm1), "(p-1)/(Vm+p-1)"};
  if (name == "pipedream" || name == "2bw") return {pm1 / (batches * m + pm1), "(p-1)/(bm+p-1), b batches a step"};
  // Zero bubble (Qi et al.): idle (p-1)(F+B-W) for H1, (p-1)(F+B-2W) for H2; ZB-V about 0. The last two
  // assume the optimizer's post-validation: one step alone keeps its ramp; --steps K measures the steady state.
  if (name == "zb-h1") return {idle(pm1 * (f + b - w)), "(p-1)(F+B-W) idle"};
  if (name == "zb-h2") return {idle(std::max(0.0, pm1 * (f + b - 2 * w))), "(p-1)(F+B-2W) idle, with post-validation"};
  if (name == "zbv") return {0, "about 0, with post-validation"};
  // Qi et al. 2024 publish V-Half's and V-Min's building blocks (lifespans, memory), not a bubble formula.
  if (name == "v-half" || name == "v-min") return {std::nan(""), "no closed form published"};
  // deepseek-ai/DualPipe: (PP/2-1)(F&B + B - 3W) idle in chunk costs (half a stage's), B the whole
  // backward, F&B = F + B on the host (a pair runs back to back). A bound, met when F = B + W.
  if (name == "dualpipev") {
    const double fc = f / 2, bc = (b + w) / 2, wc = w / 2;
    return {idle(pm1 * ((fc + bc) + bc - 3 * wc)), "(PP/2-1)(F&B+B-3W) idle"};
  }
  return {std::nan(""), "unknown"};
}

/// The published bubble as a table cell and the measured figure's distance from it.
std::pair<std::string, std::string> published_cells(const Published& pub, double measured) {
  char cell[160], gap[32];
  if (std::isnan(pub.bubble)) {
    std::snprintf(cell, sizeof cell, "%s", pub.formula);
    std::snprintf(gap, sizeof gap, "n/a");
  } else {
    std::snprintf(cell, sizeof cell, "%s = %.4f", pub.formula, pub.bubble);
    std::snprintf(gap, sizeof gap, "%+.1f", 100 * (measured - pub.bubble));
  }
  return {cell, gap};
}

/// Sets every virtual stage's sleeps from the unit and the F:B:W ratios (a chunk is 1/V of a stage).
void set_durations(const Options& o, int virtual_stages, int chunks) {
  const int unit_us = int(std::lround(o.unit_ms * 1000.0 / chunks));
  for (int k = 0; k < virtual_stages; ++k) {
    durations[std::size_t(k)].forward = int(std::lround(unit_us * o.fbw[0]));
    durations[std::size_t(k)].input_grad = int(std::lround(unit_us * o.fbw[1]));
    durations[std::size_t(k)].weight_grad = int(std::lround(unit_us * o.fbw[2]));
  }
}

/// One batch of 2 rows per microbatch.
struct NapBatch {
  std::vector<double> x;
  std::vector<std::int32_t> labels;
  index_t rows;
  explicit NapBatch(index_t rows_, std::uint64_t salt) : rows(rows_) {
    Rng rng(salt);
    x.resize(static_cast<std::size_t>(rows * 4));
    for (double& v : x) v = rng.uniform(-1.0, 1.0);
    labels.resize(static_cast<std::size_t>(rows));
    for (std::size_t i = 0; i < labels.size(); ++i) labels[i] = std::int32_t(i % 4);
  }
  ConstView<double> inputs() const { return {x.data(), Shape{rows, 4}}; }
  ConstView<std::int32_t> targets() const { return {labels.data(), Shape{rows}}; }
};

/// Post-validated steady state: K steps back to back, the bubble of steps 1..K-2.
template <class Schedule, int P>
void measure_steady(const Options& o) {
  if constexpr (Schedule::update == schedule::UpdateRule::flush) {
    constexpr int chunks = Schedule::chunks;
    using Pipe = Pipeline<NapStages<P * chunks>, Schedule, Host>;
    PipelineOptions options;
    options.microbatches = o.microbatches;
    options.post_validation = true;
    Pipe pipe(options);
    set_durations(o, P * chunks, chunks);
    const double unit = o.unit_ms * 1e-3;
    const schedule::Plan plan = schedule::repeat_steps(pipe.plan(), o.steps);
    const schedule::SimResult sim = schedule::simulate(plan, schedule::Costs{unit * o.fbw[0], unit * o.fbw[1], unit * o.fbw[2]});
    const double simulated = schedule::steady_state_bubble(schedule::timeline_events(plan, sim), P, o.microbatches, o.steps);
    std::vector<NapBatch> data;
    std::vector<typename Pipe::Batch> batches;
    for (int t = 0; t < o.steps; ++t) data.emplace_back(2 * index_t(o.microbatches), std::uint64_t(t + 1));
    for (const NapBatch& b : data) batches.push_back({b.inputs(), b.targets()});
    const optim::SGD sgd({.lr = 1e-3});
    std::vector<double> measured;
    for (int r = 0; r < o.runs; ++r) {
      std::vector<ActionRecord> events;
      for (const StepStats& s : pipe.train_steps(batches, sgd)) events.insert(events.end(), s.actions.begin(), s.actions.end());
      measured.push_back(schedule::steady_state_bubble(events, P, o.microbatches, o.steps));
    }
    std::sort(measured.begin(), measured.end());
    const double median = measured[measured.size() / 2];
    const auto [cell, gap] = published_cells(published(Schedule::name, P, o.microbatches, chunks, 1, o.fbw), median);
    std::printf("| %s | %d | %.4f | %.4f | %+.1f | %s | %s |\n", std::string(Schedule::name).c_str(), chunks, simulated, median,
                100 * (median - simulated), cell.c_str(), gap.c_str());
  } else {
    std::printf("| %s | %d | asynchronous: no flush to remove | | | | |\n", std::string(Schedule::name).c_str(),
                Schedule::chunks);
  }
  std::fflush(stdout);
}

template <class Schedule, int P>
void measure(const Options& o) {
  constexpr int chunks = Schedule::chunks;
  using Pipe = Pipeline<NapStages<P * chunks>, Schedule, Host>;
  const bool async = Schedule::update != schedule::UpdateRule::flush;
  PipelineOptions options;
  options.microbatches = o.microbatches;
  options.batches = async ? 2 : 1;
  Pipe pipe(options);
  set_durations(o, P * chunks, chunks);
  const double unit = o.unit_ms * 1e-3;
  const schedule::SimResult simulated =
      schedule::simulate(pipe.plan(), schedule::Costs{unit * o.fbw[0], unit * o.fbw[1], unit * o.fbw[2]});
  const index_t rows = 2 * index_t(o.microbatches) * options.batches;
  Rng rng(1);
  std::vector<double> x(static_cast<std::size_t>(rows * 4));
  for (double& v : x) v = rng.uniform(-1.0, 1.0);
  std::vector<std::int32_t> labels(static_cast<std::size_t>(rows));
  for (std::size_t i = 0; i < labels.size(); ++i) labels[i] = std::int32_t(i % 4);
  const optim::SGD sgd({.lr = 1e-3});
  std::vector<StepStats> runs;
  for (int r = 0; r < o.runs; ++r)
    runs.push_back(pipe.train_step(ConstView<double>{x.data(), Shape{rows, 4}},
                                   ConstView<std::int32_t>{labels.data(), Shape{rows}}, sgd));
  std::sort(runs.begin(), runs.end(), [](const StepStats& a, const StepStats& b) { return a.makespan_seconds < b.makespan_seconds; });
  const StepStats& median = runs[runs.size() / 2];
  const auto [cell, gap] =
      published_cells(published(Schedule::name, P, o.microbatches, chunks, options.batches, o.fbw), median.bubble_fraction);
  std::printf("| %s | %d | %.1f | %.1f | %.4f | %.4f | %+.1f | %s | %s |\n", std::string(Schedule::name).c_str(), chunks,
              simulated.makespan * 1e3, median.makespan_seconds * 1e3, simulated.bubble_fraction, median.bubble_fraction,
              100 * (median.bubble_fraction - simulated.bubble_fraction), cell.c_str(), gap.c_str());
  std::fflush(stdout);
}

}  // namespace

int main(int argc, char** argv) {
  try {
    Options o;
    for (int i = 1; i < argc; ++i) {
      const std::string arg = argv[i];
      if (arg == "--help" || arg == "-h") {
        std::printf("usage: schedule_timing [--stages 2|4] [--microbatches M] [--unit-ms MS] [--fbw F:B:W] [--runs N]\n"
                    "                       [--steps K]\n"
                    "Times every registered schedule with sleeping layers (F, B, W of unit-ms x the ratio per stage)\n"
                    "and prints measured bubble beside the simulator's and the published formula's. With --steps K\n"
                    "(at least 3), runs K post-validated steps back to back and reports the steady-state bubble.\n");
        return 0;
      }
      CUPIPE_REQUIRE(i + 1 < argc, "schedule_timing: ", arg, " needs a value");
      const std::string value = argv[++i];
      if (arg == "--stages") o.stages = std::stoi(value);
      else if (arg == "--microbatches") o.microbatches = std::stoi(value);
      else if (arg == "--unit-ms") o.unit_ms = std::stod(value);
      else if (arg == "--runs") o.runs = std::stoi(value);
      else if (arg == "--steps") o.steps = std::stoi(value);
      else if (arg == "--fbw") {
        char colon1 = 0, colon2 = 0;
        std::istringstream in(value);
        in >> o.fbw[0] >> colon1 >> o.fbw[1] >> colon2 >> o.fbw[2];
        CUPIPE_REQUIRE(in && in.peek() == EOF && colon1 == ':' && colon2 == ':' && o.fbw[0] > 0 && o.fbw[1] > 0 &&
                           o.fbw[2] > 0,
                       "schedule_timing: --fbw takes three positive ratios F:B:W, such as 2:1:1; got '", value, "'");
      } else CUPIPE_THROW("schedule_timing: unknown option ", arg, " (expected --stages, --microbatches, --unit-ms, --fbw, --runs, --steps)");
    }
    CUPIPE_REQUIRE(o.stages == 2 || o.stages == 4, "schedule_timing: --stages must be 2 or 4, got ", o.stages);
    CUPIPE_REQUIRE(o.microbatches >= 1 && o.runs >= 1 && o.unit_ms > 0,
                   "schedule_timing: --microbatches, --runs and --unit-ms must be positive");
    CUPIPE_REQUIRE(o.steps == 0 || o.steps >= 3, "schedule_timing: --steps needs at least 3 (the steady state leaves out "
                                                 "the first and the last step), got ", o.steps);
    if (o.steps > 0) {
      std::printf("stages %d, microbatches %d, F = %.1f ms, B = %.1f ms, W = %.1f ms per stage, %d post-validated steps, "
                  "steady state = steps 1..%d, median of %d runs (host backend, sleeping layers)\n\n",
                  o.stages, o.microbatches, o.unit_ms * o.fbw[0], o.unit_ms * o.fbw[1], o.unit_ms * o.fbw[2], o.steps,
                  o.steps - 2, o.runs);
      std::printf("| schedule | chunks | simulated steady bubble | measured steady bubble | measured - simulated (points) | "
                  "published | measured - published (points) |\n");
      std::printf("| --- | --- | --- | --- | --- | --- | --- |\n");
      schedule::for_each_policy([&]<class Schedule>() {
        if (o.stages == 2) measure_steady<Schedule, 2>(o);
        else measure_steady<Schedule, 4>(o);
      });
      return 0;
    }
    std::printf("stages %d, microbatches %d, F = %.1f ms, B = %.1f ms, W = %.1f ms per stage, median of %d runs (host "
                "backend, sleeping layers)\n\n",
                o.stages, o.microbatches, o.unit_ms * o.fbw[0], o.unit_ms * o.fbw[1], o.unit_ms * o.fbw[2], o.runs);
    std::printf("| schedule | chunks | simulated ms | measured ms | simulated bubble | measured bubble | "
                "measured - simulated (points) | published | measured - published (points) |\n");
    std::printf("| --- | --- | --- | --- | --- | --- | --- | --- | --- |\n");
    schedule::for_each_policy([&]<class Schedule>() {
      if (o.stages == 2) measure<Schedule, 2>(o);
      else measure<Schedule, 4>(o);
    });
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "schedule_timing: %s\n", e.what());
    return 1;
  }
}
