// SPDX-License-Identifier: Apache-2.0
// The planner on cost models whose best layout is known: the balanced split, data parallelism when
// nothing else costs, a pipeline when memory forbids replicas, memory caps that are never exceeded,
// every refusal with its reason, and the report's text.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cstdlib>
#include <set>
#include <string>
#include <vector>

#include "cupipe/planner/cost_json.hpp"
#include "cupipe/planner/planner.hpp"
#include "cupipe/planner/rounds.hpp"

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
  CHECK_THAT(text, !Catch::Contains("calibration:"));  // a model nobody calibrated
  request.model.calibration_spread = 0.0325;
  request.model.calibration_rounds = 5;
  CHECK_THAT(planner::describe(report, request.model), Catch::Contains("calibration: the profiles' repeated rounds (up to 5 "
                                                                      "each) spread by at most 3.25%"));
  // One round (CUPIPE_CALIBRATION=quick) measured no spread, and the report must not print one.
  request.model.calibration_spread = 0;
  request.model.calibration_rounds = 1;
  const std::string quick = planner::describe(report, request.model);
  CHECK_THAT(quick, Catch::Contains("calibration: one round of each profile (CUPIPE_CALIBRATION=quick)"));
  CHECK_THAT(quick, !Catch::Contains("spread by at most"));
}

TEST_CASE("planner: CUPIPE_CALIBRATION=quick measures each profile once, and only that value does", "[planner]") {
  int calls = 0;
  const auto measure = [&] { return double(++calls); };  // every round differs: the rounds go on to `most`
  const planner::detail::Rounds rounds{3, 7, 0.02};
  ::unsetenv("CUPIPE_CALIBRATION");
  CHECK(planner::detail::repeated(rounds, measure).size() == 7);
  ::setenv("CUPIPE_CALIBRATION", "quick", 1);
  calls = 0;
  const std::vector<double> once = planner::detail::repeated(rounds, measure);
  ::setenv("CUPIPE_CALIBRATION", "Quick", 1);
  const std::size_t other_value = planner::detail::repeated(rounds, measure).size();
  ::unsetenv("CUPIPE_CALIBRATION");
  CHECK(once.size() == 1);
  CHECK(other_value == 7);
}

TEST_CASE("planner: a fixed part of each action and the optimizer step enter the step time", "[planner]") {
  planner::CostModel model;
  model.profiled_rows = 8;
  // One layer: F, B and W take 2 ms for 8 rows, 1 ms of which does not scale with the rows.
  model.layers.push_back({"only", 2e-3, 2e-3, 2e-3, 1000, 16, 16, 0, 1e-3, 1e-3, 1e-3});
  model.update_seconds_per_param = 1e-6;  // 1 ms for the layer's 1000 parameters
  planner::Request request;
  request.model = model;
  request.devices = 1;
  request.batch = 8;
  request.schedules = {"gpipe"};
  const planner::Report report = plan(request);
  const auto m4 = std::find_if(report.ranked.begin(), report.ranked.end(), [](const planner::Layout& l) { return l.microbatches == 4; });
  REQUIRE(m4 != report.ranked.end());
  // 4 microbatches of 2 rows: each action 1 + 1 x 2/8 = 1.25 ms; 4 x (F + B + W) = 15 ms, then the update.
  CHECK(m4->update_seconds == Approx(1e-3).epsilon(1e-12));
  CHECK(m4->step_seconds == Approx(15e-3 + 1e-3).epsilon(1e-9));
  // A batch that does not split evenly: 3 microbatches of 3, 3 and 2 rows, each action 1 ms + its
  // share: 9 x 1 ms + 3 x (3 + 3 + 2) / 8 ms, then the update.
  const auto m3 = std::find_if(report.ranked.begin(), report.ranked.end(), [](const planner::Layout& l) { return l.microbatches == 3; });
  REQUIRE(m3 != report.ranked.end());
  CHECK(m3->step_seconds == Approx(12e-3 + 1e-3).epsilon(1e-9));
  // Measured points replace the fixed-plus-linear model: F = B = W = 1 ms at 2 rows, 2 ms at 8.
  planner::Request pointed = request;
  pointed.model.layers[0].points = {{2, 1e-3, 1e-3, 1e-3}, {8, 2e-3, 2e-3, 2e-3}};
  const planner::Report by_points = plan(pointed);
  const auto p4 = std::find_if(by_points.ranked.begin(), by_points.ranked.end(), [](const planner::Layout& l) { return l.microbatches == 4; });
  REQUIRE(p4 != by_points.ranked.end());
  CHECK(p4->step_seconds == Approx(4 * 3e-3 + 1e-3).epsilon(1e-9));  // 2 rows each: 1 ms an action
  pointed.model.layers[0].points = {{8, 1e-3, 1e-3, 1e-3}, {2, 1e-3, 1e-3, 1e-3}};
  CHECK_THROWS_WITH(plan(pointed), Catch::Contains("points that are not ascending"));
  // With the fixed part, fewer microbatches win on one worker.
  CHECK(report.best().microbatches == 1);
  // The runtime's cost per action: zb-h1 runs an F, a B and a W per microbatch (3 actions), so 4
  // microbatches add 12 x 0.1 ms; 1f1b's B holds its W (8 actions for 4 microbatches).
  planner::Request with_actions = request;
  with_actions.model.action_overhead_seconds = 1e-4;
  with_actions.schedules = {"zb-h1", "1f1b"};
  const planner::Report costed = plan(with_actions);
  const auto find = [&](const std::string& name, int m) {
    return std::find_if(costed.ranked.begin(), costed.ranked.end(),
                        [&](const planner::Layout& l) { return l.schedule == name && l.microbatches == m; });
  };
  REQUIRE(find("zb-h1", 4) != costed.ranked.end());
  REQUIRE(find("1f1b", 4) != costed.ranked.end());
  CHECK(find("zb-h1", 4)->step_seconds == Approx(15e-3 + 12 * 1e-4 + 1e-3).epsilon(1e-9));
  CHECK(find("1f1b", 4)->step_seconds == Approx(15e-3 + 8 * 1e-4 + 1e-3).epsilon(1e-9));
  with_actions.model.action_overhead_seconds = -1e-6;
  CHECK_THROWS_WITH(plan(with_actions), Catch::Contains("action_overhead_seconds and wake_seconds must not be negative"));
  with_actions.model.action_overhead_seconds = 0;
  with_actions.model.wake_seconds = -1e-6;
  CHECK_THROWS_WITH(plan(with_actions), Catch::Contains("wake_seconds must not be negative"));
  // A fixed part larger than the time is refused, naming the layer.
  request.model.layers[0].forward_fixed = 3e-3;
  CHECK_THROWS_WITH(plan(request), Catch::Contains("layer 0 (only) has a fixed part outside [0, its time]"));
}

TEST_CASE("planner: one process, the stage counts and splits a program has", "[planner]") {
  planner::Request request;
  request.model = uniform(8);
  request.model.update_seconds_per_param = 1e-9;
  request.devices = 4;
  request.batch = 16;
  request.schedules = {"1f1b"};
  request.stage_counts = {1, 2};
  request.max_replicas = 1;
  request.all_devices = false;
  // The program's split: everything but the last layer on the first stage.
  request.split = [](int virtual_stages) -> std::vector<std::size_t> {
    if (virtual_stages == 1) return {0, 8};
    if (virtual_stages == 2) return {0, 7, 8};
    return {};
  };
  const planner::Report report = plan(request);
  REQUIRE(!report.ranked.empty());
  for (const planner::Layout& l : report.ranked) {
    CHECK(l.replicas == 1);
    CHECK((l.stages == 1 || l.stages == 2));
    if (l.stages == 2) CHECK(l.cuts == std::vector<std::size_t>{0, 7, 8});
  }
  // With two workers in one process the flush update runs every stage in turn: all 8 layers' parameters.
  const auto two = std::find_if(report.ranked.begin(), report.ranked.end(), [](const planner::Layout& l) { return l.stages == 2; });
  REQUIRE(two != report.ranked.end());
  request.one_process = true;
  const planner::Report serial = plan(request);
  const auto two_serial = std::find_if(serial.ranked.begin(), serial.ranked.end(), [&](const planner::Layout& l) {
    return l.stages == 2 && l.microbatches == two->microbatches;
  });
  REQUIRE(two_serial != serial.ranked.end());
  CHECK(two->update_seconds == Approx(7 * 64 * 64 * 1e-9).epsilon(1e-12));    // the slower worker's 7 layers
  CHECK(two_serial->update_seconds == Approx(8 * 64 * 64 * 1e-9).epsilon(1e-12));  // every layer, in turn
  // A split the program does not have is a refusal with its reason; a malformed one is an error.
  request.schedules = {"interleaved"};
  const planner::Report interleaved = plan(request);
  const auto none = std::find_if(interleaved.rejected.begin(), interleaved.rejected.end(),
                                 [](const planner::Rejected& r) { return r.layout.find("interleaved p=2") == 0; });
  REQUIRE(none != interleaved.rejected.end());
  CHECK(none->reason == "the program has no split into 4 virtual stages");
  request.schedules = {"1f1b"};
  request.split = [](int) { return std::vector<std::size_t>{0, 9}; };
  CHECK_THROWS_WITH(plan(request), Catch::Contains("is not 1 non-empty contiguous ranges of the 8 layers"));
}

TEST_CASE("planner: the activation replay counts records, messages and the backward's buffers", "[planner]") {
  // Two stages, one layer each, GPipe with 2 microbatches of 4 rows: widths 10 -> 20 -> 30, the first
  // layer saves 5 values per row.
  planner::CostModel model;
  model.profiled_rows = 4;
  model.layers.push_back({"a", 1e-3, 1e-3, 1e-3, 0, 10, 20, 5});
  model.layers.push_back({"b", 1e-3, 1e-3, 1e-3, 0, 20, 30, 0});
  const schedule::Plan plan = schedule::generate<schedule::GPipe>(schedule::Config{2, 2});
  const schedule::SimResult sim = schedule::simulate(plan, schedule::Costs{1, 2, 0});
  const std::vector<double> peaks =
      planner::detail::activation_peaks(plan, sim, planner::detail::chunk_sizes(model, {0, 1, 2}), {4, 4});
  // Stage 0 holds both microbatches' records (20 + 5 per row) when the first gradient arrives (20 per
  // row, t = 5); the second lands at t = 7, as its B of the first ends: at equal times the replay
  // counts the message before the frees (the larger peak a race can give): 2 x 25 x 4 + 2 x 20 x 4.
  CHECK(peaks[0] == Approx(360));
  // Stage 1: per microbatch its input message (20), record (30), dy (30) after both forwards: at its
  // first B's start, 2 x (20 + 30) x 4 + (dy 30 + dx 20) x 4 = 600.
  CHECK(peaks[1] == Approx(600));
  // Whatever the timing: stage 0's gradients can land right after its second forward (stage 1's
  // backwards follow it), both before the first B frees (360), or each just before the B that takes
  // it, the second after the first B freed its microbatch (2 x 25 x 4 + 20 x 4 = 280). Stage 1's
  // inputs can land before its first action, but it holds them to the end of the forwards anyway.
  const planner::detail::ActivationBounds bounds =
      planner::detail::activation_bounds(plan, planner::detail::chunk_sizes(model, {0, 1, 2}), {4, 4});
  CHECK(bounds.low[0] == Approx(280));
  CHECK(bounds.high[0] == Approx(360));
  CHECK(bounds.low[1] == Approx(600));
  CHECK(bounds.high[1] == Approx(600));
}

TEST_CASE("planner: every layout's activation peak lies within its bounds over all timings", "[planner]") {
  // The replay at the simulated times is one timing, so it cannot leave the bounds; each schedule
  // the library has, uneven layer sizes so that messages and records differ.
  planner::CostModel model = uniform(8);
  for (std::size_t l = 0; l < model.layers.size(); ++l) {
    model.layers[l].in = double(8 + 3 * l);
    model.layers[l].out = double(8 + 3 * (l + 1));
    model.layers[l].saved = double(l % 3);
    model.layers[l].forward *= 1.0 + 0.3 * double(l % 4);
  }
  planner::Request request;
  request.model = model;
  request.devices = 4;
  request.batch = 16;
  request.asynchronous = true;
  request.one_process = true;  // messages land as they are sent: where depends on the timing
  const planner::Report report = plan(request);
  REQUIRE(report.ranked.size() >= 20);
  std::set<std::string> schedules;
  int loose = 0;
  for (const planner::Layout& l : report.ranked) {
    schedules.insert(l.schedule);
    for (std::size_t w = 0; w < l.peak_activation_bytes.size(); ++w) {
      INFO(l.describe() << " worker " << w << ": " << l.peak_activation_low_bytes[w] << " <= "
                        << l.peak_activation_bytes[w] << " <= " << l.peak_activation_high_bytes[w]);
      CHECK(l.peak_activation_low_bytes[w] <= l.peak_activation_bytes[w] * (1 + 1e-12));
      CHECK(l.peak_activation_bytes[w] <= l.peak_activation_high_bytes[w] * (1 + 1e-12));
      CHECK(l.most_bytes[w] - l.peak_bytes[w] == Approx(l.peak_activation_high_bytes[w] - l.peak_activation_bytes[w]));
      loose += l.peak_activation_high_bytes[w] > l.peak_activation_low_bytes[w] * (1 + 1e-9);
    }
  }
  CHECK(schedules.size() >= 6);
  CHECK(loose > 0);  // some layouts do race
  // Across processes a message lands as its receiver takes it (Landing::at_receive): the bounds are
  // one figure, the replay's, and no higher than in one process, where messages may land early.
  request.one_process = false;
  const planner::Report across = plan(request);
  REQUIRE(across.ranked.size() >= 20);
  int lower = 0;
  for (const planner::Layout& l : across.ranked) {
    const auto same = std::find_if(report.ranked.begin(), report.ranked.end(), [&](const planner::Layout& o) {
      return o.describe() == l.describe();
    });
    for (std::size_t w = 0; w < l.peak_activation_bytes.size(); ++w) {
      INFO(l.describe() << " worker " << w);
      CHECK(l.peak_activation_low_bytes[w] == l.peak_activation_high_bytes[w]);
      CHECK(l.peak_activation_bytes[w] == Approx(l.peak_activation_low_bytes[w]));
      if (same == report.ranked.end()) continue;
      CHECK(l.peak_activation_high_bytes[w] <= same->peak_activation_high_bytes[w] * (1 + 1e-12));
      lower += l.peak_activation_high_bytes[w] < same->peak_activation_high_bytes[w] * (1 - 1e-9);
    }
  }
  CHECK(lower > 0);  // some messages did land before their receivers took them
}

TEST_CASE("planner: asynchronous schedules only when asked for", "[planner]") {
  planner::Request request;
  request.model = uniform(8);
  request.devices = 2;
  request.batch = 16;
  const auto has = [](const planner::Report& r, const std::string& name) {
    return std::any_of(r.ranked.begin(), r.ranked.end(), [&](const planner::Layout& l) { return l.schedule == name; });
  };
  const planner::Report by_default = plan(request);
  CHECK_FALSE(has(by_default, "pipedream"));
  CHECK_FALSE(has(by_default, "2bw"));
  CHECK(has(by_default, "1f1b"));
  const auto why = std::find_if(by_default.rejected.begin(), by_default.rejected.end(),
                                [](const planner::Rejected& r) { return r.layout.find("2bw p=2") == 0; });
  REQUIRE(why != by_default.rejected.end());
  CHECK_THAT(why->reason, Catch::StartsWith("asynchronous: stale weights"));
  request.schedules = {"2bw"};
  CHECK(has(plan(request), "2bw"));
  request.schedules = {};
  request.asynchronous = true;
  CHECK(has(plan(request), "pipedream"));
  // A model with tied weights never gets one.
  request.model.tied = true;
  CHECK_FALSE(has(plan(request), "pipedream"));
}

TEST_CASE("planner: a layout the program refuses is never proposed and carries the program's reason", "[planner]") {
  planner::Request request;
  request.model = uniform(8);
  request.devices = 4;
  request.batch = 16;
  // As a trainer that runs 1f1b only on 2 stages, with 2 replicas fixed at launch.
  std::vector<std::string> asked;
  request.refuses = [&](std::string_view schedule, int p, int d, int t, int cp) -> std::string {
    asked.push_back(std::string(schedule) + " " + std::to_string(p) + " " + std::to_string(d) + " " + std::to_string(t) +
                    " " + std::to_string(cp));
    if (d != 2) return "the launch fixed 2 replicas";
    if (schedule != "1f1b") return "this program runs 1f1b";
    return {};
  };
  const planner::Report report = plan(request);
  REQUIRE_FALSE(report.ranked.empty());
  for (const planner::Layout& l : report.ranked) {
    CHECK(l.schedule == "1f1b");
    CHECK(l.replicas == 2);
    CHECK(l.stages == 2);
  }
  CHECK_FALSE(asked.empty());
  const auto reason = [&](const std::string& prefix) {
    const auto it = std::find_if(report.rejected.begin(), report.rejected.end(),
                                 [&](const planner::Rejected& r) { return r.layout.rfind(prefix, 0) == 0; });
    return it == report.rejected.end() ? std::string() : it->reason;
  };
  CHECK(reason("gpipe p=2 d=2") == "this program runs 1f1b");
  CHECK(reason("1f1b p=4 d=1") == "the launch fixed 2 replicas");
  // Without it the same request proposes the other layouts.
  request.refuses = {};
  const planner::Report open = plan(request);
  CHECK(std::any_of(open.ranked.begin(), open.ranked.end(), [](const planner::Layout& l) { return l.replicas != 2; }));
}

TEST_CASE("planner: expert parallelism's all-to-alls, exposed in the step and hidden by DualPipeV's pairs",
          "[planner][experts]") {
  planner::Request request;
  request.model = uniform(8);
  // Two mixture-of-experts layers (one per stage at 2 stages), each sending 64 values a row per
  // all-to-all over groups of 2 ranks: half the bytes leave, at 1 MB/s, 0.1 ms latency.
  request.model.layers[1].all_to_all_values = request.model.layers[5].all_to_all_values = 64;
  request.model.expert_ranks = 2;
  request.model.all_to_all_latency = 1e-4;
  request.model.all_to_all_bytes_per_second = 1e6;
  request.devices = 4;
  request.batch = 16;
  request.stage_counts = {2};
  request.schedules = {"1f1b", "dualpipev"};
  request.zero_stages = {0, 1, 2};
  const planner::Report report = plan(request);
  const auto find = [&](const planner::Report& r, std::string_view schedule, int m) {
    const auto it = std::find_if(r.ranked.begin(), r.ranked.end(), [&](const planner::Layout& l) {
      return l.schedule == schedule && l.microbatches == m;
    });
    REQUIRE(it != r.ranked.end());
    return *it;
  };
  // 2 replicas of 8 samples in 4 microbatches of 2 rows: each all-to-all takes 0.1 ms + 2 x 64 x 4
  // / 2 bytes at 1 MB/s = 0.356 ms; each F and each B of a stage runs two.
  const double one = 1e-4 + 2 * 64 * 4 / 2 / 1e6;
  const planner::Layout f1b = find(report, "1f1b", 4), dual = find(report, "dualpipev", 4);
  CHECK(f1b.replicas == 2);
  CHECK(f1b.exposed_all_to_all_seconds == Approx(2 * 4 * 2 * 2 * one).epsilon(1e-9));  // nothing hides it
  CHECK(f1b.unpaired_all_to_all_seconds == f1b.exposed_all_to_all_seconds);
  // DualPipeV without its pairs exposes the same all-to-alls; its pairs hide some behind compute.
  CHECK(dual.unpaired_all_to_all_seconds == Approx(f1b.exposed_all_to_all_seconds).epsilon(1e-9));
  CHECK(dual.exposed_all_to_all_seconds < dual.unpaired_all_to_all_seconds);
  // The exposed time is in the step: the same layouts without expert groups are faster.
  planner::Request dense = request;
  dense.model.expert_ranks = 1;
  const planner::Report without = plan(dense);
  CHECK(find(without, "1f1b", 4).exposed_all_to_all_seconds == 0);
  CHECK(f1b.step_seconds > find(without, "1f1b", 4).step_seconds + 2 * 2 * one);
  // Expert groups keep each replica's experts: no ZeRO (the runtime refuses it too).
  for (const planner::Layout& l : report.ranked) CHECK(l.zero == 0);
  CHECK(std::any_of(without.ranked.begin(), without.ranked.end(), [](const planner::Layout& l) { return l.zero > 0; }));
  CHECK_THAT(planner::describe(report, request.model), Catch::Contains("all-to-alls over expert groups of 2: "));
  // The cost JSON carries the group and the layers' values.
  const planner::CostModel back =
      planner::cost_model_from_json(nlohmann::json::parse(planner::to_json(request.model).dump()), "costs.json");
  CHECK(back.expert_ranks == 2);
  CHECK(back.all_to_all_latency == 1e-4);
  CHECK(back.all_to_all_bytes_per_second == 1e6);
  CHECK(back.layers[5].all_to_all_values == 64);

  SECTION("on shared cores the report says the pairs' hidden all-to-alls are not the whole story") {
    const auto caveat = [](const planner::Report& r) {
      return std::any_of(r.caveats.begin(), r.caveats.end(),
                         [](const std::string& c) { return c.find("overlapped pairs' all-to-alls") != std::string::npos; });
    };
    request.cores = 2;
    request.colocated = 4;
    request.schedules = {"dualpipev"};
    const planner::Report shared = plan(request);
    REQUIRE_FALSE(shared.ranked.empty());
    CHECK(caveat(shared));
    CHECK_THAT(planner::describe(shared, request.model), Catch::Contains("4 processes on 2 cores an exchange also waits"));
    request.schedules = {"1f1b"};  // no pairs: nothing hidden to doubt
    CHECK_FALSE(caveat(plan(request)));
    request.schedules = {"dualpipev"};
    request.colocated = 2;  // a core each
    CHECK_FALSE(caveat(plan(request)));
  }
  SECTION("expert groups form among the replicas") {
    request.stage_counts = {4};
    const planner::Report one_replica = plan(request);
    CHECK(one_replica.ranked.empty());
    REQUIRE_FALSE(one_replica.rejected.empty());
    CHECK(one_replica.rejected.front().reason ==
          "expert-parallel groups of 2 form among the replicas: 1 replica(s) are not a multiple");
  }
  SECTION("refusals") {
    request.one_process = true;
    CHECK_THROWS_WITH(plan(request), Catch::Contains("an expert group's ranks are processes"));
    request.one_process = false;
    request.model.expert_ranks = 0;
    CHECK_THROWS_WITH(plan(request), Catch::Contains("CostModel::expert_ranks must be at least 1, got 0"));
  }
}

namespace {

/// Two uniform layers on two workers of one process, GPipe, up to `max_microbatches`.
planner::Request two_workers_in_one_process(int max_microbatches) {
  planner::Request request;
  request.model = uniform(2);
  request.devices = 2;
  request.batch = 8;
  request.schedules = {"gpipe"};
  request.stage_counts = {2};
  request.max_microbatches = max_microbatches;
  request.one_process = true;
  return request;
}

/// The predicted step of `request`'s two-stage layout with `m` microbatches.
double two_stage_step(const planner::Request& request, int m) {
  const planner::Report report = plan(request);
  const auto it = std::find_if(report.ranked.begin(), report.ranked.end(),
                               [&](const planner::Layout& l) { return l.stages == 2 && l.microbatches == m; });
  REQUIRE(it != report.ranked.end());
  return it->step_seconds;
}

}  // namespace

TEST_CASE("planner: in one process a hand-over lengthens the sender's action", "[planner]") {
  planner::Request request = two_workers_in_one_process(1);
  const double alone = plan(request).best().step_seconds;
  request.model.link_latency = 1e-3;
  const planner::Layout& linked = plan(request).best();
  // One microbatch: F0 sends its output, B1 its input gradient, each 1 ms longer; the chain of four
  // actions is 2 ms longer, and the first worker's record waits that long too.
  CHECK(linked.step_seconds == Approx(alone + 2e-3).epsilon(1e-9));
}

TEST_CASE("planner: in one process a waiting receiver wakes later, the sender is not held", "[planner]") {
  planner::Request request = two_workers_in_one_process(2);
  const auto step = [&](int m) { return two_stage_step(request, m); };
  const double one = step(1), two = step(2);
  request.model.wake_seconds = 1e-3;
  // One microbatch: F1 waits for F0's output and B0 for B1's gradient, each 1 ms later.
  CHECK(step(1) == Approx(one + 2e-3).epsilon(1e-9));
  // Two microbatches (F 0.5 ms, B with its W 1 ms): the second worker sits waiting only for the
  // first F, the first worker only for the first B, so it too is 2 ms longer. The same 1 ms as the
  // link's latency, which holds each sender, makes it 4 ms longer (the first worker's two F's and
  // the second worker's two B's each send).
  CHECK(step(2) == Approx(two + 2e-3).epsilon(1e-9));
  request.model.wake_seconds = 0;
  request.model.link_latency = 1e-3;
  CHECK(step(2) == Approx(two + 4e-3).epsilon(1e-9));
  request.model.link_latency = 0;
  request.model.wake_seconds = 1e-3;
  // The wake-up is the only term a second process does not have: between processes the link's
  // latency holds it.
  request.one_process = false;
  request.max_replicas = 1;
  const double separate = plan(request).best().step_seconds;
  request.model.wake_seconds = 0;
  CHECK(plan(request).best().step_seconds == Approx(separate).epsilon(1e-12));
}

TEST_CASE("planner: a layout with more workers than cores carries a caveat", "[planner]") {
  planner::Request request = two_workers_in_one_process(2);
  CHECK(plan(request).caveats.empty());  // cores unknown: no caveat
  request.cores = 2;
  CHECK(plan(request).caveats.empty());  // two workers, two cores
  request.cores = 1;
  const planner::Report one_core = plan(request);
  REQUIRE(one_core.best().stages == 2);
  REQUIRE(one_core.caveats.size() == 1);
  CHECK_THAT(one_core.caveats[0], Catch::StartsWith("2 workers share 1 cores"));
  CHECK_THAT(planner::describe(one_core, request.model), Catch::Contains("caveat: 2 workers share 1 cores"));
  // Across processes, the processes on the node count, whatever the layout.
  request.one_process = false;
  request.max_replicas = 1;
  request.cores = 2;
  request.colocated = 2;
  CHECK(plan(request).caveats.empty());
  request.colocated = 4;
  REQUIRE(plan(request).caveats.size() == 1);
  CHECK_THAT(plan(request).caveats[0], Catch::StartsWith("4 processes share 2 cores"));
  request.cores = -1;
  CHECK_THROWS_WITH(plan(request), Catch::Contains("cores counts the machine's cores"));
}

TEST_CASE("planner: contention weights each instant by the workers busy then", "[planner]") {
  // Worker 0 runs [0, 2], worker 1 [1, 3] and [3, 4]: alone for 1, together for 1, alone for 1 more.
  schedule::SimResult sim;
  sim.times = {{{0, 2}}, {{1, 3}, {3, 4}}};
  const std::vector<double> f = planner::detail::contention_factors(sim, {1.0, 1.5});
  REQUIRE(f.size() == 2);
  CHECK(f[0] == Approx(1.25).epsilon(1e-12));        // (1 x 1 + 1 x 1.5) / 2
  CHECK(f[1] == Approx(3.5 / 3.0).epsilon(1e-12));   // (1 x 1.5 + 2 x 1) / 3: back to back is not at once
  // Three workers busy at once with two entries take the last; an idle worker keeps 1.
  sim.times = {{{0, 1}}, {{0, 1}}, {{0, 1}}, {}};
  const std::vector<double> three = planner::detail::contention_factors(sim, {1.0, 1.5});
  CHECK(three == std::vector<double>{1.5, 1.5, 1.5, 1.0});
  // A worker alone in its pipeline is busy beside its replica's copy; no factors, no change.
  sim.times = {{{0, 1}}};
  CHECK(planner::detail::contention_factors(sim, {1.0, 1.5}, 2) == std::vector<double>{1.5});
  CHECK(planner::detail::contention_factors(sim, {}) == std::vector<double>{1.0});
  // Half of a pipeline's processes on each of two nodes: two busy workers are one on each node.
  sim.times = {{{0, 1}}, {{0, 1}}};
  CHECK(planner::detail::contention_factors(sim, {1.0, 1.5}, 0.5) == std::vector<double>{1.0, 1.0});
  CHECK(planner::detail::contention_factors(sim, {1.0, 1.5, 2.0}, 1.5) == std::vector<double>{2.0, 2.0});
  // With the cores known, three workers busy at once on two cores each have two thirds of a core.
  sim.times = {{{0, 1}}, {{0, 1}}, {{0, 1}}, {}};
  CHECK(planner::detail::contention_factors(sim, {1.0, 1.5}, 1, 2) == std::vector<double>{2.25, 2.25, 2.25, 1.0});
  CHECK(planner::detail::contention_factors(sim, {1.0, 1.5}, 1, 4) == std::vector<double>{1.5, 1.5, 1.5, 1.0});
}

TEST_CASE("planner: beyond the measured contention, workers that outnumber the cores share them", "[planner]") {
  using planner::detail::contention_at;
  const std::vector<double> two = {1.0, 1.5};
  CHECK(contention_at(two, 1, 2) == 1.0);
  CHECK(contention_at(two, 2, 2) == 1.5);
  CHECK(contention_at(two, 3, 0) == 1.5);                   // cores unknown: the last entry
  CHECK(contention_at(two, 3, 2) == Approx(2.25).epsilon(1e-12));  // 1.5 x 3/2
  CHECK(contention_at(two, 4, 2) == Approx(3.0).epsilon(1e-12));
  CHECK(contention_at(two, 5, 8) == 1.5);                   // within 8 cores: no turns to take
  CHECK(contention_at(two, 12, 8) == Approx(1.5 * 12 / 8).epsilon(1e-12));
  // Measured beyond the cores (4 processes of a node on 2 cores): the entries hold the turns already.
  const std::vector<double> four = {1.0, 1.2, 1.9, 2.6};
  CHECK(contention_at(four, 4, 2) == 2.6);
  CHECK(contention_at(four, 6, 2) == Approx(2.6 * 6 / 4).epsilon(1e-12));
  // In the planner: three workers of one process on two cores, three microbatches of GPipe (the
  // three busy at once in its middle), predicted slower than where the cores are unknown or four.
  planner::Request request = two_workers_in_one_process(3);
  request.devices = 3;
  request.stage_counts = {3};
  request.model = uniform(3);
  request.model.contention = {1.0, 1.1};
  const auto step = [&](int cores) {
    request.cores = cores;
    const planner::Report report = plan(request);
    const auto it = std::find_if(report.ranked.begin(), report.ranked.end(),
                                 [&](const planner::Layout& l) { return l.stages == 3 && l.microbatches == 3; });
    REQUIRE(it != report.ranked.end());
    return it->step_seconds;
  };
  const double unknown = step(0), four_cores = step(4), two_cores = step(2);
  CHECK(four_cores == Approx(unknown).epsilon(1e-12));
  CHECK(two_cores > unknown * 1.01);
  CHECK(two_cores < unknown * 1.5);  // only the part of the step with all three busy takes turns
  // The oracle: the same as a third entry measured at 1.1 x 3/2, with the cores unknown.
  request.model.contention = {1.0, 1.1, 1.65};
  CHECK(step(0) == Approx(two_cores).epsilon(1e-12));
  // One entry (an action alone): nothing to charge with the cores unknown; with two cores, three
  // workers busy at once each have two thirds of one.
  request.model.contention = {1.0};
  const double alone = step(0), one_entry = step(2);
  CHECK(one_entry > alone * 1.01);
  request.model.contention = {1.0, 1.0, 1.5};
  CHECK(step(0) == Approx(one_entry).epsilon(1e-12));
}

TEST_CASE("planner: in one process, workers computing at once are slower by the measured contention", "[planner]") {
  planner::Request request = two_workers_in_one_process(2);
  const auto step = [&](int m) { return two_stage_step(request, m); };
  const double one = step(1), two = step(2);
  // One microbatch: the two workers never compute at once, so contention changes nothing.
  request.model.contention = {1.0, 3.0};
  CHECK(step(1) == Approx(one).epsilon(1e-12));
  // Two: they overlap for part of the step, so it is longer, but less than 3x.
  const double contended = step(2);
  CHECK(contended > two * 1.01);
  CHECK(contended < two * 3.0);
  // Between processes the term is not applied unless they share a machine (Request::colocated):
  // each has its own device or node.
  request.one_process = false;
  request.max_replicas = 1;
  const double separate = plan(request).best().step_seconds;
  request.colocated = 1;
  CHECK(plan(request).best().step_seconds == Approx(separate).epsilon(1e-12));
  // Two processes on one node slow each other as two threads of one process do.
  request.colocated = 2;
  const double shared = plan(request).best().step_seconds;
  CHECK(shared > separate * 1.01);
  CHECK(shared < separate * 3.0);
  request.colocated = 8;  // more than the layout's workers: the same two busy at most
  CHECK(plan(request).best().step_seconds == Approx(shared).epsilon(1e-12));
  request.model.contention = {};
  CHECK(plan(request).best().step_seconds == Approx(separate).epsilon(1e-12));
  request.colocated = -1;
  CHECK_THROWS_WITH(plan(request), Catch::Contains("colocated counts the workers that share a machine"));
  request.colocated = 0;
  request.model.contention = {1.0, 0.0};
  CHECK_THROWS_WITH(plan(request), Catch::Contains("contention[1]"));
  request.model.contention = {2.0, 2.0};  // entry 0 is a worker alone: the profile itself
  CHECK_THROWS_WITH(plan(request), Catch::Contains("contention[0] is an action alone"));
}

namespace {

/// uniform(8) with a 2-way tensor-parallel variant: each layer's part takes half the time and holds
/// half the parameters, and sums 64 values per row in its forward and in its input gradient (one
/// call each).
planner::CostModel with_halves(double sum_latency, double sum_bytes_per_second) {
  planner::CostModel model = uniform(8);
  planner::TensorVariant half{2, model.layers};
  for (planner::LayerCost& l : half.layers) {
    l.forward /= 2, l.backward_input /= 2, l.backward_weight /= 2, l.params /= 2;
    l.sum_forward = l.sum_backward = 64;
    l.sum_forward_calls = l.sum_backward_calls = 1;
  }
  model.tensor_variants.push_back(half);
  model.tensor_sum_latency = sum_latency;
  model.tensor_sum_bytes_per_second = sum_bytes_per_second;
  return model;
}

}  // namespace

TEST_CASE("planner: tensor parallelism, its per-rank parts and its sums in the step time", "[planner]") {
  planner::Request request;
  request.model = with_halves(1e-4, 1e9);
  request.devices = 2;
  request.batch = 16;
  request.tensor_degrees = {1, 2};
  request.schedules = {"gpipe"};
  const planner::Report report = plan(request);
  const auto found = [&](int p, int d, int t, int m) {
    return std::find_if(report.ranked.begin(), report.ranked.end(), [&](const planner::Layout& l) {
      return l.stages == p && l.replicas == d && l.tensor == t && l.microbatches == m;
    });
  };
  const auto split = found(1, 1, 2, 1);
  REQUIRE(split != report.ranked.end());
  CHECK(split->describe() == "gpipe p=1 v=1 m=1 d=1 t=2");
  // One microbatch of 16 rows: each part's action takes 0.5 ms x 16 / 8 = 1 ms; each of the 8
  // layers' F and B sums 16 x 64 values once: 0.1 ms + 2 (1/2) x 1024 x 4 B / 1 GB/s.
  const double sum = 1e-4 + 1024 * 4 / 1e9;
  CHECK(split->step_seconds == Approx(8 * 3 * 1e-3 + 16 * sum).epsilon(1e-9));
  // Each rank holds half the parameters: less than a replica holding all of them.
  const auto whole = found(1, 2, 1, 1);
  REQUIRE(whole != report.ranked.end());
  CHECK(most(split->peak_bytes) < most(whole->peak_bytes));
  // Every layout uses the 2 devices: stages x replicas x tensor ranks.
  for (const planner::Layout& l : report.ranked) CHECK(l.stages * l.replicas * l.tensor == 2);

  SECTION("sums that cost nothing make the split the fastest layout that fits where replicas do not") {
    request.model = with_halves(0, 0);
    // Room for half the model's state and its activations, not for all of it.
    const double full_state = 8 * 64 * 64 * 4.0 * (1 + 1 + 2);
    request.memory_bytes = full_state * 0.9;
    const planner::Report capped = plan(request);
    REQUIRE(!capped.ranked.empty());
    CHECK(capped.best().tensor == 2);
    CHECK(capped.best().bubble == Approx(0).margin(1e-12));
  }
  SECTION("slow sums make a pipeline the better choice") {
    request.model = with_halves(5e-3, 1e9);
    request.memory_bytes = 0;
    CHECK(plan(request).best().tensor == 1);
  }
}

TEST_CASE("planner: a tensor degree without its profile is refused with the reason", "[planner]") {
  planner::Request request;
  request.model = uniform(4);
  request.devices = 2;
  request.batch = 8;
  request.tensor_degrees = {2};
  CHECK_THROWS_WITH(plan(request), Catch::Contains("no profile of the model split 2 ways"));
  request.model = with_halves(0, 0);
  request.model.tensor_variants[0].layers.pop_back();
  CHECK_THROWS_WITH(plan(request), Catch::Contains("the 2-way tensor-parallel profile has 7 layers, the model 8"));
  request.model = with_halves(0, 0);
  request.one_process = true;
  CHECK_THROWS_WITH(plan(request), Catch::Contains("tensor-parallel ranks are processes"));
}

TEST_CASE("planner: a cost model with a tensor-parallel variant reads back from JSON exactly", "[planner]") {
  planner::CostModel model = with_halves(1e-4, 2e9);
  model.action_overhead_seconds = 3.25e-6;
  model.wake_seconds = 2.5e-5;
  model.contention = {1.0, 1.125};
  // Through the text a file holds.
  const planner::CostModel back = planner::cost_model_from_json(nlohmann::json::parse(planner::to_json(model).dump()), "test");
  REQUIRE(back.tensor_variants.size() == 1);
  CHECK(back.tensor_variants[0].degree == 2);
  REQUIRE(back.tensor_variants[0].layers.size() == 8);
  CHECK(back.tensor_variants[0].layers[3].sum_forward == 64);
  CHECK(back.tensor_variants[0].layers[3].sum_backward_calls == 1);
  CHECK(back.tensor_variants[0].layers[3].forward == model.tensor_variants[0].layers[3].forward);
  CHECK(back.tensor_sum_latency == 1e-4);
  CHECK(back.tensor_sum_bytes_per_second == 2e9);
  CHECK(back.action_overhead_seconds == 3.25e-6);
  CHECK(back.wake_seconds == 2.5e-5);
  CHECK(back.contention == std::vector<double>{1.0, 1.125});
}

TEST_CASE("planner: calibration repeats a measurement while its rounds disagree, and reports their spread", "[planner]") {
  using planner::detail::relative_spread;
  CHECK(relative_spread({}) == 0);
  CHECK(relative_spread({5.0}) == 0);
  CHECK(relative_spread({10.0, 10.0, 10.0}) == 0);
  // Median 10, deviations 0, 1 and 9: their median 1, a tenth of the median.
  CHECK(relative_spread({9.0, 10.0, 19.0}) == 1.0 / 10.0);
  // Quiet: the least rounds.
  int calls = 0;
  CHECK(planner::detail::repeated({3, 7, 0.02}, [&] { return 1.0 + 1e-4 * ++calls; }).size() == 3);
  // Rounds that keep disagreeing (by 8% around their median): the most.
  const std::vector<double> noisy = planner::detail::repeated({3, 7, 0.02}, [&] { return 1.0 + 0.1 * (++calls % 5); });
  CHECK(noisy.size() == 7);
  CHECK(relative_spread(noisy) > 0.08);
  // One outlier beside two that agree: the median is sure, and three rounds do.
  std::vector<double> values{1.0, 1.5, 1.0};
  std::size_t next = 0;
  CHECK(planner::detail::repeated({3, 7, 0.02}, [&] { return values[next++]; }).size() == 3);
  // Three that disagree, then two that agree with the middle one: five rounds.
  values = {1.0, 1.1, 1.2, 1.1, 1.1, 1.3, 1.3};
  next = 0;
  CHECK(planner::detail::repeated({3, 7, 0.02}, [&] { return values[next++]; }).size() == 5);
  planner::detail::RoundsSeen seen;
  seen.add({1.0, 1.0, 1.0});
  seen.add(noisy);
  CHECK(seen.rounds == 7);
  CHECK(seen.spread == relative_spread(noisy));
  // The cost model carries them through JSON, and the report prints them.
  planner::CostModel model = with_halves(1e-4, 2e9);
  model.calibration_spread = 0.0325;
  model.calibration_rounds = 5;
  const planner::CostModel back = planner::cost_model_from_json(nlohmann::json::parse(planner::to_json(model).dump()), "test");
  CHECK(back.calibration_spread == 0.0325);
  CHECK(back.calibration_rounds == 5);
}

TEST_CASE("planner: a cost model's integers are read in range or refused (issue #61's fuzzing)", "[planner]") {
  const std::string layers = R"("layers": [{"forward": 1e-3, "backward_input": 1e-3, "backward_weight": 1e-3, "params": 10,)"
                             R"( "in": 2, "out": 2}])";
  const auto read = [&](const std::string& fields) {
    return planner::cost_model_from_json(nlohmann::json::parse("{" + fields + ", " + layers + "}"), "costs.json");
  };
  CHECK(read(R"("profiled_rows": 8, "value_bytes": 2)").value_bytes == 2);
  // get<index_t>() of 1e300 is undefined behaviour (UBSan: outside the range of 'long').
  CHECK_THROWS_WITH(read(R"("profiled_rows": 1e300)"),
                    Catch::Contains("costs.json: profiled_rows must be an integer in [") && Catch::Contains("found 1e+300"));
  // get<int>() would wrap these to 1410065408 and -1.
  CHECK_THROWS_WITH(read(R"("profiled_rows": 8, "value_bytes": 10000000000)"),
                    Catch::Contains("value_bytes must be an integer in [-2147483648, 2147483647], found 10000000000"));
  CHECK_THROWS_WITH(read(R"("profiled_rows": 8, "optimizer_slots": 18446744073709551615)"),
                    Catch::Contains("optimizer_slots must be an integer"));
  CHECK_THROWS_WITH(read(R"("profiled_rows": 8, "tensor_variants": [{"degree": 2.5, "layers": []}])"),
                    Catch::Contains("tensor_variants[0].degree must be an integer in [-2147483648, 2147483647], found 2.5"));
  // A nested value is named by its type: dump() of 300,000 nested arrays recurses as deep.
  CHECK_THROWS_WITH(read(R"("profiled_rows": )" + std::string(300000, '[') + std::string(300000, ']')),
                    Catch::Contains("profiled_rows must be an integer") && Catch::Contains("found array"));
}

TEST_CASE("planner: context parallelism splits each sample's rows over a ring, its passes in the step", "[planner][cp]") {
  planner::Request request;
  request.model = uniform(8);
  request.model.rows_per_sample = 16;  // sequences of 16 tokens
  request.model.layers[3].ring_values = 64;  // one attention layer: keys and values of 32 + 32
  request.model.link_latency = 1e-4;
  request.model.link_bytes_per_second = 1e9;
  request.devices = 2;
  request.batch = 4;
  request.schedules = {"gpipe"};
  request.context_degrees = {1, 2};
  const planner::Report report = plan(request);
  const auto found = [&](int p, int d, int cp) {
    return std::find_if(report.ranked.begin(), report.ranked.end(), [&](const planner::Layout& l) {
      return l.stages == p && l.replicas == d && l.context == cp && l.microbatches == 1;
    });
  };
  const auto ring = found(1, 1, 2), replicas = found(1, 2, 1);
  REQUIRE(ring != report.ranked.end());
  REQUIRE(replicas != report.ranked.end());
  CHECK(ring->describe() == "gpipe p=1 v=1 m=1 d=1 cp=2");
  // Each rank runs 4 sequences' halves, 32 rows: 4 ms an action, as a replica's 2 whole sequences.
  // The attention's forward passes (one of 32 rows x 64 values) hide behind its 4 ms blocks; its
  // backward adds the two passes of their gradients.
  const double pass = 1e-4 + 32 * 64 * 4 / 1e9;
  CHECK(replicas->step_seconds == Approx(8 * 3 * 4e-3).epsilon(1e-9));
  CHECK(ring->step_seconds == Approx(8 * 3 * 4e-3 + 2 * pass).epsilon(1e-9));
  // The same rows per rank as a replica: the same activation peak, half of one rank's whole batch.
  CHECK(ring->peak_activation_bytes == replicas->peak_activation_bytes);
  for (const planner::Layout& l : report.ranked) CHECK(l.stages * l.replicas * l.tensor * l.context == 2);

  SECTION("a batch of one sequence: a ring can split it where replicas cannot") {
    request.batch = 1;
    const planner::Report one = plan(request);
    CHECK(std::none_of(one.ranked.begin(), one.ranked.end(), [](const planner::Layout& l) { return l.replicas == 2; }));
    CHECK(std::any_of(one.ranked.begin(), one.ranked.end(), [](const planner::Layout& l) { return l.context == 2; }));
  }
  SECTION("the ring's ranks sum gradients as replicas do") {
    request.model.allreduce_bytes_per_second = 1e9;
    const planner::Report summed = plan(request);
    const auto a = std::find_if(summed.ranked.begin(), summed.ranked.end(), [](const planner::Layout& l) { return l.context == 2; });
    const auto b = std::find_if(summed.ranked.begin(), summed.ranked.end(), [](const planner::Layout& l) { return l.replicas == 2; });
    REQUIRE(a != summed.ranked.end());
    REQUIRE(b != summed.ranked.end());
    CHECK(a->allreduce_seconds > 0);
    CHECK(a->allreduce_seconds == Approx(b->allreduce_seconds).epsilon(1e-12));
  }
  SECTION("the program is asked about each ring size, and what it refuses is never proposed") {
    std::vector<int> asked;
    request.refuses = [&](std::string_view, int, int, int, int cp) -> std::string {
      asked.push_back(cp);
      return cp == 2 ? "this program has no ring" : "";
    };
    const planner::Report refused = plan(request);
    CHECK(std::count(asked.begin(), asked.end(), 2) > 0);
    CHECK(std::count(asked.begin(), asked.end(), 1) > 0);
    REQUIRE_FALSE(refused.ranked.empty());
    CHECK(std::none_of(refused.ranked.begin(), refused.ranked.end(), [](const planner::Layout& l) { return l.context == 2; }));
    CHECK(std::any_of(refused.rejected.begin(), refused.rejected.end(), [](const planner::Rejected& r) {
      return r.layout == "gpipe p=1 d=1 cp=2" && r.reason == "this program has no ring";
    }));
  }
  SECTION("refusals") {
    request.context_degrees = {3};
    CHECK_THROWS_WITH(plan(request), Catch::Contains("context-parallel degree 3") &&
                                         Catch::Contains("samples of 16 rows do not cut into 6 equal chunks"));
    request.context_degrees = {2};
    request.one_process = true;
    CHECK_THROWS_WITH(plan(request), Catch::Contains("a context-parallel ring's ranks are processes"));
  }
}
