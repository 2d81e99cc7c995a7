// SPDX-License-Identifier: Apache-2.0
// The planner on cost models whose best layout is known: the balanced split, data parallelism when
// nothing else costs, a pipeline when memory forbids replicas, memory caps that are never exceeded,
// every refusal with its reason, and the report's text.
#include <catch2/catch.hpp>

#include <algorithm>
#include <string>
#include <vector>

#include "cupipe/planner/planner.hpp"

namespace {

using namespace cupipe;

/// `n` equal layers of width 64 with F = B = W = 1 ms for the profiled microbatch of 8 rows (a cost
/// model, so the first layer's B costs too).
planner::CostModel uniform(std::size_t n, double params_each = 64 * 64) {
  planner::CostModel model;
  model.profiled_rows = 8;
  for (std::size_t l = 0; l < n; ++l)
    model.layers.push_back({"layer" + std::to_string(l), 1e-3, 1e-3, 1e-3, params_each, 64, 64, 64});
  return model;
}

double most(const std::vector<double>& values) { return *std::max_element(values.begin(), values.end()); }

}  // namespace

TEST_CASE("planner: the balanced split minimises the slowest stage", "[planner]") {
  using planner::detail::balanced_cuts;
  CHECK(balanced_cuts({1, 1, 1, 1, 4}, 2) == std::vector<std::size_t>{0, 4, 5});
  CHECK(balanced_cuts({1, 1, 1, 1, 4}, 5) == std::vector<std::size_t>{0, 1, 2, 3, 4, 5});
  CHECK(balanced_cuts({5, 1, 1, 1, 1, 1}, 2) == std::vector<std::size_t>{0, 1, 6});
  CHECK(balanced_cuts({2, 2, 2, 2}, 1) == std::vector<std::size_t>{0, 4});
  CHECK_THROWS_WITH(balanced_cuts({1, 1}, 3), Catch::Contains("cannot split 2 layers into 3 stages"));
}

TEST_CASE("planner: with free communication and room to spare, replicas beat a pipeline", "[planner]") {
  planner::Request request;
  request.model = uniform(16);
  request.devices = 4;
  request.batch = 64;
  const planner::Report report = plan(request);
  REQUIRE(!report.ranked.empty());
  const planner::Layout& best = report.best();
  // One stage per replica has no bubble, so nothing predicts faster.
  CHECK(best.stages == 1);
  CHECK(best.replicas == 4);
  CHECK(best.bubble == Approx(0).margin(1e-12));
  for (const planner::Layout& l : report.ranked) CHECK(l.step_seconds >= best.step_seconds);
  // Per-batch step time of a pipeline: the simulator's makespan of the policy's plan on the split's costs.
  const auto f1b = std::find_if(report.ranked.begin(), report.ranked.end(), [](const planner::Layout& l) {
    return l.schedule == "1f1b" && l.stages == 4 && l.microbatches == 16;
  });
  REQUIRE(f1b != report.ranked.end());
  // 4 layers per stage, 64 samples on one replica in 16 microbatches of 4 rows: F = 4 x 1 ms x 4/8.
  const double f = 4 * 1e-3 * 0.5;
  CHECK(f1b->step_seconds == Approx((16 + 3) * 3 * f).epsilon(1e-9));
  CHECK(f1b->bubble == Approx(3.0 / 19).epsilon(1e-9));
}

TEST_CASE("planner: a memory cap rules out replicas, nothing proposed exceeds it", "[planner]") {
  planner::Request request;
  request.model = uniform(16, 1e6);  // 16 M parameters: 4 bytes x 4 arrays (weights, gradients, 2 AdamW slots)
  request.devices = 4;
  request.batch = 64;
  const double whole_model = 16e6 * 4 * 4;
  request.memory_bytes = whole_model / 2;  // a replica of the whole model does not fit; a quarter does
  const planner::Report report = plan(request);
  REQUIRE(!report.ranked.empty());
  for (const planner::Layout& l : report.ranked) {
    CHECK(most(l.peak_bytes) <= request.memory_bytes);
    CHECK(l.stages >= 2);
  }
  const auto refused = std::find_if(report.rejected.begin(), report.rejected.end(),
                                    [](const planner::Rejected& r) { return r.layout.find("p=1 ") != std::string::npos; });
  REQUIRE(refused != report.rejected.end());
  CHECK_THAT(refused->reason, Catch::Contains("over the 0.128 GB a device has"));
  // A cap nothing meets: no layout, and best() says why.
  request.memory_bytes = 1;
  const planner::Report none = plan(request);
  CHECK(none.ranked.empty());
  CHECK_THROWS_WITH(none.best(), Catch::Contains("no layout fits"));
  CHECK_THAT(planner::describe(none, request.model), Catch::Contains("no layout fits"));
}

TEST_CASE("planner: policies refuse with their sentence, and more stages than layers are refused", "[planner]") {
  planner::Request request;
  request.model = uniform(4);
  request.devices = 8;
  request.batch = 8;
  request.schedules = {"dualpipev", "1f1b"};
  const planner::Report report = plan(request);
  for (const planner::Layout& l : report.ranked) CHECK((l.schedule == "1f1b" || l.schedule == "dualpipev"));
  const auto too_deep = std::find_if(report.rejected.begin(), report.rejected.end(),
                                     [](const planner::Rejected& r) { return r.layout.find("1f1b p=8") == 0; });
  REQUIRE(too_deep != report.rejected.end());
  CHECK(too_deep->reason == "8 virtual stages for 4 layers");
  const auto few = std::find_if(report.rejected.begin(), report.rejected.end(), [](const planner::Rejected& r) {
    return r.layout.find("dualpipev p=2 m=1") == 0;
  });
  REQUIRE(few != report.rejected.end());
  CHECK_THAT(few->reason, Catch::Contains("microbatches >= 2 x stages"));
  request.schedules = {"3f3b"};
  CHECK_THROWS_WITH(plan(request), Catch::Contains("unknown schedule '3f3b'"));
  request.schedules = {};
  request.devices = 0;
  CHECK_THROWS_WITH(plan(request), Catch::Contains("devices must be at least 1"));
}

TEST_CASE("planner: the report names the best layout, its split, its memory and why the others lost", "[planner]") {
  planner::Request request;
  request.model = uniform(8);
  request.model.allreduce_bytes_per_second = 1e6;  // a slow gradient sum: replicas cost
  request.devices = 2;
  request.batch = 32;
  const planner::Report report = plan(request);
  const planner::Layout& best = report.best();
  // Two replicas sum 131 KB of gradients at 1 MB/s (131 ms) to save half of 96 ms of compute: the
  // pipeline of 2 stages wins.
  CHECK(best.replicas == 1);
  const std::string text = planner::describe(report, request.model);
  CHECK_THAT(text, Catch::StartsWith("best: " + best.describe()));
  CHECK_THAT(text, Catch::Contains("virtual stage 0: layers 0.."));
  CHECK_THAT(text, Catch::Contains("worker 0: peak"));
  CHECK_THAT(text, Catch::Contains("% slower"));
  CHECK_THAT(text, Catch::Contains("layouts considered"));
}
