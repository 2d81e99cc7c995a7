// SPDX-License-Identifier: Apache-2.0
// The planner's activation offload (Request::offload, schedule::plan_offload): the replay and the
// bounds count a record that leaves after its action and comes back before its backward; a layout
// over the memory cap is offered with the most records resident that fit, its copies in the step
// time; with offload off, or without the measured copy bandwidth, it stays refused.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "cupipe/planner/cost_json.hpp"
#include "cupipe/planner/planner.hpp"

namespace {

using namespace cupipe;

double most(const std::vector<double>& values) { return *std::max_element(values.begin(), values.end()); }

}  // namespace

TEST_CASE("planner: offload's moves in the activation replay and in the bounds", "[planner][offload]") {
  // One worker, one layer 10 -> 20 that saves 5 values per row: a record of 25 per row. GPipe with
  // 3 microbatches of 2 rows: each F takes its record (50); each B takes the loss gradient (2 x 20)
  // and at its end frees it with the record (90).
  planner::CostModel model;
  model.profiled_rows = 2;
  model.layers.push_back({"a", 1e-3, 1e-3, 1e-3, 0, 10, 20, 5});
  const schedule::Plan plan = schedule::generate<schedule::GPipe>(schedule::Config{1, 3});
  const schedule::SimResult sim = schedule::simulate(plan, schedule::Costs{1, 2, 0});
  const auto sizes = planner::detail::chunk_sizes(model, {0, 1});
  const std::vector<double> rows{2, 2, 2};
  // Kept: three records, then the first B's gradient: 150 + 40.
  CHECK(planner::detail::activation_peaks(plan, sim, sizes, rows)[0] == Approx(190));
  // One record resident: the second and third forwards each send a record out as they end (the
  // count reaches 100 inside them), and each B that brings one back holds it with its gradient (90).
  const schedule::OffloadPlan offload = schedule::plan_offload(plan, {0}, 1);
  REQUIRE(offload.moves[0] == 2);
  CHECK(planner::detail::activation_peaks(plan, sim, sizes, rows, &offload)[0] == Approx(100));
  // One worker, no messages: every timing gives the same peak.
  const planner::detail::ActivationBounds bounds = planner::detail::activation_bounds(plan, sizes, rows, &offload);
  CHECK(bounds.low[0] == Approx(100));
  CHECK(bounds.high[0] == Approx(100));
}

TEST_CASE("planner: a layout over the memory cap is offered with offload, its copies in the step time", "[planner][offload]") {
  // 4 layers of width 64 that each save 64 values per row: a record of 512 values per row.
  planner::Request request;
  for (int l = 0; l < 4; ++l) request.model.layers.push_back({"layer" + std::to_string(l), 1e-3, 1e-3, 1e-3, 64 * 64, 64, 64, 64});
  request.model.profiled_rows = 8;
  request.model.offload_bytes_per_second = 1e9;
  request.devices = 1;
  request.batch = 16;
  request.schedules = {"gpipe"};
  request.max_microbatches = 4;
  const planner::Report free = plan(request);
  REQUIRE(free.ranked.size() == 4);  // m = 1, 2, 3, 4
  double least = 1e300;
  for (const planner::Layout& l : free.ranked) {
    CHECK(l.offload.empty());
    least = std::min(least, most(l.most_bytes));
  }
  request.memory_bytes = least - 1;  // nothing fits as it is

  request.offload = false;
  const planner::Report refused = plan(request);
  CHECK(refused.ranked.empty());
  CHECK_THAT(refused.rejected.front().reason, Catch::Contains("a device has"));

  request.offload = true;
  const planner::Report offloaded = plan(request);
  REQUIRE(!offloaded.ranked.empty());
  for (const planner::Layout& l : offloaded.ranked) {
    INFO(l.describe());
    CHECK(l.offload == std::vector<int>{0});
    CHECK(l.offload_resident >= 1);
    CHECK(l.offload_resident < l.microbatches);
    CHECK(most(l.most_bytes) <= request.memory_bytes);
    // The same layout without the cap, slower by exactly its copies: each moved record goes out and
    // comes back, priced as the largest microbatch's (16 / m rows, rounded up) of 512 values of 4
    // bytes at 1 GB/s each way.
    const auto same = std::find_if(free.ranked.begin(), free.ranked.end(),
                                   [&](const planner::Layout& f) { return f.microbatches == l.microbatches; });
    REQUIRE(same != free.ranked.end());
    const schedule::OffloadPlan moves =
        schedule::plan_offload(schedule::generate<schedule::GPipe>(schedule::Config{1, l.microbatches}), {0}, l.offload_resident);
    const double record_seconds = std::ceil(16.0 / l.microbatches) * 512 * 4 / 1e9;
    CHECK(l.step_seconds == Approx(same->step_seconds + 2 * moves.moves[0] * record_seconds).epsilon(1e-9));
    CHECK(l.step_seconds > same->step_seconds);
  }
  CHECK_THAT(offloaded.best().describe(), Catch::Contains("offload=0 resident="));
  CHECK_THAT(planner::describe(offloaded, request.model), Catch::Contains("activation offload: its virtual stages keep at most"));

  // Unmeasured copies: offload is not priced, so not offered.
  request.model.offload_bytes_per_second = 0;
  CHECK(plan(request).ranked.empty());
}

TEST_CASE("planner: the offload bandwidth reads back from a cost model's JSON", "[planner][offload]") {
  planner::CostModel model;
  model.profiled_rows = 4;
  model.layers.push_back({"a", 1e-3, 1e-3, 1e-3, 0, 10, 20, 5});
  model.offload_bytes_per_second = 12.5e9;
  CHECK(planner::cost_model_from_json(planner::to_json(model), "test").offload_bytes_per_second == 12.5e9);
}
