// SPDX-License-Identifier: Apache-2.0
// The seams of the runtime: a step plan computed without threads, and a schedule policy written
// outside the library (a V-shaped placement) that verify, simulate, the explorer's registry and the
// runtime all accept, with the unpipelined Network's gradients.
#include <catch2/catch.hpp>

#include <sstream>

#include "explorer.hpp"
#include "pipeline_test_support.hpp"

using namespace cupipe;
using test::Batch;
using test::Host;

namespace {

/// GPipe over a V: worker w holds virtual stages w and 2p-1-w; every forward of chunk 0, then of
/// chunk 1, then the backwards in reverse.
struct VGPipe {
  static constexpr std::string_view name = "v-gpipe";
  static constexpr std::string_view summary = "a test policy: GPipe on the V-shaped placement";
  static constexpr bool split_backward = false;
  static constexpr schedule::UpdateRule update = schedule::UpdateRule::flush;
  static constexpr int chunks = 2;
  static constexpr int default_batches = 1;
  static constexpr std::string_view check(const schedule::Config& c) {
    return c.chunks != 2 ? "v-gpipe runs exactly 2 chunks per worker" : "";
  }
  static constexpr schedule::Placement placement(const schedule::Config& c) { return schedule::v_shape_placement(c.stages); }
  static constexpr std::vector<std::vector<schedule::Action>> actions(const schedule::Config& c) {
    using schedule::ActionKind;
    std::vector<std::vector<schedule::Action>> out(static_cast<std::size_t>(c.stages));
    for (auto& list : out) {
      for (int chunk : {0, 1})
        for (int j = 0; j < c.microbatches; ++j) list.push_back({ActionKind::F, j, chunk});
      for (int chunk : {1, 0})
        for (int j = 0; j < c.microbatches; ++j) list.push_back({ActionKind::B, j, chunk});
    }
    return out;
  }
};
static_assert(schedule::SchedulePolicy<VGPipe>);
static_assert(schedule::verify<VGPipe>(3, 4));

using Mine = schedule::extend<schedule::Policies, VGPipe>;
using Deep = Sequential<Linear<6, 8>, ReLU, Linear<8, 8>, ReLU, Linear<8, 8>, ReLU, Linear<8, 8>, ReLU, Linear<8, 8>,
                        ReLU, Linear<8, 8>, ReLU, Linear<8, 8>, ReLU, Linear<8, 4>>;

}  // namespace

TEST_CASE("a step plan splits any n >= m into microbatches that differ by at most one row", "[pipeline][step_plan]") {
  const schedule::Plan one_f_one_b = schedule::generate<schedule::OneFOneB>({4, 8});
  const std::vector<int> offsets = schedule::detail::microbatch_versions(one_f_one_b);
  const pipeline::StepPlan p = pipeline::make_step_plan(one_f_one_b, offsets, 13, 5, 0);
  CHECK(p.rows == std::vector<index_t>{2, 2, 2, 2, 2, 1, 1, 1});
  CHECK(p.first == std::vector<index_t>{0, 2, 4, 6, 8, 10, 11, 12});
  CHECK(p.normalizer == std::vector<index_t>(8, 13));  // flush: every loss is a share of the batch mean
  CHECK(p.version == std::vector<int>(8, 5));
  for (index_t n = 8; n < 60; ++n) {
    const pipeline::StepPlan q = pipeline::make_step_plan(one_f_one_b, offsets, n, 0, 0);
    const auto [low, high] = std::minmax_element(q.rows.begin(), q.rows.end());
    REQUIRE(*low >= 1);
    REQUIRE(*high - *low <= 1);
    REQUIRE(q.first.back() + q.rows.back() == n);
  }
  CHECK_THROWS_WITH(pipeline::make_step_plan(one_f_one_b, offsets, 7, 0, 0),
                    Catch::Contains("a batch of 7 samples cannot be split into 8 microbatches"));

  // 2BW: batch t of the step runs on max(t - 1, 0) counted over every batch so far; normalizers are per batch.
  const schedule::Plan two_bw = schedule::generate<schedule::PipeDream2BW>({2, 2, 1, 3});
  const pipeline::StepPlan b = pipeline::make_step_plan(two_bw, schedule::detail::microbatch_versions(two_bw), 12, 0, 3);
  CHECK(b.version == std::vector<int>{2, 2, 3, 3, 4, 4});
  CHECK(b.normalizer == std::vector<index_t>(6, 4));
  // PipeDream: each microbatch is its own update; versions follow the updates before its entry.
  const schedule::Plan pd = schedule::generate<schedule::PipeDream>({2, 2, 1, 2});
  const pipeline::StepPlan d = pipeline::make_step_plan(pd, schedule::detail::microbatch_versions(pd), 8, 10, 0);
  CHECK(d.normalizer == std::vector<index_t>(4, 2));
  CHECK(d.version == std::vector<int>{10, 10, 11, 12});
}

TEST_CASE("a policy defined outside the library runs through verify, simulate, the registry and the runtime",
          "[pipeline][policy]") {
  const schedule::Plan plan = schedule::generate<VGPipe>({3, 4, 2});
  CHECK(plan.placement.worker_of(0) == 0);
  CHECK(plan.placement.worker_of(5) == 0);  // the last virtual stage sits beside the first
  CHECK(plan.placement.worker_of(3) == 2);
  CHECK(schedule::verify(plan));
  const schedule::SimResult sim = schedule::simulate(plan, schedule::Costs{1, 2});
  CHECK(sim.makespan > 0);
  CHECK(sim.peak_activations == std::vector<int>(3, 8));  // 4 microbatches x 2 chunks held on every worker

  // The registry and the explorer take the extended list.
  CHECK(schedule::policy_names<Mine>().ends_with(", zb-h2, zbv, v-gpipe"));
  CHECK(schedule::find_policy<Mine>("v-gpipe").default_chunks == 2);
  CHECK_THROWS_WITH(schedule::find_policy("v-gpipe"), Catch::Contains("unknown schedule 'v-gpipe'"));
  explorer::Options o;
  o.schedule = "v-gpipe";
  o.stages = 3;
  o.microbatches = 4;
  o.json = true;
  std::ostringstream captured;
  std::streambuf* old = std::cout.rdbuf(captured.rdbuf());
  const int rc = explorer::explore<Mine>(o);
  std::cout.rdbuf(old);
  CHECK(rc == 0);
  CHECK_THAT(captured.str(), Catch::Contains("\"schedule\":\"v-gpipe\"") && Catch::Contains("\"chunks\":2"));

  // The runtime: 8 virtual stages on 4 workers in a V equal the unpipelined Network.
  using Stages = partition<Deep, 8>;
  using Pipe = Pipeline<Stages, VGPipe, Host>;
  static_assert(Pipe::stages == 4);
  STATIC_REQUIRE(Pipe::worker_of(7) == 0);
  STATIC_REQUIRE(Pipe::worker_of(4) == 3);
  for (int m : {1, 3, 4}) {
    INFO("m = " << m);
    Pipe pipe({.microbatches = m, .seed = 11});
    Network<Deep, Host> whole(11);
    const Batch b = test::make_batch(10, 6, 4, 90 + m);
    const StepStats s = pipe.forward_backward(b.inputs(), b.targets());
    const double loss = whole.forward_backward(b.inputs(), b.targets());
    CHECK(test::relative_difference(pipe.gradients(), whole.gradients()) <= 1e-12);
    CHECK(std::abs(s.loss - loss) <= 1e-12 * std::abs(loss));
    std::vector<double> out(std::size_t(10 * 4)), expected(out.size());
    pipe.predict(b.inputs(), TensorView<double>{out.data(), Shape{10, 4}});
    whole.forward(b.inputs(), TensorView<double>{expected.data(), Shape{10, 4}});
    CHECK(test::relative_difference(out, expected) <= 1e-12);
  }
}
