// SPDX-License-Identifier: Apache-2.0
// The planner for unequal workers (Request::workers): a worker's speed profile from a cost model
// calibrated on its backend, the look-ups the search prices each virtual stage by (its worker's
// layer times, update rate, bytes per value and memory), and the bottleneck partition of the layers
// over workers of different speeds and memories (bottleneck_cuts; with equal workers and no
// constraint it is balanced_cuts, the split of equal workers).
#pragma once

#include <algorithm>
#include <cstddef>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include "cupipe/core/error.hpp"
#include "cupipe/core/memory.hpp"
#include "cupipe/planner/cost_model.hpp"
#include "cupipe/schedule/placement.hpp"

namespace cupipe::planner {

/// The speed profile of a worker whose backend `calibrated` was measured on (planner::calibrate):
/// its layer times, optimizer rate and bytes per value, with `memory_bytes` (0: the request's).
inline WorkerSpeed worker_speed(std::string name, const CostModel& calibrated, double memory_bytes = 0) {
  return {std::move(name), calibrated.layers, calibrated.update_seconds_per_param, calibrated.value_bytes,
          calibrated.compute_bytes, memory_bytes, calibrated.profiled_rows};
}

namespace detail {

/// Each layer's F + B + W seconds: what a split balances.
inline std::vector<double> layer_totals(const std::vector<LayerCost>& layers) {
  std::vector<double> t(layers.size());
  for (std::size_t l = 0; l < layers.size(); ++l) t[l] = layers[l].forward + layers[l].backward_input + layers[l].backward_weight;
  return t;
}

/// The memory rule of a split: a part of layers [s, i) on worker w fits where memory[w] is 0 (no
/// cap) or its parameters (`params` per layer) times bytes_per_param[w] are at most memory[w].
struct PartsFit {
  std::vector<double> param_prefix, bytes_per_param, memory;
  PartsFit(std::size_t layers, const std::vector<double>& params, std::vector<double> bytes, std::vector<double> caps)
      : param_prefix(layers + 1, 0.0), bytes_per_param(std::move(bytes)), memory(std::move(caps)) {
    for (std::size_t i = 0; i < layers && i < params.size(); ++i) param_prefix[i + 1] = param_prefix[i] + params[i];
  }
  bool operator()(std::size_t w, std::size_t s, std::size_t i) const {
    if (w >= memory.size() || memory[w] <= 0 || w >= bytes_per_param.size()) return true;
    return (param_prefix[i] - param_prefix[s]) * bytes_per_param[w] <= memory[w];
  }
};

/// The contiguous split of the layers into `worker_of.size()` parts (virtual stages), part k run by
/// worker worker_of[k], whose slowest part (on its own worker) is fastest. `cost[w][l]`: layer l's
/// seconds on worker w (F + B + W). A part may start only at layer 0 or at one of `cut_points`
/// (empty: anywhere), and where `memory[w]` > 0, a part's parameter state, `params` of its layers
/// times `bytes_per_param[w]`, must fit it (a worker with several parts is checked per part here,
/// and in full by the search's estimate). First index of each part, then the layer count; empty
/// where no split is allowed. Dynamic programming, O(parts x n^2).
inline std::vector<std::size_t> bottleneck_cuts(const std::vector<std::vector<double>>& cost, const std::vector<int>& worker_of,
                                                const std::vector<std::size_t>& cut_points = {},
                                                const std::vector<double>& params = {},
                                                const std::vector<double>& bytes_per_param = {},
                                                const std::vector<double>& memory = {}) {
  CUPIPE_REQUIRE(!cost.empty(), "planner: a split needs at least one worker's layer costs");
  const std::size_t n = cost.front().size(), k = worker_of.size();
  CUPIPE_REQUIRE(k >= 1 && k <= n, "planner: cannot split ", n, " layers into ", k, " stages");
  const std::size_t workers = cost.size();
  std::vector<std::vector<double>> prefix(workers, std::vector<double>(n + 1, 0.0));
  for (std::size_t w = 0; w < workers; ++w) {
    CUPIPE_REQUIRE(cost[w].size() == n, "planner: worker ", w, " has ", cost[w].size(), " layer costs, the model ", n);
    for (std::size_t i = 0; i < n; ++i) prefix[w][i + 1] = prefix[w][i] + cost[w][i];
  }
  const PartsFit fits(n, params, bytes_per_param, memory);
  std::vector<char> may_start(n + 1, cut_points.empty() ? 1 : 0);
  may_start[0] = 1;
  for (const std::size_t c : cut_points)
    if (c < n) may_start[c] = 1;
  constexpr double inf = std::numeric_limits<double>::infinity();
  // best[j][i]: smallest slowest part over the first i layers in j parts; from[j][i]: start of part j.
  std::vector<std::vector<double>> best(k + 1, std::vector<double>(n + 1, inf));
  std::vector<std::vector<std::size_t>> from(k + 1, std::vector<std::size_t>(n + 1, 0));
  best[0][0] = 0;
  for (std::size_t j = 1; j <= k; ++j) {
    const auto w = std::size_t(worker_of[j - 1]);
    CUPIPE_REQUIRE(w < workers, "planner: part ", j - 1, " is on worker ", w, " of ", workers);
    for (std::size_t i = j; i <= n - (k - j); ++i) {
      if (i < n && !may_start[i]) continue;  // the next part would start here
      for (std::size_t s = j - 1; s < i; ++s) {
        if (!may_start[s] || best[j - 1][s] == inf || !fits(w, s, i)) continue;
        const double candidate = std::max(best[j - 1][s], prefix[w][i] - prefix[w][s]);
        if (candidate < best[j][i]) {
          best[j][i] = candidate;
          from[j][i] = s;
        }
      }
    }
  }
  if (best[k][n] == inf) return {};
  std::vector<std::size_t> cuts(k + 1);
  cuts[k] = n;
  for (std::size_t j = k, i = n; j >= 1; --j) {
    cuts[j - 1] = from[j][i];
    i = from[j][i];
  }
  return cuts;
}

/// The contiguous split of `cost` (per layer) into `parts` non-empty ranges whose largest sum is
/// smallest: bottleneck_cuts with one worker for every part.
inline std::vector<std::size_t> balanced_cuts(const std::vector<double>& cost, int parts) {
  CUPIPE_REQUIRE(parts >= 1 && std::size_t(parts) <= cost.size(), "planner: cannot split ", cost.size(), " layers into ",
                 parts, " stages");
  return bottleneck_cuts({cost}, std::vector<int>(std::size_t(parts), 0));
}

/// The speed profile of the worker that runs virtual stage k (`placement`), or null where the
/// workers are equal (Request::workers empty).
inline const WorkerSpeed* speed_of(const Request& request, const schedule::Placement* placement, int k) {
  if (request.workers.empty() || !placement) return nullptr;
  return &request.workers[std::size_t(placement->worker_of(k))];
}

/// Worker w's bytes per stored value and per compute value (gradients, optimizer, master).
inline int value_bytes_of(const Request& request, const CostModel& model, std::size_t w) {
  if (w < request.workers.size() && request.workers[w].value_bytes > 0) return request.workers[w].value_bytes;
  return model.value_bytes;
}
inline int compute_bytes_of(const Request& request, const CostModel& model, std::size_t w) {
  if (w < request.workers.size()) {
    const WorkerSpeed& speed = request.workers[w];
    if (speed.compute_bytes > 0) return speed.compute_bytes;
    if (speed.value_bytes > 0) return 0;  // the worker's own value bytes
  }
  return model.compute_bytes;
}

/// Worker w's memory cap (0: none).
inline double memory_of(const Request& request, std::size_t w) {
  if (w < request.workers.size() && request.workers[w].memory_bytes > 0) return request.workers[w].memory_bytes;
  return request.memory_bytes;
}

/// Worker w's optimizer step per parameter.
inline double update_rate_of(const Request& request, const CostModel& model, std::size_t w) {
  return w < request.workers.size() ? request.workers[w].update_seconds_per_param : model.update_seconds_per_param;
}

/// Per pipeline worker, 1 where it computes on a device of its own (WorkerSpeed::own_device), out of
/// the contention of the machine's cores; empty without Request::workers.
inline std::vector<char> own_devices(const Request& request) {
  std::vector<char> out;
  for (const WorkerSpeed& w : request.workers) out.push_back(w.own_device ? 1 : 0);
  return out;
}

/// The splits the search prices for unequal workers (Request::workers, not empty) on `placement`:
/// first the bottleneck partition (bottleneck_cuts over each
/// worker's F + B + W per layer, at the request's cut points, each part's parameter state within its
/// worker's memory); then, where the cut points allow at most `most` splits in all, every other one
/// that passes the same memory rule, since the partition's measure leaves out what the simulation
/// charges (the fill and drain, hand-overs, and an update that one process runs stage after stage
/// at each worker's own rate). Empty where no split is allowed.
inline std::vector<std::vector<std::size_t>> planned_splits(const Request& request, const CostModel& model,
                                                            const schedule::Placement& placement, std::size_t most = 16) {
  const std::size_t layers = model.layers.size();
  CUPIPE_REQUIRE(!request.workers.empty(), "planner: planned_splits prices unequal workers; Request::workers is empty");
  std::vector<std::vector<double>> cost;
  std::vector<double> bytes_per_param, memory;
  for (std::size_t w = 0; w < request.workers.size(); ++w) {
    cost.push_back(layer_totals(request.workers[w].layers));
    // ZeRO-0's state within a step, one weight version: what every schedule holds at least.
    bytes_per_param.push_back(sharded_state_bytes(1, 1, value_bytes_of(request, model, w), compute_bytes_of(request, model, w),
                                                  model.optimizer_slots, 1, ZeroSetting{}, true)
                                  .total());
    memory.push_back(memory_of(request, w));
  }
  const std::vector<int> worker_of(placement.worker.begin(), placement.worker.end());
  std::vector<double> params(layers);
  for (std::size_t l = 0; l < layers; ++l) params[l] = model.layers[l].params;
  std::vector<std::vector<std::size_t>> out;
  std::vector<std::size_t> best = bottleneck_cuts(cost, worker_of, request.cut_points, params, bytes_per_param, memory);
  if (best.empty()) return out;
  out.push_back(best);
  // Every other split: parts - 1 starts among the cut points, while there are at most `most`.
  std::vector<std::size_t> points = request.cut_points;
  if (points.empty())
    for (std::size_t l = 1; l < layers; ++l) points.push_back(l);
  std::sort(points.begin(), points.end());
  points.erase(std::unique(points.begin(), points.end()), points.end());
  const std::size_t starts = worker_of.size() - 1;
  if (starts > points.size()) return out;
  double count = 1;  // points choose starts
  for (std::size_t i = 0; i < starts; ++i) count = count * double(points.size() - i) / double(i + 1);
  if (count > double(most)) return out;
  const PartsFit part_fits(layers, params, bytes_per_param, memory);
  const auto fits = [&](const std::vector<std::size_t>& cuts) {
    for (std::size_t k = 0; k + 1 < cuts.size(); ++k)
      if (!part_fits(std::size_t(worker_of[k]), cuts[k], cuts[k + 1])) return false;
    return true;
  };
  std::vector<std::size_t> pick(starts);  // indices into points, ascending
  for (std::size_t i = 0; i < starts; ++i) pick[i] = i;
  while (true) {
    std::vector<std::size_t> cuts{0};
    for (const std::size_t i : pick) cuts.push_back(points[i]);
    cuts.push_back(layers);
    if (cuts != best && fits(cuts)) out.push_back(std::move(cuts));
    std::size_t i = starts;  // the next combination
    while (i > 0 && pick[i - 1] == points.size() - starts + i - 1) --i;
    if (i == 0) return out;
    ++pick[i - 1];
    for (std::size_t j = i; j < starts; ++j) pick[j] = pick[j - 1] + 1;
  }
}

}  // namespace detail

}  // namespace cupipe::planner
