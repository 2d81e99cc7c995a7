// SPDX-License-Identifier: Apache-2.0
// A property over 1,000 random (schedule, p, V, m, batches, rows) configurations, m < p and
// microbatches of different lengths included (a batch's rows need not divide evenly): every
// configuration a policy accepts verifies, simulates and runs a step to completion on the host runtime,
// whose layers sleep (a hang aborts the binary through test::bounded's deadline), with the
// unpipelined model's gradients for the flush schedules; every refused one is refused with a sentence
// naming the offending number. A second property draws wider configurations for the schedule layer
// alone (p <= 16, V <= 4, m <= 64), where most refusals come from.
#include "pipeline_test_support.hpp"

#include "cupipe/planner/planner.hpp"

#include <random>
#include <string>
#include <utility>

namespace {

using namespace cupipe;
using test::Host;
using test::Knob;

/// Stage 0 holds the only weights (so W actions do real work), every stage sleeps.
template <class Seq>
struct sleeping_stages_impl;
template <std::size_t... I>
struct sleeping_stages_impl<std::index_sequence<I...>> {
  using type = StageList<Stage<Linear<4, 4>, Knob<0>>, Stage<Knob<int(I) + 1>>...>;
};
template <int N>
using SleepingStages = typename sleeping_stages_impl<std::make_index_sequence<std::size_t(N - 1)>>::type;

/// The policies the runtime property draws from: the library's, and Interleaved with 3 chunks.
using Drawn = schedule::extend<schedule::Policies, schedule::Interleaved<3>>;
constexpr int max_stages = 4;

struct Draw {
  int policy;  // index into Drawn
  int stages;
  int microbatches;
  int batches;
  int rows;  // of the step's batch: m x batches to 3 m x batches, so the microbatches are often ragged
};

/// Whether the runtime should accept the draw: restated from the documented rules, not taken from
/// the policy code under test. Flush schedules run one batch; PipeDream-2BW across batches needs
/// m >= p - 1 (a batch may not enter stage 0 before the version it runs on exists); DualPipeV needs
/// m >= 2p, as its reference does.
template <class Policy>
bool expected_accepted(const Draw& d) {
  if (d.microbatches < 1) return false;
  if (Policy::update == schedule::UpdateRule::flush && d.batches > 1) return false;
  if (Policy::name == "2bw" && d.batches > 1 && d.microbatches < d.stages - 1) return false;
  if (Policy::name == "dualpipev" && d.microbatches < 2 * d.stages) return false;  // two microbatches per stage
  return true;
}

struct Tally {
  int accepted = 0;
  int refused = 0;
  int below_p = 0;  // accepted with m < p
  int raced = 0;    // workers whose bounds differ: where a message lands depends on the timing
};

/// Each worker's measured activation peak lies within the bounds the planner proves for every
/// timing (planner::detail::activation_bounds), in bytes.
void check_bounds(const schedule::Plan& plan, const std::vector<planner::detail::ChunkSizes>& sizes, const StepStats& stats,
                  index_t batch_rows, Tally& tally) {
  pipeline::StepPlan split;  // the rows of each microbatch, as the runtime splits the batch
  pipeline::split_rows(split, batch_rows, plan.config.total_microbatches());
  const std::vector<double> rows(split.rows.begin(), split.rows.end());
  const planner::detail::ActivationBounds bounds = planner::detail::activation_bounds(plan, sizes, rows);
  REQUIRE(stats.peak_activation_bytes.size() == bounds.high.size());
  for (std::size_t w = 0; w < bounds.high.size(); ++w) {
    const double measured = double(stats.peak_activation_bytes[w]) / double(sizeof(double));
    INFO("worker " << w << ": measured " << measured << " values, bounds " << bounds.low[w] << " to " << bounds.high[w]);
    CHECK(measured >= bounds.low[w]);
    CHECK(measured <= bounds.high[w]);
    tally.raced += bounds.high[w] > bounds.low[w];
  }
}

template <class Policy, int P>
void run_draw(const Draw& d, std::uint64_t seed, Tally& tally) {
  using Stages = SleepingStages<P * Policy::chunks>;
  using Pipe = Pipeline<Stages, Policy, Host>;
  PipelineOptions options;
  options.microbatches = d.microbatches;
  options.batches = d.batches;
  options.seed = seed;
  INFO(Policy::name << " (" << Policy::chunks << " chunks) p = " << P << " m = " << d.microbatches
                    << " batches = " << d.batches << " seed = " << seed);
  if (!expected_accepted<Policy>(d)) {
    const std::string message = test::error_message([&] { Pipe refused(options); });
    CHECK(message.size() > 20);
    CHECK_THAT(message, Catch::Contains(std::to_string(d.microbatches < 1 ? d.microbatches : d.batches)));
    ++tally.refused;
    return;
  }
  Pipe pipe(options);
  ++tally.accepted;
  if (d.microbatches < P) ++tally.below_p;
  const schedule::Plan& plan = pipe.plan();
  const schedule::VerifyResult verified = schedule::verify(plan);
  INFO(verified.message());
  REQUIRE(static_cast<bool>(verified));
  const schedule::SimResult simulated = schedule::simulate(plan, schedule::Costs{1, 1, 1});
  CHECK(simulated.makespan > 0);

  const auto rows = index_t(d.rows);
  const test::Batch batch = test::make_batch(rows, 4, 4, seed);
  std::size_t planned = 0;
  for (const auto& list : plan.actions) planned += list.size();
  if constexpr (Policy::update == schedule::UpdateRule::flush) {
    const StepStats stats = test::bounded(60, [&] { return pipe.forward_backward(batch.inputs(), batch.targets()); });
    CHECK(stats.actions.size() == planned);
    Network<typename Stages::model, Host> net(seed);
    const double loss = net.forward_backward(batch.inputs(), batch.targets());
    CHECK(std::abs(stats.loss - loss) <= 1e-12 * std::abs(loss));
    CHECK(test::relative_difference(pipe.gradients(), net.gradients()) <= 1e-12);
    check_bounds(plan, planner::detail::stage_chunk_sizes<Stages>(), stats, rows, tally);
  } else {
    const StepStats stats =
        test::bounded(60, [&] { return pipe.train_step(batch.inputs(), batch.targets(), optim::SGD({.lr = 0.1})); });
    CHECK(stats.actions.size() == planned);
    CHECK(std::isfinite(stats.loss));
    check_bounds(plan, planner::detail::stage_chunk_sizes<Stages>(), stats, rows, tally);
  }
}

/// Calls run_draw for the drawn policy and stage count.
void dispatch(const Draw& d, std::uint64_t seed, Tally& tally) {
  int index = 0;
  schedule::for_each_policy<Drawn>([&]<class Policy>() {
    if (index++ != d.policy) return;
    [&]<int... P>(std::integer_sequence<int, P...>) {
      ((d.stages == P + 1 ? run_draw<Policy, P + 1>(d, seed, tally) : void()), ...);
    }(std::make_integer_sequence<int, max_stages>());
  });
}

}  // namespace

TEST_CASE("1,000 random (schedule, p, V, m, batches): accepted ones verify, simulate and run, refused ones say why",
          "[pipeline][property]") {
  constexpr std::uint64_t seed = 20261124;
  std::mt19937_64 rng(seed);
  auto uniform = [&](int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng); };
  // Every action sleeps 0-40 us, drawn anew for each configuration: long enough for workers to
  // interleave, short enough for 1,000 steps, and uneven, so that messages land at different
  // points of their receivers' work (each worker's activation peak must stay within the bounds
  // the planner proves for every timing).
  test::reset_knobs();
  Tally tally;
  for (int i = 0; i < 1000; ++i) {
    for (auto& k : test::knobs) {
      k.forward_us = uniform(0, 40);
      k.backward_us = uniform(0, 40);
    }
    // m up to 12, a third of the time at most p (m < p is where warm-ups get cut short), now and
    // then 0 (refused); batches above 1 a quarter of the time (refused by the flush policies).
    const int policy = uniform(0, int(Drawn::size) - 1), p = uniform(1, max_stages);
    const int m = i % 50 == 0 ? 0 : uniform(1, uniform(0, 2) == 0 ? p : 12);
    const int batches = uniform(0, 3) == 0 ? uniform(2, 3) : 1, total = std::max(m, 1) * batches;
    // Rows from one per microbatch to three: microbatches of different lengths, whose receivers
    // must expect each one's own size (a size they do not expect is an error, never a hang).
    const Draw d{policy, p, m, batches, uniform(total, 3 * total)};
    dispatch(d, seed + std::uint64_t(i), tally);
  }
  test::reset_knobs();
  INFO("accepted " << tally.accepted << ", refused " << tally.refused << ", m < p " << tally.below_p << ", workers that race "
                    << tally.raced);
  CHECK(tally.accepted + tally.refused == 1000);
  CHECK(tally.raced >= 100);
  CHECK(tally.accepted >= 700);
  CHECK(tally.refused >= 50);
  CHECK(tally.below_p >= 100);
}

TEST_CASE("random schedule configurations up to p = 16, V = 4, m = 64: a plan that verifies, or a sentence",
          "[pipeline][property]") {
  std::mt19937_64 rng(7);
  auto uniform = [&](int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng); };
  const auto policies = schedule::policy_table();
  int accepted = 0, refused = 0;
  for (int i = 0; i < 2000; ++i) {
    const schedule::PolicyInfo& policy = policies[std::size_t(uniform(0, int(policies.size()) - 1))];
    const schedule::Config c{uniform(1, 16), uniform(1, 64), uniform(1, 4), uniform(1, 3)};
    INFO(policy.name << " p = " << c.stages << " m = " << c.microbatches << " V = " << c.chunks << " batches = " << c.batches);
    const std::string_view why = policy.check(c);
    if (!why.empty()) {
      ++refused;
      CHECK(why.size() > 20);
      CHECK_THROWS_WITH(policy.generate(c), Catch::Contains(std::string(why)) && Catch::Contains(std::string(policy.name)));
      continue;
    }
    ++accepted;
    const schedule::Plan plan = policy.generate(c);
    const schedule::VerifyResult verified = schedule::verify(plan);
    INFO(verified.message());
    REQUIRE(static_cast<bool>(verified));
    CHECK(schedule::simulate(plan, schedule::Costs{1, 2, 1}).makespan > 0);
  }
  CHECK(accepted >= 250);
  CHECK(refused >= 250);
}
