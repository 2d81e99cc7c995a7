// SPDX-License-Identifier: Apache-2.0
// planner_check: the planner's predictions against measured runs. Shared by the per-model
// translation units (nap.cpp, mlp.cpp, gpt.cpp) and main.cpp.
#pragma once

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <functional>
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
};

struct RunOptions {
  int warmup = 1;  ///< steps before the measured ones (the optimizer's slots are allocated in the first)
  int steps = 3;   ///< measured steps (median)
};

/// A model the check can plan and run: its calibration, the stage counts compiled in, the split it
/// runs for a virtual stage count (partition<Model, N>), and a runner for a layout.
struct ModelCheck {
  std::string name;
  std::string description;
  index_t default_batch = 0;  ///< samples per batch
  std::vector<int> stage_counts;
  std::function<planner::CostModel(index_t profile_samples)> calibrate;
  std::function<std::vector<std::size_t>(int virtual_stages)> split;
  std::function<Measured(const planner::Layout&, index_t samples, const RunOptions&)> run;
};

ModelCheck nap_check();
ModelCheck mlp_check();
ModelCheck gpt_check();

/// First layer of each virtual stage of partition<Model, N>, for N in Ns; empty for any other N.
template <class Model, int... Ns>
std::vector<std::size_t> partition_cuts(int virtual_stages) {
  std::vector<std::size_t> cuts;
  ((virtual_stages == Ns ? (void)(cuts = stage_cuts<partition<Model, std::size_t(Ns)>>()) : void()), ...);
  return cuts;
}

/// Runs `layout` of `Model` (its policy, stage count and microbatches; the split partition<>'s) on
/// `inputs`/`labels` (every row of them: the caller sizes them for the layout's batches) with AdamW,
/// in one process on `Backend`, and measures it. Counts: the stage counts compiled in.
template <class Model, class Backend, int... Counts>
Measured run_layout(const planner::Layout& layout, ConstView<model_input_t<typename Model::body, typename Backend::value_type>> inputs,
                    ConstView<std::int32_t> labels, const RunOptions& o) {
  Measured out;
  bool ran = false;
  schedule::with_policy(layout.schedule, [&]<class Policy>() {
    with_stage_count<Counts...>(layout.stages, [&]<int P>() {
      if constexpr (std::size_t(P * Policy::chunks) <= Model::body::size) {
        using Stages = partition<Model, std::size_t(P * Policy::chunks)>;
        PipelineOptions options;
        options.microbatches = layout.microbatches;
        options.batches = layout.batches;  // asynchronous schedules: batches a step runs
        options.seed = 1;
        Pipeline<Stages, Policy, Backend> pipe(options);
        const optim::AdamW adamw({.lr = 1e-5});
        std::vector<double> wall, makespan;
        out.peak_activation_bytes.assign(std::size_t(P), 0.0);
        for (int s = 0; s < o.warmup + o.steps; ++s) {
          const auto start = std::chrono::steady_clock::now();
          const StepStats stats = pipe.train_step(inputs, labels, adamw);
          const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
          if (s < o.warmup) continue;
          wall.push_back(seconds / double(layout.batches));
          makespan.push_back(stats.makespan_seconds / double(layout.batches));
          for (std::size_t w = 0; w < stats.peak_activation_bytes.size(); ++w)
            out.peak_activation_bytes[w] = std::max(out.peak_activation_bytes[w], double(stats.peak_activation_bytes[w]));
        }
        const auto median = [](std::vector<double> v) {
          std::nth_element(v.begin(), v.begin() + std::ptrdiff_t(v.size() / 2), v.end());
          return v[v.size() / 2];
        };
        out.step_seconds = median(wall);
        out.makespan_seconds = median(makespan);
        ran = true;
      }
    });
  });
  CUPIPE_REQUIRE(ran, "planner_check: ", layout.describe(), " is not compiled into this program");
  return out;
}

}  // namespace planner_check
