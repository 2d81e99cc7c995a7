// SPDX-License-Identifier: Apache-2.0
// Compile-time checks, broken plans caught by verify, run-time dispatch and timelines.
#include <catch2/catch.hpp>

#include <string>

#include "cupipe/schedule/schedule.hpp"

namespace sch = cupipe::schedule;
using sch::ActionKind;

// verify and simulate are constant expressions, so a trainer can check its configuration.
static_assert(sch::verify<sch::GPipe>(3, 4));
static_assert(sch::verify<sch::OneFOneB>(3, 8));
static_assert(sch::verify<sch::Interleaved<2>>(2, 4));
static_assert(sch::verify<sch::PipeDream>(3, 4));
static_assert(sch::verify<sch::PipeDream2BW>(3, 3));
static_assert(sch::verify<sch::ZeroBubbleH1>(3, 6));
static_assert(sch::verify<sch::ZeroBubbleH2>(3, 6));
static_assert(sch::verify<sch::Interleaved<2>>(3, 7));  // a short last group: the plan of m = 9 without 7 and 8
static_assert(sch::verify<sch::ZeroBubbleV>(4, 8));
static_assert(sch::verify<sch::BreadthFirst<2>>(4, 8));
static_assert(sch::verify<sch::DualPipeV>(4, 8));
// 2m chunk (F+B+W) = 32, plus the published (PP/2-1)(F&B+B-3W) = 3 x (2 + 1 - 1.5), met at F = B + W.
static_assert(sch::simulate<sch::DualPipeV>(4, 8, sch::Costs{2, 1, 1}).makespan == 36.5);
static_assert(sch::simulate<sch::ZeroBubbleV>(4, 8, sch::Costs{1, 1, 1}).makespan == 25.5);  // 24 + (p-1) F/2
static_assert(sch::simulate<sch::OneFOneB>(4, 8, sch::Costs{1, 2}).makespan == 33);
static_assert(sch::simulate<sch::ZeroBubbleH1>(4, 8, sch::Costs{1, 1, 1}).makespan == 27);
static_assert(sch::weight_versions(sch::generate<sch::PipeDream2BW>({3, 4, 1, 3})) == std::vector<int>{2, 2, 2});
static_assert(sch::StaticSchedule<sch::OneFOneB, 4, 8>::plan().actions.size() == 4);

namespace {

/// Swaps two actions of one stage.
sch::Plan swapped(sch::Plan plan, int stage, int first, int second) {
  std::swap(plan.actions[stage][first], plan.actions[stage][second]);
  return plan;
}

int index_of(const sch::Plan& plan, int stage, sch::Action action) {
  const auto& list = plan.actions[stage];
  return static_cast<int>(std::find(list.begin(), list.end(), action) - list.begin());
}

}  // namespace

TEST_CASE("verify names both actions of a swap that breaks a plan", "[schedule][verify]") {
  const sch::Plan plan = sch::generate<sch::OneFOneB>({4, 8});
  REQUIRE(sch::verify(plan));

  SECTION("B before its own F") {
    const auto broken = swapped(plan, 1, index_of(plan, 1, {ActionKind::F, 3, 0}), index_of(plan, 1, {ActionKind::B, 3, 0}));
    const auto result = sch::verify(broken);
    REQUIRE_FALSE(result);
    const std::string message(result.message());
    CHECK(message.find("worker 1") != std::string::npos);
    CHECK(message.find("B3") != std::string::npos);
    CHECK(message.find("F3") != std::string::npos);
  }
  SECTION("two backwards out of order deadlock once sends block") {
    const auto broken = swapped(plan, 1, index_of(plan, 1, {ActionKind::B, 2, 0}), index_of(plan, 1, {ActionKind::B, 3, 0}));
    const auto result = sch::verify(broken);
    REQUIRE_FALSE(result);
    const std::string message(result.message());
    INFO(message);
    CHECK(message.find("deadlock") != std::string::npos);
    CHECK(message.find("B2") != std::string::npos);
    CHECK(message.find("B3") != std::string::npos);
  }
  SECTION("a forward ahead of its input is a dependency cycle") {
    // Stage 2 runs B0 before F0: B0 waits on stage 3, which waits for F0 from stage 2.
    auto broken = plan;
    auto& list = broken.actions[2];
    list.erase(list.begin() + index_of(plan, 2, {ActionKind::B, 0, 0}));
    list.insert(list.begin(), sch::Action{ActionKind::B, 0, 0});
    const auto result = sch::verify(broken);
    REQUIRE_FALSE(result);
    CHECK(std::string(result.message()).find("B0 comes before F0") != std::string::npos);
  }
  SECTION("missing, duplicated and foreign actions") {
    auto missing = plan;
    missing.actions[0].pop_back();
    CHECK(std::string(sch::verify(missing).message()).find("is missing") != std::string::npos);
    auto twice = plan;
    twice.actions[0].push_back(twice.actions[0].front());
    CHECK(std::string(sch::verify(twice).message()).find("appears twice") != std::string::npos);
    auto weight = plan;
    weight.actions[0].push_back({ActionKind::W, 0, 0});
    CHECK(std::string(sch::verify(weight).message()).find("not split") != std::string::npos);
  }
  SECTION("cross-stage dependency that can never be met") {
    // Stage 0 waits for B7 before sending F7, which B7 needs: a cycle through stage 3.
    auto broken = plan;
    auto& list = broken.actions[0];
    const auto f7 = list.begin() + index_of(plan, 0, {ActionKind::F, 7, 0});
    list.erase(f7);
    list.insert(list.end(), sch::Action{ActionKind::F, 7, 0});
    const auto result = sch::verify(broken);
    REQUIRE_FALSE(result);
    CHECK(std::string(result.message()).find("B7") != std::string::npos);
  }
  CHECK_THROWS_WITH(sch::simulate(swapped(plan, 1, index_of(plan, 1, {ActionKind::B, 2, 0}),
                                          index_of(plan, 1, {ActionKind::F, 2, 0})),
                                  sch::Costs{}),
                    Catch::Contains("cannot run"));
}

TEST_CASE("policies dispatch by name and reject bad configurations with a sentence", "[schedule][dispatch]") {
  CHECK(sch::find_policy("gpipe").generate({2, 3}).actions == sch::generate<sch::GPipe>({2, 3}).actions);
  CHECK(sch::find_policy("2bw").update == sch::UpdateRule::double_buffered);
  CHECK(sch::find_policy("zb-h2").split_backward);
  CHECK_THROWS_WITH(sch::find_policy("3f3b"), Catch::Contains("expected one of: gpipe, 1f1b, interleaved"));
  CHECK(sch::policy_names() == "gpipe, 1f1b, interleaved, bfs, pipedream, 2bw, zb-h1, zb-h2, zbv, v-half, v-min, dualpipev");
  for (const auto& policy : sch::policy_table()) {
    CHECK(sch::find_policy(policy.name).name == policy.name);
    CHECK(sch::with_policy(policy.name, []<class P>() { return std::string(P::name); }) == policy.name);
    CHECK_THROWS_WITH(policy.generate({0, 4, policy.default_chunks}), Catch::Contains("at least 1 stage"));
    CHECK_THROWS_WITH(policy.generate({2, 0, policy.default_chunks}), Catch::Contains("at least 1 microbatch"));
  }
  CHECK_THROWS_WITH(sch::generate("gpipe", {2, 4, 2}), Catch::Contains("chunks must be 1"));
  CHECK_THROWS_WITH(sch::generate("gpipe", {2, 4, 1, 2}), Catch::Contains("batches must be 1"));
  CHECK_THROWS_WITH(sch::generate("interleaved", {2, 4, 1}), Catch::Contains("at least 2 chunks"));
  CHECK(sch::generate<sch::OneFOneB>({3, 5}).actions == sch::generate("1f1b", {3, 5}).actions);
}

TEST_CASE("plans follow the policies' definitions", "[schedule][policies]") {
  const auto gpipe = sch::generate<sch::GPipe>({2, 2});
  CHECK(gpipe.actions[0] == std::vector<sch::Action>{{ActionKind::F, 0, 0}, {ActionKind::F, 1, 0}, {ActionKind::B, 0, 0}, {ActionKind::B, 1, 0}});
  const auto one = sch::generate<sch::OneFOneB>({3, 4});
  CHECK(one.actions[0] == std::vector<sch::Action>{{ActionKind::F, 0, 0}, {ActionKind::F, 1, 0}, {ActionKind::F, 2, 0},
                                                   {ActionKind::B, 0, 0}, {ActionKind::F, 3, 0}, {ActionKind::B, 1, 0},
                                                   {ActionKind::B, 2, 0}, {ActionKind::B, 3, 0}});
  CHECK(one.actions[2].front() == sch::Action{ActionKind::F, 0, 0});
  CHECK(one.actions[2][1] == sch::Action{ActionKind::B, 0, 0});
  const auto interleaved = sch::generate<sch::Interleaved<2>>({2, 4, 2});
  // Stage 1, chunk 0 is virtual stage 1; the first B belongs to the last virtual stage (chunk 1).
  CHECK(interleaved.placement.virtual_stage(1, 1) == 3);
  CHECK(interleaved.placement.worker_of(3) == 1);
  const auto& last = interleaved.actions[1];
  CHECK(std::find(last.begin(), last.end(), sch::Action{ActionKind::B, 0, 1}) < std::find(last.begin(), last.end(), sch::Action{ActionKind::B, 0, 0}));
  const auto pd = sch::generate<sch::PipeDream>({2, 3, 1, 2});
  CHECK(pd.actions[0].size() == 12);  // 6 microbatches across 2 batches, no flush
  CHECK(pd.update == sch::UpdateRule::per_microbatch);
  CHECK(sch::generate<sch::ZeroBubbleH1>({2, 2}).split_backward);
}

TEST_CASE("ASCII timeline and Chrome trace of a simulated plan", "[schedule][timeline]") {
  const sch::Plan plan = sch::generate<sch::OneFOneB>({2, 2});
  const auto sim = sch::simulate(plan, sch::Costs{1, 2});
  const auto events = sch::timeline_events(plan, sim);
  REQUIRE(events.size() == 8);
  const std::string chart = sch::ascii_timeline(events, 2);
  INFO(chart);
  CHECK(chart.find("worker 0| F0 F1 .  .  B0 ~~ .  B1 ~~\n") != std::string::npos);
  CHECK(chart.find("worker 1| .  F0 B0 ~~ F1 B1 ~~ .  .\n") != std::string::npos);
  CHECK(chart.find("legend") != std::string::npos);

  const std::vector<sch::TraceGroup> groups{{"measured \"run\"", events, 1e6}, {"simulated (predicted)", events, 1e3}};
  const std::string json = sch::chrome_trace_json(groups);
  CHECK(json.find(R"j("name":"measured \"run\"")j") != std::string::npos);
  CHECK(json.find(R"j("name":"simulated (predicted)")j") != std::string::npos);
  CHECK(json.find(R"j({"name":"thread_name","ph":"M","pid":2,"tid":1,"args":{"name":"worker 1"}})j") != std::string::npos);
  CHECK(json.find(R"j("ph":"X","pid":1,"tid":0,"ts":4000000.000000,"dur":2000000.000000,"args":{"microbatch":0,"chunk":0})j") !=
        std::string::npos);
  CHECK(sch::json_escape("a\\b\n\x01") == "a\\\\b\\n\\u0001");
}

namespace {

/// Costs of F 2, B 1, W 1 per stage (DualPipeV's published case), with all-to-alls of `a2a` per F and per B.
sch::Costs with_all_to_all(double a2a) {
  sch::Costs c{2, 1, 1};
  c.all_to_all = a2a;
  return c;
}

}  // namespace

TEST_CASE("simulate: an all-to-all is exposed in an action alone, hidden by an overlapped F&B pair's compute",
          "[schedule][simulate][moe]") {
  // 1F1B: every F and B waits for its all-to-alls, 8 microbatches x (F + B) x 0.5 per stage.
  const sch::SimResult one = sch::simulate<sch::OneFOneB>(4, 8, [] {
    sch::Costs c{1, 2};
    c.all_to_all = 0.5;
    return c;
  }());
  for (double exposed : one.exposed_communication) CHECK(exposed == 8.0);
  CHECK(one.total_exposed_communication() == 32.0);
  CHECK(one.makespan > sch::simulate<sch::OneFOneB>(4, 8, sch::Costs{1, 2}).makespan);

  // DualPipeV: a pair's 0.25 + 0.25 hide behind its compute; the actions alone (warm-up, cool-down)
  // expose theirs. Taken apart, every pair exposes its all-to-alls too.
  const sch::Plan plan = sch::generate<sch::DualPipeV>({4, 8, 2, 1});
  const sch::SimResult paired = sch::simulate(plan, with_all_to_all(0.5));
  const sch::SimResult apart = sch::simulate(sch::without_pairs(plan), with_all_to_all(0.5));
  int pairs = 0, alone = 0;
  for (const auto& list : plan.actions)
    for (std::size_t i = 0; i < list.size(); ++i) {
      if (list[i].overlap) ++pairs;
      else if (list[i].kind != ActionKind::W && (i == 0 || !list[i - 1].overlap)) ++alone;
    }
  REQUIRE(pairs > 0);
  CHECK(paired.total_exposed_communication() == Approx(0.25 * alone));  // a chunk's share: 0.5 / 2
  CHECK(apart.total_exposed_communication() == Approx(0.25 * (alone + 2 * pairs)));
  CHECK(paired.makespan < apart.makespan);
  // Without all-to-alls the pairing changes nothing: the published makespan.
  CHECK(sch::simulate(plan, with_all_to_all(0)).makespan == 36.5);
  CHECK(sch::simulate(plan, with_all_to_all(0)).total_exposed_communication() == 0);
  // Communication longer than the pair's compute shows through: a chunk's F 1 + B 0.5 against 2 + 2 of all-to-all.
  const sch::SimResult heavy = sch::simulate(plan, with_all_to_all(4));
  CHECK(heavy.total_exposed_communication() == Approx(2.0 * alone + (4.0 - 1.5) * pairs));
}
