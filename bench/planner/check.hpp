// SPDX-License-Identifier: Apache-2.0
// planner_check: the planner's predictions against measured runs. Shared by the per-model
// translation units (nap.cpp, mlp.cpp, gpt.cpp) and main.cpp.
#pragma once

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "cupipe/cupipe.hpp"
#include "cupipe/planner/calibrate.hpp"
#include "cupipe/planner/planner.hpp"

namespace planner_check {

using namespace cupipe;

/// What one layout measured, in one process on the host backend.
struct Measured {
  double step_seconds = 0;                    ///< per batch: median wall time of train_step / batches
  double makespan_seconds = 0;                ///< per batch: median first action's start to last action's end
  std::vector<double> peak_activation_bytes;  ///< per worker: the allocator's activations peak, most over the steps
  std::vector<double> pass_seconds;           ///< combined(): each pass's step_seconds, in order
};

/// Several measurements of one layout as one: the median step and makespan, each worker's largest
/// activation peak.
inline Measured combined(const std::vector<Measured>& passes) {
  Measured out;
  std::vector<double> steps, spans;
  for (const Measured& m : passes) {
    steps.push_back(m.step_seconds);
    out.pass_seconds.push_back(m.step_seconds);
    spans.push_back(m.makespan_seconds);
    out.peak_activation_bytes.resize(std::max(out.peak_activation_bytes.size(), m.peak_activation_bytes.size()), 0.0);
    for (std::size_t w = 0; w < m.peak_activation_bytes.size(); ++w)
      out.peak_activation_bytes[w] = std::max(out.peak_activation_bytes[w], m.peak_activation_bytes[w]);
  }
  out.step_seconds = cupipe::detail::median(steps);
  out.makespan_seconds = cupipe::detail::median(spans);
  return out;
}

/// A layout the planner reported, with what it measured.
struct Row {
  planner::Layout layout;
  Measured measured;
  /// Per pass: the layout's step as predicted by a calibration made just before that pass (the
  /// first pass: layout.step_seconds); empty where the check did not calibrate again.
  std::vector<double> pass_predicted{};
  double time_error() const { return layout.step_seconds / measured.step_seconds - 1; }
  /// The median over the passes of each pass's prediction over its measurement, less 1: the error
  /// with the machine's speed as it was just before each pass (NaN without pass_predicted).
  double paired_time_error() const {
    std::vector<double> ratios;
    for (std::size_t k = 0; k < pass_predicted.size() && k < measured.pass_seconds.size(); ++k)
      if (std::isfinite(pass_predicted[k])) ratios.push_back(pass_predicted[k] / measured.pass_seconds[k]);
    return ratios.empty() ? std::nan("") : cupipe::detail::median(ratios) - 1;
  }
  /// The slowest pass over the fastest, less 1: how far apart the same layout measured.
  double pass_spread() const {
    if (measured.pass_seconds.empty()) return 0;
    const auto [lo, hi] = std::minmax_element(measured.pass_seconds.begin(), measured.pass_seconds.end());
    return *hi / *lo - 1;
  }
  /// The worst worker's predicted / measured activation peak - 1.
  double memory_error() const {
    double worst = 0;
    for (std::size_t w = 0; w < measured.peak_activation_bytes.size(); ++w) {
      const double e = layout.peak_activation_bytes[w] / measured.peak_activation_bytes[w] - 1;
      if (std::abs(e) > std::abs(worst)) worst = e;
    }
    return worst;
  }
  /// Whether every worker's measured activation peak lies within the bounds the planner proves for
  /// any timing (Layout::peak_activation_low_bytes, peak_activation_high_bytes).
  bool within_bounds() const {
    for (std::size_t w = 0; w < measured.peak_activation_bytes.size(); ++w) {
      const double m = measured.peak_activation_bytes[w];
      if (m < layout.peak_activation_low_bytes[w] || m > layout.peak_activation_high_bytes[w]) return false;
    }
    return true;
  }
};

struct RunOptions {
  int warmup = 1;  ///< steps before the measured ones (the optimizer's slots are allocated in the first)
  int steps = 3;   ///< measured steps (median)
  /// planner_check --model and --sweep: passes over every layout that share the steps (each pass
  /// its own warm-up step); a slow stretch of the machine then spoils one pass of a layout, not all
  /// of its steps.
  int rounds = 3;
  /// planner_check --model: calibrate again before each pass after the first and set each pass's
  /// measurement against that calibration's prediction too (Row::paired_time_error).
  bool recalibrate = true;
  /// Across processes (planner_check --mpi): this rank runs its stage of its replica; its topology's
  /// stage count must be the layout's. Null: every stage in this process.
  std::shared_ptr<comm::Communicator> communicator{};
};

/// A model the check can plan and run: its calibration, the stage counts compiled in, the split it
/// runs for a virtual stage count (partition<Model, N>), and a runner for a layout.
struct ModelCheck {
  std::string name;
  std::string description;
  index_t default_batch = 0;  ///< samples per batch
  std::vector<int> stage_counts;
  /// The cost model from a profile on `profile_samples` samples, with the largest microbatch of
  /// each of `microbatch_counts` profiled too (planner::calibrate).
  std::function<planner::CostModel(index_t profile_samples, const std::vector<int>& microbatch_counts)> calibrate;
  std::function<std::vector<std::size_t>(int virtual_stages)> split;
  std::function<Measured(const planner::Layout&, index_t samples, const RunOptions&)> run;
};

ModelCheck nap_check();
ModelCheck mlp_check();
ModelCheck gpt_check();

/// planner_check --mpi (mpi.cpp, built with MPI): the nap model planned and measured across the
/// processes of mpirun, with data-parallel replicas, for each of `batches`.
int mpi_sweep(int& argc, char**& argv, int max_microbatches, const RunOptions& options, const std::vector<index_t>& batches);

/// Across processes: `seconds` and `span` become the largest over the world's ranks, and `peaks`
/// (this rank's allocator figures, one per stage, zero for stages it does not run) each stage's
/// largest over its replicas.
inline void slowest_over_ranks(comm::Communicator& comm, double& seconds, double& span, std::vector<double>& peaks) {
  const comm::Topology& t = comm.topology();
  const std::size_t stages = std::size_t(t.stages), world = std::size_t(t.world);
  // Per rank: its time, its makespan and each stage's peak, in its own row; the sum fills every row.
  const std::size_t row = 2 + stages;
  std::vector<double> all(world * row, 0.0);
  double* mine = all.data() + std::size_t(t.rank) * row;
  mine[0] = seconds;
  mine[1] = span;
  for (std::size_t s = 0; s < stages && s < peaks.size(); ++s) mine[2 + s] = peaks[s];
  comm.sum_over_world(all.data(), all.size());
  seconds = span = 0;
  peaks.assign(stages, 0.0);
  for (std::size_t r = 0; r < world; ++r) {
    seconds = std::max(seconds, all[r * row]);
    span = std::max(span, all[r * row + 1]);
    for (std::size_t s = 0; s < stages; ++s) peaks[s] = std::max(peaks[s], all[r * row + 2 + s]);
  }
}

/// First layer of each virtual stage of partition<Model, N>, for N in Ns; empty for any other N.
template <class Model, int... Ns>
std::vector<std::size_t> partition_cuts(int virtual_stages) {
  std::vector<std::size_t> cuts;
  ((virtual_stages == Ns ? (void)(cuts = stage_cuts<partition<Model, std::size_t(Ns)>>()) : void()), ...);
  return cuts;
}

/// Runs `layout` of `Model` (its policy, stage count and microbatches; the split partition<>'s) on
/// `inputs`/`labels` (every row of them: the caller sizes them for the layout's batches) with AdamW
/// on `Backend`, and measures it. Counts: the stage counts compiled in.
/// - In one process (no o.communicator) every worker is a thread here.
/// - Across processes each rank runs its stage on its replica's share of the rows (a row is a
///   sample), as the trainers split a batch. Every step starts together (a sum over the world is the
///   barrier); a step's time is the slowest rank's, and a stage's activation peak the largest over
///   its replicas, so every rank returns the same figures.
template <class Model, class Backend, int... Counts>
Measured run_layout(const planner::Layout& layout, ConstView<model_input_t<typename Model::body, typename Backend::value_type>> inputs,
                    ConstView<std::int32_t> labels, const RunOptions& o) {
  Measured out;
  bool ran = false;
  schedule::with_policy(layout.schedule, [&]<class Policy>() {
    with_stage_count<Counts...>(layout.stages, [&]<int P>() {
      if constexpr (std::size_t(P * Policy::chunks) <= Model::body::size) {
        using Stages = partition_for<Model, P, Policy>;
        PipelineOptions options;
        options.communicator = o.communicator;
        options.microbatches = layout.microbatches;
        options.batches = layout.batches;  // asynchronous schedules: batches a step runs
        options.seed = 1;
        comm::Communicator* comm = o.communicator.get();
        auto x = inputs;
        auto y = labels;
        if (comm) {
          const comm::Topology& t = comm->topology();
          CUPIPE_REQUIRE(t.stages == P, "planner_check: ", layout.describe(), " runs on a communicator of ", t.stages, " stages");
          const index_t rows = labels.numel(), first = rows * t.replica() / t.replicas,
                        count = rows * (t.replica() + 1) / t.replicas - first;
          x = decltype(x){inputs.data() + first * inputs.cols(), Shape{count, inputs.cols()}};
          y = decltype(y){labels.data() + first, Shape{count}};
        }
        // Start each run with the host cache empty, as a training run of one layout does: nothing
        // another layout left there is reused or has to be evicted first.
        HostBlockCache::instance().trim();
        Pipeline<Stages, Policy, Backend> pipe(options);
        const optim::AdamW adamw({.lr = 1e-5});
        std::vector<double> wall, makespan;
        out.peak_activation_bytes.assign(std::size_t(P), 0.0);
        for (int s = 0; s < o.warmup + o.steps; ++s) {
          if (comm) (void)comm->sum_over_world(0.0);  // every rank starts the step together
          const auto start = std::chrono::steady_clock::now();
          const StepStats stats = pipe.train_step(x, y, adamw);
          double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
          double span = stats.makespan_seconds;
          std::vector<double> peaks(stats.peak_activation_bytes.begin(), stats.peak_activation_bytes.end());
          if (comm) slowest_over_ranks(*comm, seconds, span, peaks);
          if (s < o.warmup) continue;
          wall.push_back(seconds / double(layout.batches));
          makespan.push_back(span / double(layout.batches));
          for (std::size_t w = 0; w < peaks.size() && w < out.peak_activation_bytes.size(); ++w)
            out.peak_activation_bytes[w] = std::max(out.peak_activation_bytes[w], peaks[w]);
        }
        out.step_seconds = cupipe::detail::median(wall);
        out.makespan_seconds = cupipe::detail::median(makespan);
        ran = true;
      }
    });
  });
  CUPIPE_REQUIRE(ran, "planner_check: ", layout.describe(), " is not compiled into this program");
  return out;
}

}  // namespace planner_check
