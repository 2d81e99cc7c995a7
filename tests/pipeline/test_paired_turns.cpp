// SPDX-License-Identifier: Apache-2.0
// PairedTurns (pipeline/paired_turns.hpp): two actions take turns on two threads, handing the turn
// over only where one calls comm::let_partner_run(), the first action first, on a thread kept from
// pair to pair; one that throws ends its turns and the other runs on; take_turns gives each action
// its own context fields.
#include "cupipe/pipeline/paired_turns.hpp"

#include <catch2/catch.hpp>

#include <stdexcept>
#include <string>
#include <thread>

#include "cupipe/backend/host/host.hpp"
#include "cupipe/comm/turns.hpp"

namespace {

using cupipe::comm::let_partner_run;
using cupipe::pipeline::PairedTurns;

/// An ExpertGroup that only has a name (take_turns swaps the pointers; nothing is sent).
struct NamedGroup final : cupipe::moe::ExpertGroup {
  explicit NamedGroup(const char* n) : name_(n) {}
  int size() const override { return 2; }
  int rank() const override { return 0; }
  void sum(float*, std::size_t) override {}
  void sum(double*, std::size_t) override {}
  int holders() const override { return 1; }
  void sum_over_holders(float*, std::size_t) override {}
  void sum_over_holders(double*, std::size_t) override {}
  void exchange_counts(const std::int64_t*, std::int64_t*, std::size_t) override {}
  void start_all_to_all(const float*, const std::int64_t*, float*, const std::int64_t*) override {}
  void start_all_to_all(const double*, const std::int64_t*, double*, const std::int64_t*) override {}
  void finish_all_to_all() override {}
  const char* name() const override { return name_; }
  const char* name_;
};

TEST_CASE("paired turns: the first action first, the turn handed over only where one lets its partner run",
          "[pipeline][turns]") {
  std::string order;
  std::thread::id f_thread, b_thread;
  bool f_ran_beside = false, b_ran_beside = false, b_after_f_ended = true;
  PairedTurns turns;
  const auto errors = turns.run(
      [&] {
        f_thread = std::this_thread::get_id();
        order += "f1 ";
        f_ran_beside = let_partner_run();  // the F's all-to-all is in flight: the B runs
        order += "f2 ";
        order += "f3 ";  // no hand-over: the F goes on
      },
      [&] {
        b_thread = std::this_thread::get_id();
        order += "b1 ";
        b_ran_beside = let_partner_run();  // back to the F, which runs to its end
        order += "b2 ";
        b_after_f_ended = !let_partner_run();  // the F has ended: nothing to hand over
      },
      [](int) {}, [](int) {});
  CHECK(!errors[0]);
  CHECK(!errors[1]);
  CHECK(order == "f1 b1 f2 f3 b2 ");
  CHECK(f_ran_beside);
  CHECK(b_ran_beside);
  CHECK(b_after_f_ended);
  CHECK(f_thread != b_thread);
  CHECK(b_thread == std::this_thread::get_id());  // the B on the caller's thread, the F on its own
  CHECK(turns.hand_overs() == 2);
  CHECK(!let_partner_run());  // outside a pair: nothing to hand over
  // The next pair's F runs on the same thread (one kept for the object's life, not one per pair).
  std::thread::id again;
  turns.run([&] { again = std::this_thread::get_id(); }, [] {}, [](int) {}, [](int) {});
  CHECK(again == f_thread);
}

TEST_CASE("paired turns: an action that throws ends its turns, and the other runs to its end", "[pipeline][turns]") {
  std::string order;
  PairedTurns turns;
  const auto errors = turns.run(
      [&] {
        order += "f1 ";
        let_partner_run();
        throw std::runtime_error("F failed");
      },
      [&] {
        order += "b1 ";
        let_partner_run();
        order += "b2 ";
        let_partner_run();
        order += "b3 ";
      },
      [](int) {}, [](int) {});
  CHECK(order == "f1 b1 b2 b3 ");
  REQUIRE(errors[0]);
  CHECK_THROWS_WITH(std::rethrow_exception(errors[0]), "F failed");
  CHECK(!errors[1]);
}

TEST_CASE("paired turns: each action keeps its own document borders, normalizer and expert group", "[pipeline][turns]") {
  cupipe::backend::Host<double> be;
  NamedGroup own("own"), paired("paired");
  be.expert_group = &own;
  be.paired_expert_group = &paired;
  REQUIRE(cupipe::pipeline::takes_turns(be));
  std::string seen;
  PairedTurns turns;
  const auto errors = cupipe::pipeline::take_turns(
      be, turns,
      [&] {
        seen += std::string(be.expert_group->name()) + " ";
        be.aux_loss_normalizer = 5;
        let_partner_run();
        seen += std::string(be.expert_group->name()) + " " + std::to_string(be.aux_loss_normalizer) + " ";
      },
      [&] {
        seen += std::string(be.expert_group->name()) + " " + std::to_string(be.aux_loss_normalizer) + " ";
        be.aux_loss_normalizer = 7;
        let_partner_run();
        seen += std::to_string(be.aux_loss_normalizer);
      });
  CHECK(!errors[0]);
  CHECK(!errors[1]);
  CHECK(seen == "paired own 0 paired 5 7");
  CHECK(be.expert_group == &own);  // as before the pair
  CHECK(be.aux_loss_normalizer == 0);
  be.paired_expert_group = nullptr;
  CHECK(!cupipe::pipeline::takes_turns(be));
}

}  // namespace
