// SPDX-License-Identifier: Apache-2.0
// Activation offload plans (schedule/offload.hpp): every record that leaves comes back once, before
// its own backward; what stays resident keeps the cap; and the simulator charges the copies.
#include <catch2/catch.hpp>

#include <algorithm>
#include <random>

#include "cupipe/schedule/schedule.hpp"

namespace sch = cupipe::schedule;

namespace {

std::vector<int> every_stage(const sch::Plan& plan) {
  std::vector<int> all(std::size_t(plan.config.virtual_stages()));
  for (int k = 0; k < int(all.size()); ++k) all[std::size_t(k)] = k;
  return all;
}

/// Replays the moves: a record leaves only after its forward and before its backward, comes back at
/// its backward exactly once, and is never out twice.
void check_moves(const sch::Plan& plan, const sch::OffloadPlan& offload) {
  for (std::size_t w = 0; w < plan.actions.size(); ++w) {
    std::vector<std::pair<int, int>> out;  // (virtual stage, microbatch)
    std::vector<std::pair<int, int>> forwarded;
    int sent = 0;
    for (std::size_t i = 0; i < plan.actions[w].size(); ++i) {
      const sch::Action& a = plan.actions[w][i];
      const std::pair<int, int> self{plan.virtual_stage(int(w), a), a.microbatch};
      if (a.kind == sch::ActionKind::F) forwarded.push_back(self);
      const auto away = std::find(out.begin(), out.end(), self);
      if (a.kind == sch::ActionKind::B) {
        CHECK((away != out.end()) == (offload.back_before[w][i] != 0));  // back exactly when out
        if (away != out.end()) out.erase(away);
      } else {
        CHECK(offload.back_before[w][i] == 0);
      }
      for (const sch::OffloadMove& move : offload.out_after[w][i]) {
        const std::pair<int, int> record{move.virtual_stage, move.microbatch};
        CHECK(std::find(forwarded.begin(), forwarded.end(), record) != forwarded.end());
        CHECK(std::find(out.begin(), out.end(), record) == out.end());
        out.push_back(record);
        ++sent;
      }
    }
    CHECK(out.empty());  // everything came back
    CHECK(sent == offload.moves[w]);
  }
}

}  // namespace

TEST_CASE("1F1B's first stage keeps two records resident instead of p when it offloads", "[schedule][offload]") {
  const sch::Plan plan = sch::generate<sch::OneFOneB>(sch::Config{4, 8, 1, 1});
  const sch::OffloadPlan offload = sch::plan_offload(plan, every_stage(plan), 1);
  check_moves(plan, offload);
  CHECK(sch::peak_activations(plan) == std::vector<int>{4, 3, 2, 1});
  // A forward holds its own record and the one that stays; a backward brings its own back beside it.
  CHECK(offload.peak_resident == std::vector<int>{2, 2, 2, 1});
  CHECK(offload.moves[0] > 0);
  CHECK(offload.moves[3] == 0);  // the last stage's backward follows its forward at once
  // A cap at the schedule's own peak moves nothing.
  const sch::OffloadPlan loose = sch::plan_offload(plan, every_stage(plan), 4);
  CHECK(loose.moves == std::vector<int>{0, 0, 0, 0});
  CHECK(loose.peak_resident == sch::peak_activations(plan));
  // Only the named stages move.
  const sch::OffloadPlan first = sch::plan_offload(plan, {0}, 1);
  CHECK(first.moves[0] == offload.moves[0]);
  CHECK(first.moves[1] == 0);
  CHECK(sch::plan_offload(plan, {}, 1).empty());
  CHECK_THROWS_WITH(sch::plan_offload(plan, {4}, 1), Catch::Contains("offload: virtual stage 4 is not one of the plan's 4"));
  CHECK_THROWS_WITH(sch::plan_offload(plan, {0}, 0), Catch::Contains("at least 1 record per stage, got 0"));
}

TEST_CASE("offload plans of every policy move each record out and back once, under the cap", "[schedule][offload]") {
  std::mt19937 rng(20261203);
  int checked = 0;
  for (const sch::PolicyInfo& policy : sch::policy_table()) {
    for (int draw = 0; draw < 12; ++draw) {
      const int p = 1 + int(rng() % 6), m = 1 + int(rng() % 12), resident = 1 + int(rng() % 3);
      const sch::Config c{p, m, policy.default_chunks, policy.default_batches};
      if (!policy.check(c).empty()) continue;
      const sch::Plan plan = policy.generate(c);
      INFO(policy.name << " p = " << p << " m = " << m << " resident = " << resident);
      const sch::OffloadPlan offload = sch::plan_offload(plan, every_stage(plan), resident);
      check_moves(plan, offload);
      const std::vector<int> held = sch::peak_activations(plan);
      for (std::size_t w = 0; w < held.size(); ++w) {
        CHECK(offload.peak_resident[w] <= held[w]);
        // Without a split backward every record can leave: each virtual stage holds at most its cap,
        // and the running action one more.
        if (!plan.split_backward) CHECK(offload.peak_resident[w] <= c.chunks * resident + 1);
      }
      ++checked;
    }
  }
  CHECK(checked > 50);
}

TEST_CASE("the simulator charges each moved record's copies to the actions that make them", "[schedule][offload]") {
  const sch::Plan plan = sch::generate<sch::GPipe>(sch::Config{4, 8, 1, 1});
  const sch::OffloadPlan offload = sch::plan_offload(plan, every_stage(plan), 2);
  sch::Costs costs{.forward = 1, .backward = 2};
  costs.offload = 0.25;
  const sch::SimResult plain = sch::simulate(plan, costs), moved = sch::simulate(plan, costs, &offload);
  for (std::size_t w = 0; w < plan.actions.size(); ++w) {
    CHECK(moved.busy[w] == Approx(plain.busy[w] + 2 * offload.moves[w] * costs.offload));  // out and back
    CHECK(moved.peak_activations[w] == offload.peak_resident[w]);
    CHECK(moved.peak_activations[w] < plain.peak_activations[w]);
  }
  CHECK(moved.makespan > plain.makespan);
  costs.offload = 0;  // free copies: the same timing, less memory
  CHECK(sch::simulate(plan, costs, &offload).makespan == plain.makespan);
}
