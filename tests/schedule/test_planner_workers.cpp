// SPDX-License-Identifier: Apache-2.0
// The planner for unequal workers (Request::workers, planner/workers.hpp): the bottleneck partition
// against every split enumerated, with cut points and memory caps; equal workers planned as before;
// a slow worker given less work, predicted faster than the equal split on the same workers; each
// worker's own bytes, update rate and memory; a GPU worker out of the cores' contention; and the
// refusals.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cstddef>
#include <functional>
#include <limits>
#include <string>
#include <vector>

#include "cupipe/core/rng.hpp"
#include "cupipe/planner/planner.hpp"
#include "cupipe/planner/workers.hpp"

namespace {

using namespace cupipe;

/// `n` equal layers with F = B = W = `ms` milliseconds for 8 rows, `params` parameters each.
planner::CostModel uniform(std::size_t n, double ms = 1, double params = 1e5) {
  planner::CostModel model;
  model.profiled_rows = 8;
  for (std::size_t l = 0; l < n; ++l)
    model.layers.push_back({"layer" + std::to_string(l), ms * 1e-3, ms * 1e-3, ms * 1e-3, params, 64, 64, 64});
  return model;
}

/// 1F1B on `workers` of the model's speeds (the first as fast as `model`), 16 samples a step.
planner::Request unequal(const planner::CostModel& model, std::vector<planner::WorkerSpeed> workers) {
  planner::Request request;
  request.model = model;
  request.devices = int(workers.size());
  request.workers = std::move(workers);
  request.batch = 16;
  request.schedules = {"1f1b"};
  request.max_microbatches = 8;
  return request;
}

/// The slowest part of `cuts` on its worker, from per-worker layer costs.
double slowest(const std::vector<std::vector<double>>& cost, const std::vector<int>& worker_of, const std::vector<std::size_t>& cuts) {
  double most = 0;
  for (std::size_t k = 0; k + 1 < cuts.size(); ++k) {
    double part = 0;
    for (std::size_t l = cuts[k]; l < cuts[k + 1]; ++l) part += cost[std::size_t(worker_of[k])][l];
    most = std::max(most, part);
  }
  return most;
}

/// Every split of n layers into `parts` non-empty ranges, as cuts.
void each_split(std::size_t n, std::size_t parts, const std::function<void(const std::vector<std::size_t>&)>& f) {
  std::vector<std::size_t> cuts{0};
  std::function<void(std::size_t)> next = [&](std::size_t from) {
    if (cuts.size() == parts) {
      cuts.push_back(n);
      f(cuts);
      cuts.pop_back();
      return;
    }
    for (std::size_t c = from; c + (parts - cuts.size()) <= n; ++c) {
      cuts.push_back(c);
      next(c + 1);
      cuts.pop_back();
    }
  };
  next(1);
}

}  // namespace

TEST_CASE("The bottleneck partition over unequal workers is the best split enumerated", "[planner][workers]") {
  Rng rng(7);
  for (int trial = 0; trial < 40; ++trial) {
    const std::size_t n = 5 + std::size_t(trial % 4), parts = 2 + std::size_t(trial % 3);
    const std::size_t workers = trial % 2 ? parts : 2;  // one chunk each, or two workers taking turns
    std::vector<std::vector<double>> cost(workers, std::vector<double>(n));
    std::vector<double> params(n);
    for (std::size_t l = 0; l < n; ++l) {
      params[l] = double(1 + rng.below(9));
      for (std::size_t w = 0; w < workers; ++w) cost[w][l] = double(1 + rng.below(20)) * double(1 + w);
    }
    std::vector<int> worker_of(parts);
    for (std::size_t k = 0; k < parts; ++k) worker_of[k] = int(k % workers);
    // Cut points on half the trials; a memory cap on the slowest worker on a third.
    std::vector<std::size_t> points;
    if (trial % 2 == 0)
      for (std::size_t c = 1; c < n; c += 2) points.push_back(c);
    std::vector<double> bytes(workers, 10.0), memory(workers, 0.0);
    if (trial % 3 == 0) memory[workers - 1] = 10.0 * 12;
    const auto allowed = [&](const std::vector<std::size_t>& cuts) {
      for (std::size_t k = 0; k + 1 < cuts.size(); ++k) {
        if (k > 0 && !points.empty() && std::find(points.begin(), points.end(), cuts[k]) == points.end()) return false;
        double p = 0;
        for (std::size_t l = cuts[k]; l < cuts[k + 1]; ++l) p += params[l];
        const auto w = std::size_t(worker_of[k]);
        if (memory[w] > 0 && p * bytes[w] > memory[w]) return false;
      }
      return true;
    };
    double best = std::numeric_limits<double>::infinity();
    each_split(n, parts, [&](const std::vector<std::size_t>& cuts) {
      if (allowed(cuts)) best = std::min(best, slowest(cost, worker_of, cuts));
    });
    const std::vector<std::size_t> cuts = planner::detail::bottleneck_cuts(cost, worker_of, points, params, bytes, memory);
    INFO("trial " << trial << ": " << n << " layers, " << parts << " parts on " << workers << " workers");
    if (best == std::numeric_limits<double>::infinity()) {
      CHECK(cuts.empty());
      continue;
    }
    REQUIRE(cuts.size() == parts + 1);
    CHECK(allowed(cuts));
    CHECK(slowest(cost, worker_of, cuts) == best);
  }
  // One worker for every part is the balanced split.
  CHECK(planner::detail::bottleneck_cuts({{1, 1, 1, 1, 4}}, {0, 0}) == planner::detail::balanced_cuts({1, 1, 1, 1, 4}, 2));
  // Worker 1 three times as slow: it gets one layer of four.
  CHECK(planner::detail::bottleneck_cuts({{1, 1, 1, 1}, {3, 3, 3, 3}}, {0, 1}) == std::vector<std::size_t>{0, 3, 4});
  // No cut point leaves room for three parts.
  CHECK(planner::detail::bottleneck_cuts({{1, 1, 1, 1}}, {0, 0, 0}, {2}).empty());
}

TEST_CASE("Equal workers plan as the planner without them", "[planner][workers]") {
  const planner::CostModel model = uniform(8);
  planner::Request plain = unequal(model, {});
  plain.devices = 2;
  plain.stage_counts = {2};
  const planner::Request same = unequal(model, {planner::worker_speed("a", model), planner::worker_speed("b", model)});
  const planner::Layout a = planner::search(plain).best(), b = planner::search(same).best();
  CHECK(a.describe() + " split=0,4,8" == b.describe());
  CHECK(a.cuts == b.cuts);
  CHECK(a.step_seconds == b.step_seconds);
  CHECK(a.peak_bytes == b.peak_bytes);
  CHECK(b.worker_names == std::vector<std::string>{"a", "b"});
}

TEST_CASE("A slow worker gets less work, and its split is predicted faster than the equal one", "[planner][workers]") {
  // 8 equal layers; worker 1 twice as slow per layer (as bf16 emulation beside fp32 on a CPU).
  const planner::CostModel model = uniform(8);
  planner::WorkerSpeed fast = planner::worker_speed("fast", model), slow = planner::worker_speed("slow", uniform(8, 2));
  planner::Request request = unequal(model, {fast, slow});
  const planner::Layout chosen = planner::search(request).best();
  // F + B + W: 3 ms a layer on worker 0, 6 ms on worker 1. The bottleneck partition gives 5 and 3
  // layers (15 ms and 18 ms), not 4 and 4 (12, 24); 6 and 2 (18, 12) tie with it, and the simulation
  // of every split (7 of them) prefers its shorter drain.
  CHECK(planner::detail::planned_splits(request, model, schedule::looped_placement(2, 1)).front() ==
        std::vector<std::size_t>{0, 5, 8});
  CHECK(chosen.cuts == std::vector<std::size_t>{0, 6, 8});
  // The same workers on the equal workers' split (Request::split, as a program compiles it).
  request.split = [](int parts) { return parts == 2 ? std::vector<std::size_t>{0, 4, 8} : std::vector<std::size_t>{}; };
  const planner::Layout equal = planner::search(request).best();
  CHECK(equal.cuts == std::vector<std::size_t>{0, 4, 8});
  CHECK(chosen.step_seconds < 0.85 * equal.step_seconds);
  // The slow worker's times are what the simulation charges: the slowest stage, worker 1 with
  // 4 layers at 6 ms for 8 rows, bounds the equal split's step from below.
  const double rows = 16.0 / equal.microbatches;
  CHECK(equal.step_seconds >= equal.microbatches * 4 * 6e-3 * rows / 8 * 0.999);
  // Swap the workers: the slow one first gets at most 3 layers (2 and 3 tie at an 18 ms bottleneck).
  request.split = {};
  request.workers = {slow, fast};
  const planner::Layout swapped = planner::search(request).best();
  CHECK(swapped.cuts[1] <= 3);
  CHECK(swapped.step_seconds < 0.85 * equal.step_seconds);
}

TEST_CASE("The splits priced for unequal workers", "[planner][workers]") {
  const planner::CostModel model = uniform(8);
  planner::Request request = unequal(model, {planner::worker_speed("a", model), planner::worker_speed("b", uniform(8, 2))});
  // 2 workers: the partition, then the 6 other splits of 8 layers.
  const auto two = planner::detail::planned_splits(request, model, schedule::looped_placement(2, 1));
  REQUIRE(two.size() == 7);
  for (std::size_t i = 1; i < two.size(); ++i) {
    CHECK(two[i] != two.front());
    CHECK(std::find(two.begin() + std::ptrdiff_t(i) + 1, two.end(), two[i]) == two.end());
  }
  // 3 workers: 21 splits, over the 16 priced: the partition alone.
  request.workers.push_back(request.workers[1]);
  CHECK(planner::detail::planned_splits(request, model, schedule::looped_placement(3, 1)).size() == 1);
  // Cut points: 2 of them, one split each.
  request.workers.pop_back();
  request.cut_points = {2, 4};
  CHECK(planner::detail::planned_splits(request, model, schedule::looped_placement(2, 1)) ==
        std::vector<std::vector<std::size_t>>{{0, 4, 8}, {0, 2, 8}});
}

TEST_CASE("Unequal workers: each one's bytes, update and memory", "[planner][workers]") {
  planner::CostModel model = uniform(4, 1, 1000);
  model.update_seconds_per_param = 1e-6;
  planner::WorkerSpeed fp32 = planner::worker_speed("fp32", model);
  planner::WorkerSpeed bf16 = planner::worker_speed("bf16", model);
  bf16.value_bytes = 2;
  bf16.compute_bytes = 4;
  bf16.update_seconds_per_param = 3e-6;
  planner::Request request = unequal(model, {fp32, bf16});
  const planner::Layout layout = planner::search(request).best();
  REQUIRE(layout.cuts == std::vector<std::size_t>{0, 2, 4});
  // 2000 parameters each: fp32 4 bytes a weight; bf16 2 for the weight in use and 4 for the master.
  CHECK(layout.resting_state_bytes[0].weights == 2000 * 4);
  CHECK(layout.resting_state_bytes[1].weights == 2000 * (2 + 4));
  CHECK(layout.resting_state_bytes[1].optimizer == 2000 * 4 * 2);
  // A worker that sets only its compute bytes keeps the model's value bytes: 8-byte masters
  // beside 4-byte weights in use.
  request.workers[1] = planner::worker_speed("fp64 master", model);
  request.workers[1].value_bytes = 0;
  request.workers[1].compute_bytes = 8;
  CHECK(planner::search(request).best().resting_state_bytes[1].weights == 2000 * (4 + 8));
  request.workers[1] = bf16;
  // One process: the update runs every worker's in turn, each at its own rate.
  request.one_process = true;
  CHECK(planner::search(request).best().update_seconds == Approx(2000 * 1e-6 + 2000 * 3e-6));
  // A worker of little memory keeps few layers: 1000 parameters of fp32 AdamW state (with the
  // gradient, 16 bytes each) fit in 20 kB, two layers' do not.
  request.one_process = false;
  request.workers[0].memory_bytes = 20e3;
  request.workers[1].memory_bytes = 0;
  const planner::Report capped = planner::search(request);
  CHECK(capped.best().cuts == std::vector<std::size_t>{0, 1, 4});
  CHECK(planner::describe(capped, model).find("worker 1 (bf16): peak") != std::string::npos);
  // Nothing fits a worker that holds less than a layer's state.
  request.workers[0].memory_bytes = 1e3;
  const planner::Report none = planner::search(request);
  CHECK(none.ranked.empty());
  REQUIRE_FALSE(none.rejected.empty());
  CHECK_THAT(none.rejected.front().reason, Catch::Contains("fits every worker's memory"));
}

TEST_CASE("A worker on a device of its own is out of the cores' contention", "[planner][workers]") {
  // Two workers of one process on 2 cores, which slow each other to x2 while both compute.
  planner::CostModel model = uniform(8);
  model.contention = {1.0, 2.0};
  planner::Request request = unequal(model, {planner::worker_speed("host", model), planner::worker_speed("cuda", uniform(8, 0.5))});
  request.one_process = true;
  request.cores = 2;
  request.split = [](int parts) { return parts == 2 ? std::vector<std::size_t>{0, 4, 8} : std::vector<std::size_t>{}; };
  const double shared = planner::search(request).best().step_seconds;
  // The GPU worker (own_device) takes no core: the host worker computes alone, as with no
  // contention measured at all.
  request.workers[1].own_device = true;
  const planner::Layout apart = planner::search(request).best();
  planner::Request uncontended = request;
  uncontended.model.contention = {};
  CHECK(apart.step_seconds == planner::search(uncontended).best().step_seconds);
  CHECK(apart.step_seconds < 0.95 * shared);
  // The factors themselves: two workers computing at once, the second on its own device.
  schedule::SimResult sim;
  sim.times = {{{0.0, 1.0}}, {{0.0, 1.0}}};
  CHECK(planner::detail::contention_factors(sim, {1.0, 2.0}) == std::vector<double>{2.0, 2.0});
  CHECK(planner::detail::contention_factors(sim, {1.0, 2.0}, 1, 0, {0, 1}) == std::vector<double>{1.0, 1.0});
}

TEST_CASE("Unequal workers with two chunks each and cut points", "[planner][workers]") {
  const planner::CostModel model = uniform(8);
  planner::Request request = unequal(model, {planner::worker_speed("fast", model), planner::worker_speed("slow", uniform(8, 3))});
  request.schedules = {"interleaved"};
  const planner::Layout layout = planner::search(request).best();
  REQUIRE(layout.cuts.size() == 5);
  // Virtual stages 0 and 2 on the fast worker hold more layers than 1 and 3 on the slow one.
  CHECK(layout.cuts[1] - layout.cuts[0] > layout.cuts[2] - layout.cuts[1]);
  CHECK(layout.cuts[3] - layout.cuts[2] > layout.cuts[4] - layout.cuts[3]);
  // Cut points: stages start only at even layers.
  request.schedules = {"1f1b"};
  request.cut_points = {2, 4, 6};
  CHECK(planner::search(request).best().cuts == std::vector<std::size_t>{0, 6, 8});
  // Equal workers honour cut points too.
  planner::Request equal = unequal(model, {});
  equal.devices = 2;
  equal.stage_counts = {2};
  equal.cut_points = {3};
  CHECK(planner::search(equal).best().cuts == std::vector<std::size_t>{0, 3, 8});
}

TEST_CASE("Unequal workers: what the planner refuses", "[planner][workers]") {
  const planner::CostModel model = uniform(4);
  planner::Request request = unequal(model, {planner::worker_speed("a", model), planner::worker_speed("b", uniform(3))});
  CHECK_THROWS_WITH(planner::search(request), Catch::Contains("worker 1 (b) has times for 3 layers, the model 4"));
  request.workers[1] = planner::worker_speed("b", model);
  request.devices = 4;
  CHECK_THROWS_WITH(planner::search(request), Catch::Contains("2 unequal workers (Request::workers) are the devices; devices is 4"));
  request.devices = 2;
  request.tensor_degrees = {2};
  CHECK_THROWS_WITH(planner::search(request), Catch::Contains("without tensor parallelism"));
  request.tensor_degrees = {};
  request.stage_counts = {1};
  CHECK_THROWS_WITH(planner::search(request), Catch::Contains("which stage_counts leaves out"));
  request.stage_counts = {};
  request.cut_points = {4};
  CHECK_THROWS_WITH(planner::search(request), Catch::Contains("cut point 4 is not between two of the 4 layers"));
  request.cut_points = {};
  planner::CostModel other_rows = model;
  other_rows.profiled_rows = 16;
  request.workers[1] = planner::worker_speed("b", other_rows);
  CHECK_THROWS_WITH(planner::search(request), Catch::Contains("worker 1 (b) was timed on 16 rows, the model on 8"));
  request.workers[1] = planner::worker_speed("b", model);
  request.workers[0].memory_bytes = -1;
  CHECK_THROWS_WITH(planner::search(request), Catch::Contains("worker 0 (a) has a negative update time, memory or byte count"));
}
