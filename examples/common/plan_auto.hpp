// SPDX-License-Identifier: Apache-2.0
// --plan auto, shared by the trainers' main.cpp (host code only: trainer.hpp, which nvcc also
// compiles, does not include it): plan a run in this process from a cost model measured here, print
// the report, and hand back the best layout.
#pragma once

#include <algorithm>
#include <cstdio>
#include <thread>
#include <utility>
#include <vector>

#include "cupipe/planner/calibrate.hpp"
#include "cupipe/planner/planner.hpp"

namespace cupipe::examples {

/// Workers for --plan auto: `requested`, or the cores (at most 4) when 0.
inline int plan_workers(int requested) {
  return requested > 0 ? requested : int(std::clamp(std::thread::hardware_concurrency(), 1u, 4u));
}

/// Plans one process on `workers` workers (one core each) for `batch` samples, with the stage counts
/// and splits the program compiles (`split`: a virtual stage count's cuts, empty where it has none),
/// prints the report, and returns the best layout (throws, naming the refusals, when none fits).
template <class Split>
planner::Layout plan_in_process(planner::CostModel model, int workers, index_t batch, std::vector<int> stage_counts,
                                Split split) {
  planner::Request request;
  request.model = std::move(model);
  request.devices = workers;
  request.batch = batch;
  request.stage_counts = std::move(stage_counts);
  request.max_replicas = 1;
  request.all_devices = false;
  request.one_process = true;
  request.max_microbatches = int(std::min<index_t>(64, batch));
  request.split = std::move(split);
  const planner::Report report = plan(request);
  const planner::Layout best = report.best();
  std::printf("--plan auto on %d workers (one core each), predicted from a profile of this machine:\n%s", workers,
              planner::describe(report, request.model).c_str());
  return best;
}

}  // namespace cupipe::examples
