// SPDX-License-Identifier: Apache-2.0
// The runtime as a threaded program: measured timing against the simulator, failures that surface
// at the caller with the stage and action named (and never hang), the compile-time stage lists, and
// workers pinned each to its own share of the CPUs (pin_workers).
#include "pipeline_test_support.hpp"

#include <sched.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <limits>
#include <regex>
#include <string>
#include <thread>

namespace {

using namespace cupipe;
using test::Batch;
using test::Host;

using test::Entry;
using test::Knob;
using test::knobs;
using test::marker;
using test::reset_knobs;

// Knob<0> sits second in stage 0, so that its backward_input runs (stage 0's first layer has none).
using Knobs4 = StageList<Stage<Entry<4>, Knob<0>>, Stage<Knob<1>>, Stage<Knob<2>>, Stage<Knob<3>>>;
using Knobs8 = StageList<Stage<Entry<4>, Knob<0>>, Stage<Knob<1>>, Stage<Knob<2>>, Stage<Knob<3>>, Stage<Knob<4>>,
                         Stage<Knob<5>>, Stage<Knob<6>>, Stage<Knob<7>>>;

const optim::SGD sgd({.lr = 0.1});

/// Measured makespan within 10% of the simulated one and measured bubble within 0.03 of `bubble`.
/// Every action pays a fixed overhead beside its sleep (the sleep's overshoot, a condition-variable
/// wake-up, the hand-off): 100-150 us on a 2-core machine, more on a busy CI runner. With 1 ms actions
/// that overhead alone came to 10% of Interleaved<2>'s makespan, so the actions here last 4-16 ms and
/// the overhead stays near 3%. A loaded machine can still deschedule a worker for milliseconds, so up
/// to 4 runs are made and the test passes if any is within bounds (a systematic error, like an action
/// that waits too long, misses every time).
template <class Pipe>
void check_timing(Pipe& pipe, const schedule::SimResult& simulated, double bubble) {
  const Batch b = test::make_batch(8, 4, 4, 1);
  bool within = false;
  for (int attempt = 0; attempt < 4 && !within; ++attempt) {
    const StepStats stats = test::bounded(60, [&] { return pipe.train_step(b.inputs(), b.targets(), sgd); });
    const double makespan_error = std::abs(stats.makespan_seconds - simulated.makespan) / simulated.makespan;
    const double bubble_error = std::abs(stats.bubble_fraction - bubble);
    within = makespan_error <= 0.10 && bubble_error <= 0.03;
    WARN(pipe.plan().config.stages << " stages, " << pipe.plan().config.microbatches << " microbatches, attempt "
                                   << attempt << ": measured makespan " << stats.makespan_seconds * 1e3
                                   << " ms (simulated " << simulated.makespan * 1e3 << " ms), measured bubble "
                                   << stats.bubble_fraction << " (expected " << bubble << ")");
  }
  CHECK(within);
}

}  // namespace

TEST_CASE("the measured makespan and bubble follow the simulator for 1F1B, GPipe and Interleaved<2>",
          "[pipeline][timing]") {
  constexpr int p = 4;
  constexpr int m = 8;
  const schedule::Costs costs{.forward = 8e-3, .backward = 16e-3, .weight = 0};
  const double flush_bubble = double(p - 1) / double(m + p - 1);
  PipelineOptions options;
  options.microbatches = m;
  reset_knobs();

  SECTION("1F1B and GPipe: 8 ms forward, 16 ms backward per stage") {
    for (int s = 0; s < p; ++s) {
      knobs[std::size_t(s)].forward_us = 8000;
      knobs[std::size_t(s)].backward_us = 16000;
    }
    Pipeline<Knobs4, schedule::OneFOneB, Host> one_f_one_b(options);
    const auto simulated = schedule::simulate(one_f_one_b.plan(), costs);
    CHECK(simulated.bubble_fraction == Approx(flush_bubble));
    check_timing(one_f_one_b, simulated, flush_bubble);
    Pipeline<Knobs4, schedule::GPipe, Host> gpipe(options);
    check_timing(gpipe, schedule::simulate(gpipe.plan(), costs), flush_bubble);
  }
  SECTION("Interleaved<2>: each of the 2 chunks per worker takes half") {
    for (int k = 0; k < 2 * p; ++k) {
      knobs[std::size_t(k)].forward_us = 4000;
      knobs[std::size_t(k)].backward_us = 8000;
    }
    Pipeline<Knobs8, schedule::Interleaved<2>, Host> interleaved(options);
    const auto simulated = schedule::simulate(interleaved.plan(), costs);
    CHECK(simulated.bubble_fraction < flush_bubble);
    check_timing(interleaved, simulated, simulated.bubble_fraction);
  }
  reset_knobs();
}

TEST_CASE("a layer's exception surfaces naming the stage and action, and the pipeline runs on", "[pipeline][faults]") {
  using Pipe = Pipeline<Knobs4, schedule::OneFOneB, Host>;
  reset_knobs();
  PipelineOptions options;
  options.microbatches = 4;
  Pipe pipe(options);
  Batch b = test::make_batch(8, 4, 4, 2);
  b.x[std::size_t(2 * 2 * 4)] = marker;  // first value of microbatch 2 (2 rows per microbatch)
  knobs[2].fail_on_marker = true;
  const std::string message = test::error_message([&] {
    test::bounded(30, [&] { return pipe.train_step(b.inputs(), b.targets(), sgd); });
  });
  CHECK_THAT(message, Catch::StartsWith("worker 2, action F2: "));
  CHECK_THAT(message, Catch::Contains("Knob<2>"));
  CHECK_THAT(message, Catch::Contains("injected failure"));
  // Every worker joined (the call returned); a normal step runs on the same pipeline.
  knobs[2].fail_on_marker = false;
  const StepStats stats = test::bounded(30, [&] { return pipe.train_step(b.inputs(), b.targets(), sgd); });
  CHECK(std::isfinite(stats.loss));
  CHECK(stats.actions.size() == 4 * 2 * 4);
}

TEST_CASE("a non-finite loss names the last stage, the loss layer and the shapes", "[pipeline][faults]") {
  Pipeline<Knobs4, schedule::OneFOneB, Host> pipe(PipelineOptions{.microbatches = 2});
  reset_knobs();
  Batch b = test::make_batch(4, 4, 4, 3);
  b.x[0] = std::numeric_limits<double>::quiet_NaN();  // row 0 of microbatch 0
  const std::string message = test::error_message([&] {
    test::bounded(30, [&] { return pipe.train_step(b.inputs(), b.targets(), sgd); });
  });
  CHECK_THAT(message, Catch::StartsWith("worker 3, action F0: "));
  CHECK_THAT(message, Catch::Contains("SoftmaxCrossEntropy<4>: the loss is not finite"));
  CHECK_THAT(message, Catch::Contains("logits (2, 4) and labels (2,)"));
  b.x[0] = 0.5;
  // The failed step committed nothing: its gradients were dropped and no update applied, so the next
  // step is bitwise a fresh pipeline's first.
  Pipeline<Knobs4, schedule::OneFOneB, Host> fresh(PipelineOptions{.microbatches = 2});
  const double after = test::bounded(30, [&] { return pipe.train_step(b.inputs(), b.targets(), sgd); }).loss;
  CHECK(std::isfinite(after));
  CHECK(after == test::bounded(30, [&] { return fresh.train_step(b.inputs(), b.targets(), sgd); }).loss);
  // With check_finite off the NaN is the caller's to see.
  Pipeline<Knobs4, schedule::OneFOneB, Host> unchecked(PipelineOptions{.microbatches = 2, .check_finite = false});
  b.x[0] = std::numeric_limits<double>::quiet_NaN();
  CHECK(std::isnan(test::bounded(30, [&] { return unchecked.train_step(b.inputs(), b.targets(), sgd); }).loss));
}

namespace {
/// The host backend, counting its copies into host memory: the reads a device backend waits for.
struct CountingHost : Host {
  static inline std::atomic<int> downloads{0};
  template <class U>
  void download(const U* from, std::span<U> to) {
    downloads.fetch_add(1, std::memory_order_relaxed);
    Host::download(from, to);
  }
};

/// CountingHost whose sums of squares stay in its memory as a device backend's do
/// (pipeline::defers_sums_of_squares): each is seen only through a download.
struct DeferringHost : CountingHost {};
template <class V>
void sum_of_squares_into(DeferringHost& be, V x, double* out) {
  *out = ops::sum_of_squares(static_cast<Host&>(be), x);
}
static_assert(pipeline::defers_sums_of_squares<DeferringHost>);
static_assert(!pipeline::defers_sums_of_squares<CountingHost>);
}  // namespace

TEST_CASE("a flush step reads its losses back once, however many microbatches it has", "[pipeline][losses]") {
  reset_knobs();
  Batch b = test::make_batch(16, 4, 4, 3);
  std::array<int, 2> reads{};
  for (int m : {2, 8}) {
    PipelineOptions options;
    options.microbatches = m;
    Pipeline<Knobs4, schedule::OneFOneB, CountingHost> counted(options);
    Pipeline<Knobs4, schedule::OneFOneB, Host> plain(options);
    CountingHost::downloads = 0;
    const StepStats stats = test::bounded(30, [&] { return counted.train_step(b.inputs(), b.targets(), sgd); });
    reads[m == 2 ? 0 : 1] = CountingHost::downloads.load();
    // The same losses as the plain host backend (whose copies are the same memcpy), in the same order.
    CHECK(stats.loss == test::bounded(30, [&] { return plain.train_step(b.inputs(), b.targets(), sgd); }).loss);
  }
  // One read of the m losses (each used to be read as it was computed: m reads).
  CHECK(reads[0] == 1);
  CHECK(reads[1] == 1);
  // Asynchronous schedules update inside the step, so they read (and check) each loss at once.
  PipelineOptions options;
  options.microbatches = 4;
  Pipeline<Knobs4, schedule::PipeDream, CountingHost> async(options);
  CountingHost::downloads = 0;
  (void)test::bounded(30, [&] { return async.train_step(b.inputs(), b.targets(), sgd); });
  CHECK(CountingHost::downloads.load() == 4);
}

TEST_CASE("the gradient norm reads each context's sums back once, however many chunks it holds", "[pipeline][norm]") {
  reset_knobs();
  const Batch b = test::make_batch(16, 4, 4, 3);
  PipelineOptions options;
  options.microbatches = 4;
  // Interleaved<2> on Knobs4: 2 workers, 2 chunks each. The step reads its losses (1) and then
  // the four chunks' sums of squares, one copy per worker's context (2), where each used to wait
  // for its own (4).
  Pipeline<Knobs4, schedule::Interleaved<2>, DeferringHost> deferred(options);
  Pipeline<Knobs4, schedule::Interleaved<2>, Host> plain(options);
  for (int step = 0; step < 2; ++step) {
    DeferringHost::downloads = 0;
    const StepStats got = test::bounded(30, [&] { return deferred.train_step(b.inputs(), b.targets(), sgd); });
    CHECK(DeferringHost::downloads.load() == 1 + 2);
    // The same sums added in the same order: the same bits.
    const StepStats expected = test::bounded(30, [&] { return plain.train_step(b.inputs(), b.targets(), sgd); });
    CHECK(got.grad_norm == expected.grad_norm);
    CHECK(got.loss == expected.loss);
  }
  // Post-validated steps: each worker's boundary reads its own chunks' sums with one copy.
  options.post_validation = true;
  Pipeline<Knobs4, schedule::Interleaved<2>, DeferringHost> overlapped(options);
  Pipeline<Knobs4, schedule::Interleaved<2>, Host> overlapped_plain(options);
  using Deferred = decltype(overlapped);
  using Plain = decltype(overlapped_plain);
  const std::vector<Deferred::Batch> batches{{b.inputs(), b.targets()}, {b.inputs(), b.targets()}};
  const std::vector<Plain::Batch> plain_batches{{b.inputs(), b.targets()}, {b.inputs(), b.targets()}};
  DeferringHost::downloads = 0;
  const std::vector<StepStats> got =
      test::bounded(60, [&] { return overlapped.train_steps(std::span<const Deferred::Batch>(batches), sgd); });
  const int reads = DeferringHost::downloads.load();
  const std::vector<StepStats> expected =
      test::bounded(60, [&] { return overlapped_plain.train_steps(std::span<const Plain::Batch>(plain_batches), sgd); });
  REQUIRE(got.size() == 2);
  for (std::size_t t = 0; t < got.size(); ++t) CHECK(got[t].grad_norm == expected[t].grad_norm);
  // Each loss is read as it is computed (8 over the 2 steps); step 0's boundary reads once per
  // worker (2) and the last step's flush update once per context (2): 12. A read per chunk would
  // make it 16.
  CHECK(reads == 2 * (2 + 4));
}

TEST_CASE("a channel capacity below the plan's channel depth is refused naming both", "[pipeline][faults]") {
  PipelineOptions options;
  options.microbatches = 6;
  options.channel_capacity = 3;
  using Bfs = Pipeline<Knobs8, schedule::BreadthFirst<2>, Host>;
  CHECK_THAT(test::error_message([&] { Bfs pipe(options); }),
             Catch::Contains("channel_capacity 3 is below the 6 messages the bfs plan queues on one channel"));
  options.channel_capacity = 6;
  Bfs pipe(options);
  const Batch b = test::make_batch(12, 4, 4, 6);
  CHECK(std::isfinite(test::bounded(30, [&] { return pipe.train_step(b.inputs(), b.targets(), sgd); }).loss));
}

TEST_CASE("a batch of the wrong shape is rejected naming both shapes", "[pipeline][faults]") {
  Pipeline<Knobs4, schedule::OneFOneB, Host> pipe(PipelineOptions{.microbatches = 2});
  const Batch wide = test::make_batch(4, 5, 4, 4);
  CHECK_THAT(test::error_message([&] { pipe.train_step(wide.inputs(), wide.targets(), sgd); }),
             Catch::Contains("input batch expected shape (4, 4) but got (4, 5)"));
  const Batch b = test::make_batch(4, 4, 4, 4);
  const ConstView<std::int32_t> three_labels{b.labels.data(), Shape{3}};
  CHECK_THAT(test::error_message([&] { pipe.train_step(b.inputs(), three_labels, sgd); }),
             Catch::Contains("expected labels (4,) for the input batch (4, 4) but got labels (3,)"));
}

TEST_CASE("a transfer timeout names the waiting stage and its peer, and never hangs", "[pipeline][faults]") {
  reset_knobs();
  PipelineOptions options;
  options.microbatches = 4;
  options.transfer_timeout_seconds = 0.2;  // generous: the step after the failure runs under it too
  options.flight_dir = (std::filesystem::temp_directory_path() / ("cupipe-flight-" + std::to_string(::getpid()))).string();
  Pipeline<Knobs4, schedule::OneFOneB, Host> pipe(options);
  const Batch b = test::make_batch(4, 4, 4, 5);
  knobs[0].forward_us = 1'000'000;  // stage 0's first forward outlasts the timeout of everyone downstream
  const auto start = std::chrono::steady_clock::now();
  const std::string message = test::error_message([&] {
    test::bounded(30, [&] { return pipe.train_step(b.inputs(), b.targets(), sgd); });
  });
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  // Stages 1, 2 and 3 all wait for microbatch 0; whichever times out first is reported.
  std::smatch named;
  REQUIRE(std::regex_search(message, named,
                            std::regex("^worker ([123]), action F0: waiting for the activation of microbatch 0 from "
                                       "worker ([012]): no message after 0.2 s \\(transfer timeout\\)")));
  CHECK(std::stoi(named[2]) == std::stoi(named[1]) - 1);
  CHECK(seconds < 10);
  // The flight recorder dumped the failed wait: every worker in its F0, the waiting ones' message.
  std::ifstream dumped(options.flight_dir + "/cupipe-flight-rank-0.json");
  const std::string flight{std::istreambuf_iterator<char>(dumped), {}};
  CHECK_THAT(flight, Catch::Contains("\"trigger\": \"wait failed\""));
  CHECK_THAT(flight, Catch::Contains("\"current\": {\"index\": 0, \"action\": \"F0\""));
  CHECK_THAT(flight, Catch::Contains("\"waiting\": {\"message\": \"the activation of microbatch 0 from "));
  std::filesystem::remove_all(options.flight_dir);
  knobs[0].forward_us = 0;
  CHECK(std::isfinite(test::bounded(30, [&] { return pipe.train_step(b.inputs(), b.targets(), sgd); }).loss));
}

TEST_CASE("partition splits an MLP into balanced stages that keep global layer indices", "[pipeline][stages]") {
  using Mlp = Sequential<Linear<784, 512>, ReLU, Linear<512, 256>, ReLU, Linear<256, 10>>;
  using Split = partition<Mlp, 3>;
  static_assert(Split::size == 3);
  // partition<> is the stage list, marked with its count (so multi-chunk schedules can refuse it);
  // partition_for<> is the plain stage list.
  using Listed = StageList<Stage<Linear<784, 512>, ReLU>, Stage<Linear<512, 256>, ReLU>, Stage<Linear<256, 10>>>;
  static_assert(std::is_base_of_v<Listed, Split> && Split::partition_count == 3);
  static_assert(std::is_same_v<partition_for<Mlp, 3, schedule::OneFOneB>, Listed>);
  static_assert(std::is_same_v<Split::model, Mlp>);
  static_assert(Split::in_features == 784 && Split::out_features == 10);
  CHECK(Split::stage<0>::describe() == "Linear<784, 512>, ReLU");
  CHECK(Split::stage<1>::describe() == "Linear<512, 256>, ReLU");
  CHECK(Split::stage<2>::describe() == "Linear<256, 10>");
  CHECK(Split::stage<1>::describe_layer<0>() == "Linear<512, 256> (layer 2)");

  const auto names = [](const std::vector<ParamInfo>& table) {
    std::vector<std::string> out;
    for (const ParamInfo& p : table) out.push_back(p.name);
    return out;
  };
  CHECK(names(Split::stage<0>::parameter_table()) == std::vector<std::string>{"0.weight", "0.bias"});
  CHECK(names(Split::stage<1>::parameter_table()) == std::vector<std::string>{"2.weight", "2.bias"});
  CHECK(names(Split::stage<2>::parameter_table()) == std::vector<std::string>{"4.weight", "4.bias"});
  CHECK(Split::stage<2>::parameter_table()[0].shape == Shape{10, 256});
  // The stages' parameters, end to end, are the whole model's flat array.
  CHECK(Split::stage<0>::param_count + Split::stage<1>::param_count + Split::stage<2>::param_count ==
        Mlp::body::param_count);

  // One stage per unit when a model has more units than stages: the two big layers stay apart.
  using Two = partition<Mlp, 2>;
  CHECK(Two::stage<0>::describe() == "Linear<784, 512>, ReLU");
  CHECK(Two::stage<1>::describe() == "Linear<512, 256>, ReLU, Linear<256, 10>");

  // A hand-made list: the loss ending the last stage is split off, the rest runs as the stage.
  using Hand = StageList<Stage<Linear<4, 8>, ReLU>, Stage<Linear<8, 3>, SoftmaxCrossEntropy<3>>>;
  static_assert(std::is_same_v<Hand::loss, SoftmaxCrossEntropy<3>>);
  static_assert(Hand::stage<1>::size == 1 && Hand::out_features == 3);
  CHECK(Hand::stage<1>::describe() == "Linear<8, 3>");
  CHECK(names(Hand::stage<1>::parameter_table()) == std::vector<std::string>{"2.weight", "2.bias"});
}

TEST_CASE("busy time counts an overlapped F&B pair's shared time once (two streams of one device)",
          "[pipeline][stats]") {
  using schedule::ActionKind;
  // Worker 0: F [0, 4] on the side stream beside B [1, 3] on the main one, then W [5, 6]: 5 s busy
  // of a 6 s makespan. Worker 1: back to back, F [0, 2], B [2, 6]: 6 s, no idle.
  const std::vector<ActionRecord> w0{{0, ActionKind::F, 1, 0, 0.0, 4.0, true},
                                     {0, ActionKind::B, 0, 1, 1.0, 3.0, false},
                                     {0, ActionKind::W, 0, 1, 5.0, 6.0, false}};
  const std::vector<ActionRecord> w1{{1, ActionKind::F, 0, 0, 0.0, 2.0, false}, {1, ActionKind::B, 0, 0, 2.0, 6.0, false}};
  Host a, b;
  const StepStats stats = pipeline::measure_step({&w0, &w1}, {&a.memory, &b.memory}, {1, 1});
  CHECK(stats.makespan_seconds == 6.0);
  CHECK(stats.busy_seconds == std::vector<double>{5.0, 6.0});
  CHECK(stats.idle_seconds == std::vector<double>{1.0, 0.0});
  CHECK(stats.bubble_fraction == Approx(1.0 / 12.0));
}

namespace {

/// This process's threads, from /proc (Linux), once the count has settled at `expected` or after
/// a second: a joined thread's /proc entry can outlive its join by a moment.
int threads_settled_at(int expected) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(1);
  int count = 0;
  while (true) {
    count = int(std::distance(std::filesystem::directory_iterator("/proc/self/task"), {}));
    if (count == expected || std::chrono::steady_clock::now() > deadline) return count;
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
}

TEST_CASE("a pipeline makes its worker threads at the first step and keeps them until it goes",
          "[pipeline][threads]") {
  using Pipe = Pipeline<Knobs4, schedule::OneFOneB, Host>;
  reset_knobs();
  PipelineOptions options;
  options.microbatches = 4;
  const Batch b = test::make_batch(8, 4, 4, 3);
  int built = 0;
  {
    Pipe pipe(options);
    // The flight recorder's watcher may start with the first pipeline (and ThreadSanitizer's own
    // thread with the first thread made; neither ends with the pipeline): counted from here.
    built = threads_settled_at(-1);
    test::bounded(30, [&] { return pipe.train_step(b.inputs(), b.targets(), sgd); });
    CHECK(threads_settled_at(built + 4) == built + 4);  // one per worker, alive between steps
    for (int step = 0; step < 10; ++step) test::bounded(30, [&] { return pipe.train_step(b.inputs(), b.targets(), sgd); });
    CHECK(threads_settled_at(built + 4) == built + 4);  // the same four: no thread per step
  }
  CHECK(threads_settled_at(built) == built);  // joined with the pipeline
}

TEST_CASE("measure_actions off: nothing recorded per action, and the same numbers", "[pipeline][threads]") {
  using Pipe = Pipeline<Knobs4, schedule::OneFOneB, Host>;
  reset_knobs();
  PipelineOptions timed;
  timed.microbatches = 4;
  PipelineOptions quiet = timed;
  quiet.measure_actions = false;
  Pipe a(timed), b(quiet);
  for (int step = 0; step < 3; ++step) {
    const Batch batch = test::make_batch(8, 4, 4, 10 + std::uint64_t(step));
    const StepStats sa = test::bounded(30, [&] { return a.train_step(batch.inputs(), batch.targets(), sgd); });
    const StepStats sb = test::bounded(30, [&] { return b.train_step(batch.inputs(), batch.targets(), sgd); });
    CHECK(sa.loss == sb.loss);
    CHECK(sa.grad_norm == sb.grad_norm);
    CHECK(sa.actions.size() == 4 * 2 * 4);
    CHECK(sa.makespan_seconds > 0);
    CHECK(sb.actions.empty());
    CHECK(sb.busy_seconds.empty());
    CHECK(std::isnan(sb.makespan_seconds));
    CHECK(std::isnan(sb.bubble_fraction));
    CHECK(sb.peak_activation_bytes.size() == 4);
    CHECK(sb.peak_activation_bytes[3] > 0);  // measured (the peaks depend on the threads' timing)
  }
  CHECK(a.parameters() == b.parameters());
}

}  // namespace

#if defined(__linux__)
namespace {
/// The CPUs the thread `tid` may run on (0: the caller).
std::vector<int> cpus_of(pid_t tid) {
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(tid, sizeof set, &set) != 0) return {};
  std::vector<int> cpus;
  for (int c = 0; c < CPU_SETSIZE; ++c)
    if (CPU_ISSET(c, &set)) cpus.push_back(c);
  return cpus;
}

/// The CPU sets of the process's threads that may not run on every CPU the caller may.
std::vector<std::vector<int>> narrowed_threads() {
  const std::vector<int> mine = cpus_of(0);
  std::vector<std::vector<int>> out;
  for (const auto& entry : std::filesystem::directory_iterator("/proc/self/task")) {
    const std::vector<int> cpus = cpus_of(pid_t(std::stol(entry.path().filename().string())));
    if (!cpus.empty() && cpus != mine) out.push_back(cpus);
  }
  std::sort(out.begin(), out.end());
  return out;
}
}  // namespace

TEST_CASE("pin_workers: an in-process pipeline's workers each run on their own share of the CPUs", "[pipeline][threads]") {
  const std::vector<int> mine = cpus_of(0);
  REQUIRE(narrowed_threads().empty());  // nothing pinned before
  using Two = StageList<Stage<Entry<4>, Knob<0>>, Stage<Knob<1>>>;
  reset_knobs();
  const Batch b = test::make_batch(8, 4, 4, 1);
  PipelineOptions options;
  options.microbatches = 2;
  options.pin_workers = false;
  {
    Pipeline<Two, schedule::OneFOneB, Host> loose(options);
    (void)loose.train_step(b.inputs(), b.targets(), sgd);
    CHECK(narrowed_threads().empty());
  }
  options.pin_workers = true;
  Pipeline<Two, schedule::OneFOneB, Host> pinned(options);
  const StepStats stats = pinned.train_step(b.inputs(), b.targets(), sgd);
  CHECK(std::isfinite(stats.loss));
  const std::vector<std::vector<int>> narrowed = narrowed_threads();
  if (mine.size() < 2) {
    WARN("one CPU: the workers stay unpinned");
    CHECK(narrowed.empty());
    return;
  }
  // Two threads, the allowed CPUs dealt between them in order.
  REQUIRE(narrowed.size() == 2);
  std::vector<int> dealt = narrowed[0];
  dealt.insert(dealt.end(), narrowed[1].begin(), narrowed[1].end());
  CHECK(dealt == mine);
}
#endif
