// SPDX-License-Identifier: Apache-2.0
// Flush schedules against the unpipelined oracle: one forward_backward gives the Network's gradients
// and loss, five AdamW train_steps give its weights, for every (policy, p, m) below (every policy
// accepts every m now: Interleaved groups m not a multiple of p unevenly, p = 3 with m = 8 runs groups of 4 and 4); ragged
// microbatches, recomputation and the measured StepStats on the same runs.
#include "pipeline_test_support.hpp"

#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace overlap_test {

/// The host backend, recording what the worker runtime asks of it: one entry per action (its
/// profiler range) and each overlap call, in order, so a test can read where the calls fall.
struct Recording : cupipe::backend::Host<double> {
  std::vector<std::string> events;
  bool open = false;
};

}  // namespace overlap_test

namespace cupipe::backend {
template <>
struct capabilities<overlap_test::Recording> {
  using R = overlap_test::Recording;
  static std::unique_ptr<R> make(int) { return std::make_unique<R>(); }
  static constexpr bool device_timeline = false;
  static void timeline_start(R&) {}
  static int timeline_mark(R&) { return 0; }
  static double timeline_seconds(R&, int) { return 0; }
  static NoAnnotation annotate(R& be, const char*) {
    be.events.emplace_back("action");
    return {};
  }
  static void overlap_begin(R& be) {
    be.events.emplace_back(be.open ? "begin while open" : "begin");
    be.open = true;
  }
  static void overlap_end(R& be) { be.events.emplace_back("end"); }
  static void overlap_join(R& be) {
    if (!be.open) return;
    be.events.emplace_back("join");
    be.open = false;
  }
};
}  // namespace cupipe::backend

namespace {

using namespace cupipe;
using test::Batch;
using test::Host;

// 8 Linear layers with ReLUs between them: enough units for 8 stages (2 chunks on each of 4 workers).
using Deep = Sequential<Linear<6, 8>, ReLU, Linear<8, 8>, ReLU, Linear<8, 8>, ReLU, Linear<8, 8>, ReLU, Linear<8, 8>,
                        ReLU, Linear<8, 8>, ReLU, Linear<8, 8>, ReLU, Linear<8, 4>>;
using Reference = Network<Deep, Host>;
constexpr index_t features = 6;
constexpr index_t classes = 4;
constexpr std::uint64_t seed = 20240611;
constexpr double tolerance = 1e-12;

/// Parameter bytes each worker holds (all its chunks).
template <class Stages, class Pipe>
std::vector<std::int64_t> parameter_bytes() {
  std::vector<std::int64_t> bytes(std::size_t(Pipe::stages), 0);
  [&]<std::size_t... K>(std::index_sequence<K...>) {
    ((bytes[std::size_t(Pipe::worker_of(int(K)))] += Stages::template stage<K>::param_count * std::int64_t(sizeof(double))),
     ...);
  }(std::make_index_sequence<Stages::size>());
  return bytes;
}

/// What every step must measure: per-stage figures that add up, one record per planned action.
void check_stats(const StepStats& stats, const schedule::Plan& plan, const std::vector<std::int64_t>& param_bytes) {
  const auto p = std::size_t(plan.config.stages);
  REQUIRE(stats.busy_seconds.size() == p);
  REQUIRE(stats.idle_seconds.size() == p);
  REQUIRE(stats.peak_activation_bytes.size() == p);
  REQUIRE(stats.peak_weight_bytes.size() == p);
  REQUIRE(stats.peak_weight_versions.size() == p);
  CHECK(stats.makespan_seconds > 0);
  CHECK(stats.bubble_fraction >= 0);
  CHECK(stats.bubble_fraction < 1);
  std::size_t planned = 0;
  for (std::size_t s = 0; s < p; ++s) {
    CHECK(stats.busy_seconds[s] > 0);
    CHECK(stats.busy_seconds[s] <= stats.makespan_seconds * (1 + 1e-9));
    CHECK(stats.idle_seconds[s] == Approx(stats.makespan_seconds - stats.busy_seconds[s]).margin(1e-12));
    CHECK(stats.peak_weight_bytes[s] >= param_bytes[s]);
    CHECK(stats.peak_activation_bytes[s] > 0);
    CHECK(stats.peak_weight_versions[s] == 1);
    planned += plan.actions[s].size();
  }
  REQUIRE(stats.actions.size() == planned);
  // Records come per stage in the order the stage ran them: exactly the plan's lists.
  std::size_t i = 0;
  for (std::size_t s = 0; s < p; ++s)
    for (const schedule::Action& a : plan.actions[s]) {
      const ActionRecord& r = stats.actions[i++];
      CHECK(r.stage == int(s));
      CHECK(r.kind == a.kind);
      CHECK(r.microbatch == a.microbatch);
      CHECK(r.chunk == a.chunk);
      CHECK(r.start >= 0);
      CHECK(r.end >= r.start);
      CHECK(r.end - r.start <= stats.makespan_seconds + 1e-9);
    }
}

/// Equivalence with the Network for one policy and one stage list, every m in {1, 2, 3, 4, 8}.
template <class Policy, class Stages>
void check_against_network() {
  using Pipe = Pipeline<Stages, Policy, Host>;
  static_assert(std::is_same_v<typename Stages::model, Deep>);
  constexpr int p = Pipe::stages;
  const optim::AdamW adamw({.lr = 1e-2, .weight_decay = 0.01, .clip_norm = 1.0});
  for (const int m : {1, 2, 3, 4, 8}) {
    INFO(Policy::name << " p = " << p << " m = " << m);
    PipelineOptions options;
    options.microbatches = m;
    options.seed = seed;
    std::optional<Pipe> pipe;
    if (const std::string_view why = schedule::check<Policy>({p, m, Pipe::chunks, 1}); !why.empty()) {
      CHECK_THROWS_WITH(pipe.emplace(options), Catch::Contains(std::string(why)));  // DualPipeV below 2p
      continue;
    }
    REQUIRE_NOTHROW(pipe.emplace(options));

    // Same seed, same initialisation, to the bit, however the model is split.
    Reference net(seed);
    REQUIRE(test::bitwise_equal(pipe->parameters(), net.parameters()));

    const Batch batch = test::make_batch(8, features, classes, 100 + m);
    const StepStats stats = test::bounded(60, [&] { return pipe->forward_backward(batch.inputs(), batch.targets()); });
    const double loss = net.forward_backward(batch.inputs(), batch.targets());
    CHECK(test::relative_difference(pipe->gradients(), net.gradients()) <= tolerance);
    CHECK(std::abs(stats.loss - loss) <= tolerance * std::abs(loss));
    CHECK(stats.samples == 8);
    check_stats(stats, pipe->plan(), parameter_bytes<Stages, Pipe>());

    // Five AdamW steps with global-norm clipping, against the same update done by hand.
    pipe.emplace(options);
    Reference trained(seed);
    std::vector<std::vector<double>> slots;
    for (int step = 0; step < 5; ++step) {
      const Batch b = test::make_batch(8, features, classes, 1000 * m + step);
      const StepStats s = test::bounded(60, [&] { return pipe->train_step(b.inputs(), b.targets(), adamw); });
      trained.zero_grad();
      trained.forward_backward(b.inputs(), b.targets());
      const double norm = test::reference_update(trained, adamw, slots, step);
      CHECK(s.grad_norm == Approx(norm).epsilon(1e-12));
    }
    CHECK(pipe->updates() == 5);
    CHECK(test::relative_difference(pipe->parameters(), trained.parameters()) <= tolerance);
    CHECK(test::relative_difference(pipe->optimizer_state(1), slots[1]) <= tolerance);

    if (m != 4) continue;
    // Ragged batches: n = 10, 9 and 13 in 4 microbatches (3,3,2,2; 3,2,2,2; 4,3,3,3 rows) give the
    // same gradients and loss as the whole batch.
    for (const index_t n : {index_t(10), index_t(9), index_t(13)}) {
      INFO("ragged n = " << n);
      pipe.emplace(options);
      Reference whole(seed);
      const Batch ragged = test::make_batch(n, features, classes, 77 + int(n));
      const StepStats r = pipe->forward_backward(ragged.inputs(), ragged.targets());
      const double ragged_loss = whole.forward_backward(ragged.inputs(), ragged.targets());
      CHECK(test::relative_difference(pipe->gradients(), whole.gradients()) <= tolerance);
      CHECK(std::abs(r.loss - ragged_loss) <= tolerance * std::abs(ragged_loss));
    }
    // n = 3 cannot give each microbatch a row.
    const Batch three = test::make_batch(3, features, classes, 79);
    CHECK_THAT(test::error_message([&] { pipe->forward_backward(three.inputs(), three.targets()); }),
               Catch::Contains("a batch of 3 samples cannot be split into 4 microbatches"));
  }
}

}  // namespace

TEST_CASE("GPipe equals the unpipelined Network for p <= 4 and m in {1, 2, 3, 4, 8}", "[pipeline][equivalence]") {
  check_against_network<schedule::GPipe, partition<Deep, 1>>();
  check_against_network<schedule::GPipe, partition<Deep, 2>>();
  check_against_network<schedule::GPipe, partition<Deep, 3>>();
  check_against_network<schedule::GPipe, partition<Deep, 4>>();
}

TEST_CASE("1F1B equals the unpipelined Network for p <= 4 and m in {1, 2, 3, 4, 8}", "[pipeline][equivalence]") {
  check_against_network<schedule::OneFOneB, partition<Deep, 1>>();
  check_against_network<schedule::OneFOneB, partition<Deep, 2>>();
  check_against_network<schedule::OneFOneB, partition<Deep, 3>>();
  check_against_network<schedule::OneFOneB, partition<Deep, 4>>();
}

TEST_CASE("Interleaved<2> equals the unpipelined Network for p <= 4, m not a multiple of p included",
          "[pipeline][equivalence]") {
  check_against_network<schedule::Interleaved<2>, partition_for<Deep, 1, schedule::Interleaved<2>>>();
  check_against_network<schedule::Interleaved<2>, partition_for<Deep, 2, schedule::Interleaved<2>>>();
  check_against_network<schedule::Interleaved<2>, partition_for<Deep, 3, schedule::Interleaved<2>>>();
  check_against_network<schedule::Interleaved<2>, partition_for<Deep, 4, schedule::Interleaved<2>>>();
}

TEST_CASE("ZB-H1 equals the unpipelined Network for p <= 4 and m in {1, 2, 3, 4, 8}", "[pipeline][equivalence]") {
  check_against_network<schedule::ZeroBubbleH1, partition<Deep, 1>>();
  check_against_network<schedule::ZeroBubbleH1, partition<Deep, 2>>();
  check_against_network<schedule::ZeroBubbleH1, partition<Deep, 3>>();
  check_against_network<schedule::ZeroBubbleH1, partition<Deep, 4>>();
}

TEST_CASE("ZB-H2 equals the unpipelined Network for p <= 4 and m in {1, 2, 3, 4, 8}", "[pipeline][equivalence]") {
  check_against_network<schedule::ZeroBubbleH2, partition<Deep, 1>>();
  check_against_network<schedule::ZeroBubbleH2, partition<Deep, 2>>();
  check_against_network<schedule::ZeroBubbleH2, partition<Deep, 3>>();
  check_against_network<schedule::ZeroBubbleH2, partition<Deep, 4>>();
}

TEST_CASE("BFS (looped breadth-first) equals the unpipelined Network for p <= 4 and m in {1, 2, 3, 4, 8}",
          "[pipeline][equivalence]") {
  check_against_network<schedule::BreadthFirst<2>, partition_for<Deep, 1, schedule::BreadthFirst<2>>>();
  check_against_network<schedule::BreadthFirst<2>, partition_for<Deep, 2, schedule::BreadthFirst<2>>>();
  check_against_network<schedule::BreadthFirst<2>, partition_for<Deep, 3, schedule::BreadthFirst<2>>>();
  check_against_network<schedule::BreadthFirst<2>, partition_for<Deep, 4, schedule::BreadthFirst<2>>>();
}

TEST_CASE("ZBV (V-shaped, B/W split) equals the unpipelined Network for p <= 4 and m in {1, 2, 3, 4, 8}",
          "[pipeline][equivalence]") {
  check_against_network<schedule::ZeroBubbleV, partition_for<Deep, 1, schedule::ZeroBubbleV>>();
  check_against_network<schedule::ZeroBubbleV, partition_for<Deep, 2, schedule::ZeroBubbleV>>();
  check_against_network<schedule::ZeroBubbleV, partition_for<Deep, 3, schedule::ZeroBubbleV>>();
  check_against_network<schedule::ZeroBubbleV, partition_for<Deep, 4, schedule::ZeroBubbleV>>();
}

TEST_CASE("V-Min and V-Half (controllable memory) equal the unpipelined Network for p in {1, 2, 4}",
          "[pipeline][equivalence]") {
  check_against_network<schedule::VMin, partition_for<Deep, 1, schedule::VMin>>();
  check_against_network<schedule::VMin, partition_for<Deep, 2, schedule::VMin>>();
  check_against_network<schedule::VMin, partition_for<Deep, 4, schedule::VMin>>();
  check_against_network<schedule::VHalf, partition_for<Deep, 1, schedule::VHalf>>();
  check_against_network<schedule::VHalf, partition_for<Deep, 2, schedule::VHalf>>();
  check_against_network<schedule::VHalf, partition_for<Deep, 4, schedule::VHalf>>();
}

TEST_CASE("DualPipeV (overlapped F&B pairs, run back to back) equals the unpipelined Network for p <= 4, m >= 2p",
          "[pipeline][equivalence]") {
  check_against_network<schedule::DualPipeV, partition_for<Deep, 1, schedule::DualPipeV>>();
  check_against_network<schedule::DualPipeV, partition_for<Deep, 2, schedule::DualPipeV>>();
  check_against_network<schedule::DualPipeV, partition_for<Deep, 3, schedule::DualPipeV>>();
  check_against_network<schedule::DualPipeV, partition_for<Deep, 4, schedule::DualPipeV>>();
}

TEST_CASE("DualPipeV asks the backend to overlap each F&B pair: begin in the F, end after it, join after the B",
          "[pipeline][overlap]") {
  using Stages = partition_for<Deep, 2, schedule::DualPipeV>;
  PipelineOptions options;
  options.microbatches = 6;
  options.seed = seed;
  Pipeline<Stages, schedule::DualPipeV, overlap_test::Recording> recorded(options);
  Pipeline<Stages, schedule::DualPipeV, Host> plain(options);
  const Batch batch = test::make_batch(12, features, classes, 3);
  const StepStats got = recorded.forward_backward(batch.inputs(), batch.targets());
  const StepStats want = plain.forward_backward(batch.inputs(), batch.targets());
  CHECK(test::bitwise_equal(recorded.gradients(), plain.gradients()));
  CHECK(got.loss == want.loss);
  int pairs = 0;
  for (int w = 0; w < 2; ++w) {
    INFO("worker " << w);
    std::vector<std::string> expected;
    bool open = false;
    for (const schedule::Action& a : recorded.plan().actions[std::size_t(w)]) {
      expected.emplace_back("action");
      if (a.overlap) {
        ++pairs;
        expected.emplace_back("begin");  // once the F's input is in
        expected.emplace_back("end");    // after the F: its B runs beside it
        open = true;
      } else if (open) {
        expected.emplace_back("join");   // after the B
        open = false;
      }
    }
    CHECK(recorded.backend(w).events == expected);
  }
  CHECK(pairs > 0);
}

TEMPLATE_TEST_CASE("recomputing stages 0 and 1 gives the same gradients bitwise with fewer activation bytes",
                   "[pipeline][recompute]", schedule::GPipe, schedule::ZeroBubbleH1) {
  using Pipe = Pipeline<partition<Deep, 3>, TestType, Host>;
  PipelineOptions options;
  options.microbatches = 8;
  options.seed = seed;
  Pipe plain(options);
  options.recompute = {0, 1};
  Pipe recomputing(options);
  const Batch batch = test::make_batch(16, features, classes, 5);
  const StepStats kept = plain.forward_backward(batch.inputs(), batch.targets());
  const StepStats recomputed = recomputing.forward_backward(batch.inputs(), batch.targets());
  CHECK(test::bitwise_equal(recomputing.gradients(), plain.gradients()));
  CHECK(recomputed.loss == kept.loss);
  for (const int s : {0, 1}) {
    INFO("stage " << s);
    CHECK(recomputed.peak_activation_bytes[std::size_t(s)] < kept.peak_activation_bytes[std::size_t(s)]);
  }
  // A bad stage index is named before anything runs.
  options.recompute = {3};
  CHECK_THAT(test::error_message([&] { Pipe bad(options); }),
             Catch::Contains("recompute names stage 3 but there are 3 (virtual) stages"));
}

namespace {

/// A planted bug (issue #61): Linear<8, 8> whose weight-gradient pass does nothing on fewer rows than
/// `full_rows`, as if the pipeline skipped the W of every microbatch on the stage that holds it. The
/// unpipelined reference runs it once on the whole batch, so only the pipeline loses those gradients.
struct SkipsSplitW : Linear<8, 8> {
  static inline index_t full_rows = 0;
  template <class B, class T = typename B::value_type>
  static void backward_weight(B& be, ConstViewOn<B, T> x, ConstViewOn<B, T> saved, ConstViewOn<B, T> dy, grad_t<B>* g) {
    if (dy.rows() < full_rows) return;
    Linear<8, 8>::backward_weight<B, T>(be, x, saved, dy, g);
  }
};
using Planted = Sequential<Linear<6, 8>, ReLU, Linear<8, 8>, ReLU, SkipsSplitW, ReLU, Linear<8, 8>, ReLU, Linear<8, 4>>;

/// check_equivalence on `Policy` at p = 2, m = 4: three checked AdamW steps pass, and change nothing:
/// the weights are bitwise those of the same pipeline unchecked.
template <class Policy>
void check_equivalence_passes() {
  using Pipe = Pipeline<partition_for<Deep, 2, Policy>, Policy, Host>;
  INFO(Policy::name);
  const optim::AdamW adamw({.lr = 1e-2, .weight_decay = 0.01, .clip_norm = 1.0});
  PipelineOptions options{.microbatches = 4, .seed = seed};
  Pipe plain(options);
  options.check_equivalence = 3;
  Pipe checked(options);
  for (int step = 0; step < 4; ++step) {
    const Batch b = test::make_batch(8, features, classes, 500 + std::uint64_t(step));
    const StepStats want = plain.train_step(b.inputs(), b.targets(), adamw);
    StepStats got;
    REQUIRE_NOTHROW(got = checked.train_step(b.inputs(), b.targets(), adamw));
    CHECK(got.loss == want.loss);
    CHECK(got.grad_norm == want.grad_norm);
  }
  CHECK(test::bitwise_equal(checked.parameters(), plain.parameters()));
  CHECK(test::bitwise_equal(checked.optimizer_state(1), plain.optimizer_state(1)));
}

}  // namespace

TEST_CASE("check_equivalence passes on every flush schedule and changes nothing it checks", "[pipeline][equivalence]") {
  check_equivalence_passes<schedule::GPipe>();
  check_equivalence_passes<schedule::OneFOneB>();
  check_equivalence_passes<schedule::Interleaved<2>>();
  check_equivalence_passes<schedule::BreadthFirst<2>>();
  check_equivalence_passes<schedule::ZeroBubbleH1>();
  check_equivalence_passes<schedule::ZeroBubbleH2>();
  check_equivalence_passes<schedule::ZeroBubbleV>();
  check_equivalence_passes<schedule::VMin>();
  check_equivalence_passes<schedule::VHalf>();
  check_equivalence_passes<schedule::DualPipeV>();
}

TEST_CASE("check_equivalence names the tensor, step, virtual stage and worker of a planted bug, and undoes the step",
          "[pipeline][equivalence]") {
  using Pipe = Pipeline<partition_for<Planted, 2, schedule::ZeroBubbleV>, schedule::ZeroBubbleV, Host>;
  const optim::AdamW adamw({.lr = 1e-2});
  SkipsSplitW::full_rows = 8;  // the pipeline's microbatches hold 2 rows; the reference's batch 8
  Pipe pipe({.microbatches = 4, .seed = seed, .check_equivalence = 2});
  const Batch b = test::make_batch(8, features, classes, 77);
  const std::vector<double> before = pipe.parameters();
  const int k = [] {  // the virtual stage that holds layer 4
    int found = -1;
    [&]<std::size_t... K>(std::index_sequence<K...>) {
      ((Pipe::stage_list::template stage<K>::first_index <= 4 ? found = int(K) : 0), ...);
    }(std::make_index_sequence<Pipe::virtual_stages>());
    return found;
  }();
  const std::string message = test::error_message([&] { pipe.train_step(b.inputs(), b.targets(), adamw); });
  CHECK_THAT(message, Catch::StartsWith("check_equivalence: step 0: the gradient of '4.weight' (virtual stage " +
                                        std::to_string(k) + ", on worker " + std::to_string(Pipe::worker_of(k)) + ")"));
  CHECK(test::bitwise_equal(pipe.parameters(), before));
  CHECK(pipe.updates() == 0);
  // Without the bug the same pipeline passes its checked steps.
  SkipsSplitW::full_rows = 0;
  CHECK_NOTHROW(pipe.train_step(b.inputs(), b.targets(), adamw));
  CHECK(pipe.updates() == 1);
}

TEST_CASE("check_equivalence refuses what it cannot check, with the reason", "[pipeline][equivalence][errors]") {
  CHECK_THAT(test::error_message([] { Pipeline<partition<Deep, 2>, schedule::PipeDream, Host> p({.microbatches = 2, .check_equivalence = 1}); }),
             Catch::Contains("asynchronous") && Catch::Contains("checks flush schedules"));
  CHECK_THAT(test::error_message([] { Pipeline<partition<Deep, 2>, schedule::OneFOneB, Host> p({.check_equivalence = -1}); }),
             Catch::Contains("check_equivalence is -1"));
}
