// SPDX-License-Identifier: Apache-2.0
// The memory model and the planner with ZeRO (PipelineOptions::zero): the parameter state per tag
// under each stage, within a step and between steps; the gathers ZeRO-3 runs, counted as the
// runtime counts them (mpi:zero3_interleaved_2_stages_np4 measures 11 on worker 0); and the planner
// choosing the ZeRO stage: the least memory among layouts as fast, and ZeRO-3 where only it fits.
// The state within a step is a bound: each tag's most, added (ZeRO-2's whole gradient buffer is
// counted from the step's start, though a backward allocates it).
#include <catch2/catch.hpp>

#include <algorithm>
#include <string>
#include <vector>

#include "cupipe/core/memory.hpp"
#include "cupipe/planner/planner.hpp"
#include "cupipe/schedule/schedule.hpp"

namespace {

using namespace cupipe;

/// `n` equal layers with F = B = W = 1 ms for 8 rows, and a gradient sum of 1 GB/s.
planner::CostModel uniform(std::size_t n, int value_bytes = 4, int compute_bytes = 0) {
  planner::CostModel model;
  model.profiled_rows = 8;
  model.value_bytes = value_bytes;
  model.compute_bytes = compute_bytes;
  model.allreduce_bytes_per_second = 1e9;
  for (std::size_t l = 0; l < n; ++l) model.layers.push_back({"layer" + std::to_string(l), 1e-3, 1e-3, 1e-3, 1e5, 64, 64, 64});
  return model;
}

/// 2 stages of 1F1B over `devices` / 2 replicas, 16 samples a step.
planner::Request two_stages(planner::CostModel model, std::vector<int> zero_stages, int devices) {
  planner::Request request;
  request.model = std::move(model);
  request.devices = devices;
  request.batch = 16;
  request.stage_counts = {2};
  request.schedules = {"1f1b"};
  request.zero_stages = std::move(zero_stages);
  return request;
}

double peak(const planner::Layout& l) { return *std::max_element(l.peak_bytes.begin(), l.peak_bytes.end()); }

}  // namespace

TEST_CASE("ZeRO's parameter state per tag, within a step and between steps", "[planner][zero]") {
  // fp32, AdamW (2 slots), 1000 parameters on a worker whose largest virtual stage holds 600, 4 replicas.
  const auto at = [](int stage, bool in_step, bool reshard = true, int value = 4, int compute = 0) {
    return sharded_state_bytes(1000, 600, value, compute, 2, 1, ZeroSetting{stage, 4, reshard}, in_step);
  };
  CHECK(at(0, true).weights == 4000);
  CHECK(at(0, true).gradients == 4000);
  CHECK(at(0, true).optimizer == 8000);
  CHECK(at(0, true).total() == parameter_state_bytes(4, 0, 2, 1) * 1000);
  CHECK(at(1, true).optimizer == 2000);
  CHECK(at(1, false).gradients == 4000);
  CHECK(at(2, false).gradients == 1000);
  CHECK(at(2, true).gradients == 5000);  // the whole buffer the backward accumulates into, and the shard
  CHECK(at(2, true).weights == 4000);
  CHECK(at(3, false).weights == 1000);
  CHECK(at(3, true).weights == 1000 + 2400);         // one virtual stage gathered at a time
  CHECK(at(3, true, false).weights == 1000 + 4000);  // all of them kept through the step
  // bf16 storage, fp32 master weights: ZeRO-3's shard is the master, so its step holds less.
  CHECK(at(2, true, true, 2, 4).weights == 1000 * (2 + 4));
  CHECK(at(3, true, true, 2, 4).weights == 1000 + 2 * 600);
  // One replica: nothing is sharded whatever the stage.
  const StateBytes alone = sharded_state_bytes(1000, 600, 4, 0, 2, 1, ZeroSetting{3, 1, true}, true);
  CHECK(alone.total() == at(0, true).total());
}

TEST_CASE("ZeRO-3's gathers per step, as the runtime runs them", "[planner][zero]") {
  const schedule::Plan interleaved = schedule::generate<schedule::Interleaved<2>>(schedule::Config{2, 4, 2, 1});
  const std::vector<double> each(4, 1.0);  // one per virtual stage: counts the gathers
  CHECK(planner::detail::gathered_params(interleaved, 0, each, true) == 11);  // measured: mpi:zero3_interleaved_*
  CHECK(planner::detail::gathered_params(interleaved, 0, each, false) == 2);
  const schedule::Plan one = schedule::generate<schedule::OneFOneB>(schedule::Config{2, 4, 1, 1});
  CHECK(planner::detail::gathered_params(one, 1, {1.0, 1.0}, true) == 1);
  // The traffic: ZeRO-0 to 2 move 2 (d - 1) / d of a worker's parameters; ZeRO-3 its reduce-scatter
  // and its gathers, the same with one gather per stage, more when it gathers again.
  planner::CostModel model = uniform(4);
  const std::vector<std::size_t> cuts{0, 1, 2, 3, 4};
  const double params = 2e5;  // a worker's two virtual stages
  CHECK(planner::detail::replica_traffic(model, interleaved, cuts, 2, {2, 2, true}) == params);
  CHECK(planner::detail::replica_traffic(model, interleaved, cuts, 2, {3, 2, false}) == params);
  CHECK(planner::detail::replica_traffic(model, interleaved, cuts, 2, {3, 2, true}) == 0.5 * (params + 11 * 1e5));
  CHECK(planner::detail::replica_traffic(model, interleaved, cuts, 1, {3, 1, true}) == 0);
}

// Against a scan of the plan, on schedules with W actions and two chunks (ZBV), overlapped pairs
// (DualPipeV) and plain ones.
TEST_CASE("the weights a worker reads next, and the ones worth fetching ahead", "[planner][zero]") {
  const std::vector<schedule::Plan> plans{schedule::generate<schedule::ZeroBubbleV>(schedule::Config{2, 6, 2, 1}),
                                          schedule::generate<schedule::DualPipeV>(schedule::Config{2, 6, 2, 1}),
                                          schedule::generate<schedule::Interleaved<2>>(schedule::Config{2, 4, 2, 1})};
  for (const schedule::Plan& plan : plans)
    for (int w = 0; w < plan.config.stages; ++w) {
      const std::vector<schedule::Action>& a = plan.actions[std::size_t(w)];
      const schedule::WeightReaders r = schedule::weight_readers(plan, w);
      REQUIRE(r.next_reader.size() == a.size());
      int holding = -1;
      for (std::size_t i = 0; i < a.size(); ++i) {
        if (a[i].kind != schedule::ActionKind::W) holding = plan.virtual_stage(w, a[i]);
        int next = -1, ahead = -1;
        for (std::size_t j = i + 1; j < a.size(); ++j) {
          if (a[j].kind == schedule::ActionKind::W) continue;
          const int v = plan.virtual_stage(w, a[j]);
          if (next < 0) next = v;
          if (ahead < 0 && v != holding) ahead = v;
        }
        INFO("worker " << w << ", action " << i);
        CHECK(r.next_reader[i] == next);
        CHECK(r.prefetch[i] == ahead);
      }
    }
}

TEST_CASE("the planner picks the ZeRO stage: the least memory among the fastest, ZeRO-3 where only it fits",
          "[planner][zero]") {
  SECTION("fp32, no memory cap: every stage moves the same bytes; ZeRO-1's bound is the least") {
    // Per parameter within a step: ZeRO-0 16 bytes, ZeRO-1 12, ZeRO-2 14 (the whole gradient
    // buffer and the shard), ZeRO-3 16 (one gathered stage and the shard, with one stage a worker).
    const planner::Report report = plan(two_stages(uniform(8), {0, 1, 2, 3}, 4));
    const planner::Layout& best = report.best();
    CHECK(best.zero == 1);
    CHECK(best.describe().find("zero=1") != std::string::npos);
    for (const planner::Layout& l : report.ranked) {
      if (l.microbatches != best.microbatches) continue;
      CHECK(l.step_seconds == best.step_seconds);  // one gather per step: ZeRO-3 moves ZeRO-1's bytes
      CHECK(peak(l) >= peak(best));
    }
    const std::string text = planner::describe(report, uniform(8));
    CHECK_THAT(text, Catch::Contains("ZeRO-1 over 2 replicas, between steps: weights"));
    CHECK_THAT(text, Catch::Contains("as fast, a peak of"));
  }
  SECTION("bf16 storage over 4 replicas, under a cap only ZeRO-3 meets: its shard is the master copy") {
    // 4e5 parameters a worker. Within a step ZeRO-1 holds 2.4 MB of weights (bf16 and the fp32
    // master), 1.6 MB of gradients and 0.8 MB of AdamW state (4.8 MB); ZeRO-2 2.0 MB of gradients
    // (5.2 MB); ZeRO-3 1.2 MB of weights (the 2-byte stage and its 4-byte shard) and ZeRO-2's
    // gradients (4.0 MB). The cap lies between ZeRO-3 and the least of the others.
    planner::Request request = two_stages(uniform(8, 2, 4), {0, 1, 2, 3}, 8);
    planner::Request capped = request;
    const planner::Report all = plan(request);
    double others = 1e300, zero3 = 1e300;
    for (const planner::Layout& l : all.ranked) {
      const double most = *std::max_element(l.most_bytes.begin(), l.most_bytes.end());
      (l.zero == 3 ? zero3 : others) = std::min(l.zero == 3 ? zero3 : others, most);
    }
    REQUIRE(zero3 < others);
    // Each ZeRO stage priced is a layout of its own: the count the report prints adds up.
    CHECK(all.considered == all.ranked.size() + all.rejected.size());
    capped.memory_bytes = (others + zero3) / 2;
    capped.schedules = {"1f1b"};
    const planner::Report report = plan(capped);
    CHECK(report.considered == report.ranked.size() + report.rejected.size());
    CHECK_FALSE(report.rejected.empty());  // the layouts over the cap
    CHECK(report.best().zero == 3);
    for (const planner::Layout& l : report.ranked) CHECK(*std::max_element(l.most_bytes.begin(), l.most_bytes.end()) <= capped.memory_bytes);
    CHECK(report.best().resting_state_bytes[0].weights == Approx(4.0 * 4e5 / 4));  // the fp32 shard only
    // Without ZeRO-3 among the choices nothing fits that cap (the activations are bytes here).
    capped.zero_stages = {0, 1, 2};
    CHECK(plan(capped).ranked.empty());
  }
  SECTION("one replica runs without ZeRO, and stages outside 0 to 3 are refused") {
    planner::Request request = two_stages(uniform(8), {0, 1, 2, 3}, 2);
    for (const planner::Layout& l : plan(request).ranked) CHECK(l.zero == 0);
    request.zero_stages = {4};
    CHECK_THROWS_WITH(plan(request), Catch::Contains("ZeRO stages are 0 to 3 (PipelineOptions::zero), got 4"));
  }
}
