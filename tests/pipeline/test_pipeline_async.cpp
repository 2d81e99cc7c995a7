// SPDX-License-Identifier: Apache-2.0
// Asynchronous schedules. PipeDream: an instrumented layer proves that every microbatch's backward
// sees the very weights its forward saw (weight stashing with vertical sync), within the version
// budget the schedule analysis allows; on one stage it is plain per-microbatch SGD. PipeDream-2BW:
// the delayed-gradient recurrence W(t+1) = W(t) - lr * grad f_t(W(t-1)), computed with a Network.
#include "pipeline_test_support.hpp"

#include <map>
#include <mutex>
#include <string>
#include <utility>

namespace {

using namespace cupipe;
using test::Batch;
using test::Host;

/// FNV-1a over bytes: a fingerprint of input rows or of parameter values.
std::uint64_t fingerprint(const void* data, std::size_t bytes) {
  Fnv1a hash;
  hash.add(data, bytes);
  return hash.value();
}

/// What the probes saw, shared by all worker threads.
class ProbeRegistry {
 public:
  void forward(int probe, std::uint64_t input, std::uint64_t weights) {
    std::lock_guard lock(mutex_);
    const auto [it, inserted] = used_.emplace(std::pair{probe, input}, weights);
    if (!inserted) violations_.push_back("probe " + std::to_string(probe) + ": a second forward on the same input");
    ++forwards_;
  }
  void backward(int probe, std::uint64_t input, std::uint64_t weights) {
    std::lock_guard lock(mutex_);
    ++backwards_;
    const auto it = used_.find({probe, input});
    if (it == used_.end()) violations_.push_back("probe " + std::to_string(probe) + ": a backward without a forward");
    else if (it->second != weights)
      violations_.push_back("probe " + std::to_string(probe) + ": backward used other weights than its forward");
  }
  std::vector<std::string> violations() const {
    std::lock_guard lock(mutex_);
    return violations_;
  }
  std::pair<int, int> counts() const {
    std::lock_guard lock(mutex_);
    return {forwards_, backwards_};
  }
  void clear() {
    std::lock_guard lock(mutex_);
    used_.clear();
    violations_.clear();
    forwards_ = backwards_ = 0;
  }

 private:
  mutable std::mutex mutex_;
  std::map<std::pair<int, std::uint64_t>, std::uint64_t> used_;
  std::vector<std::string> violations_;
  int forwards_ = 0;
  int backwards_ = 0;
};

ProbeRegistry& probes() {
  static ProbeRegistry registry;
  return registry;
}

/// A Linear<D, D> that records, per input, a fingerprint of the weights its forward used, and checks
/// in backward_input that it is handed the same weights. Placed second in its stage, so that even
/// stage 0 runs its backward_input (the first layer of stage 0 has no input gradient to compute).
template <int Id, index_t D>
struct Probe : Linear<D, D> {
  static std::string describe() { return "Probe<" + std::to_string(Id) + ">"; }
  static constexpr std::size_t weight_bytes = std::size_t(D * D + D) * sizeof(double);

  template <class B, class T>
  static void forward(B& be, const T* p, ConstView<T> x, TensorView<T> y, TensorView<T> saved) {
    probes().forward(Id, fingerprint(x.data(), std::size_t(x.numel()) * sizeof(T)), fingerprint(p, weight_bytes));
    Linear<D, D>::forward(be, p, x, y, saved);
  }
  template <class B, class T>
  static void backward_input(B& be, const T* p, ConstView<T> x, ConstView<T> saved, ConstView<T> dy, TensorView<T> dx) {
    probes().backward(Id, fingerprint(x.data(), std::size_t(x.numel()) * sizeof(T)), fingerprint(p, weight_bytes));
    Linear<D, D>::backward_input(be, p, x, saved, dy, dx);
  }
};

template <int Id>
using ProbedStage = Stage<Linear<4, 4>, Probe<Id, 4>>;
using Probed2 = StageList<ProbedStage<0>, ProbedStage<1>>;
using Probed3 = StageList<ProbedStage<0>, ProbedStage<1>, ProbedStage<2>>;
using Probed4 = StageList<ProbedStage<0>, ProbedStage<1>, ProbedStage<2>, ProbedStage<3>>;

template <class Stages>
void check_weight_stashing() {
  using Pipe = Pipeline<Stages, schedule::PipeDream, Host>;
  constexpr int p = Pipe::stages;
  constexpr int m = 4;
  constexpr int batches = 2;
  INFO("PipeDream p = " << p);
  PipelineOptions options;
  options.microbatches = m;
  options.batches = batches;
  options.seed = 3;
  Pipe pipe(options);
  const std::vector<int> allowed = schedule::weight_versions(pipe.plan());
  const optim::SGD sgd({.lr = 0.05, .momentum = 0.9});
  probes().clear();
  const std::vector<double> initial = pipe.parameters();
  for (int step = 0; step < 3; ++step) {
    INFO("train_step " << step);
    // Fresh rows every step, so an input fingerprint names one microbatch of the whole run.
    const Batch b = test::make_batch(batches * m * 2, 4, 4, 500 + step);
    const StepStats stats = test::bounded(60, [&] { return pipe.train_step(b.inputs(), b.targets(), sgd); });
    CHECK(probes().violations().empty());
    for (int s = 0; s < p; ++s) {
      INFO("stage " << s);
      CHECK(stats.peak_weight_versions[std::size_t(s)] >= 1);
      CHECK(stats.peak_weight_versions[std::size_t(s)] <= allowed[std::size_t(s)]);
    }
    // Stage 0 starts several microbatches on version 0 before its first update: stashing happened.
    CHECK(stats.peak_weight_versions[0] >= 2);
  }
  for (const std::string& v : probes().violations()) FAIL_CHECK(v);
  // Every microbatch passed every probe once each way, and each backward was one update.
  const int microbatches = 3 * batches * m;
  CHECK(probes().counts() == std::pair{microbatches * p, microbatches * p});
  CHECK(pipe.updates() == microbatches);
  CHECK(test::relative_difference(pipe.parameters(), initial) > 1e-6);
}

}  // namespace

TEST_CASE("PipeDream: every backward uses the weights of its forward, within the analysed versions",
          "[pipeline][pipedream]") {
  check_weight_stashing<Probed2>();
  check_weight_stashing<Probed3>();
  check_weight_stashing<Probed4>();
}

TEST_CASE("PipeDream on one stage is per-microbatch SGD", "[pipeline][pipedream]") {
  using Single = StageList<Stage<Linear<4, 6>, ReLU, Linear<6, 3>>>;
  using Pipe = Pipeline<Single, schedule::PipeDream, Host>;
  constexpr int m = 4;
  constexpr int batches = 2;
  constexpr index_t rows = 3;
  PipelineOptions options;
  options.microbatches = m;
  options.batches = batches;
  options.seed = 11;
  Pipe pipe(options);
  Network<Single::model, Host> net(11);
  const optim::SGD sgd({.lr = 0.1, .momentum = 0.9, .weight_decay = 1e-3});
  std::vector<std::vector<double>> slots;
  std::int64_t updates = 0;
  for (int step = 0; step < 2; ++step) {
    const Batch b = test::make_batch(batches * m * rows, 4, 3, 40 + step);
    const StepStats stats = test::bounded(60, [&] { return pipe.train_step(b.inputs(), b.targets(), sgd); });
    // By hand: one update per microbatch, each from that microbatch's mean loss.
    double mean_of_means = 0;
    for (int j = 0; j < batches * m; ++j) {
      const Batch mb = b.slice(j * rows, rows);
      net.zero_grad();
      mean_of_means += net.forward_backward(mb.inputs(), mb.targets()) / (batches * m);
      test::reference_update(net, sgd, slots, updates++);
    }
    CHECK(std::abs(stats.loss - mean_of_means) <= 1e-12 * std::abs(mean_of_means));
    CHECK(pipe.updates() == updates);
    CHECK(test::relative_difference(pipe.parameters(), net.parameters()) <= 1e-12);
  }
  CHECK(test::relative_difference(pipe.optimizer_state(0), slots[0]) <= 1e-12);
}

namespace {

/// 2BW against W(t+1) = W(t) - lr * grad f_t(W(t-1)), W(-1) = W(0), for `steps` train_steps of
/// `batches` batches each.
template <class Stages>
void check_delayed_gradients(int batches, int steps) {
  using Pipe = Pipeline<Stages, schedule::PipeDream2BW, Host>;
  constexpr int m = 2;
  constexpr index_t rows = 2;
  constexpr double lr = 0.5;
  INFO("2BW p = " << Pipe::stages << ", batches per step = " << batches);
  PipelineOptions options;
  options.microbatches = m;
  options.batches = batches;
  options.seed = 9;
  Pipe pipe(options);
  Network<typename Stages::model, Host> net(9);
  // history[t + 1] is W(t); history[0] is W(-1) = W(0).
  std::vector<std::vector<double>> history{net.parameters(), net.parameters()};
  std::vector<double> undelayed = net.parameters();  // plain SGD, to show the test can tell the two apart
  const auto gradient_at = [&](const std::vector<double>& weights, const Batch& batch) {
    net.set_parameters(weights);
    net.zero_grad();
    net.forward_backward(batch.inputs(), batch.targets());
    return net.gradients();
  };
  for (int step = 0; step < steps; ++step) {
    const index_t n = batches * m * rows;
    const Batch b = test::make_batch(n, Stages::in_features, 2, 900 + step);
    test::bounded(60, [&] { return pipe.train_step(b.inputs(), b.targets(), optim::SGD({.lr = lr})); });
    for (int i = 0; i < batches; ++i) {
      const Batch batch = b.slice(i * m * rows, m * rows);
      const std::size_t t = history.size() - 2;
      const std::vector<double> g = gradient_at(history[t], batch);  // at W(t - 1)
      std::vector<double> next = history[t + 1];
      for (std::size_t k = 0; k < next.size(); ++k) next[k] -= lr * g[k];
      history.push_back(std::move(next));
      const std::vector<double> now = gradient_at(undelayed, batch);
      for (std::size_t k = 0; k < undelayed.size(); ++k) undelayed[k] -= lr * now[k];
    }
    INFO("after " << history.size() - 2 << " batches");
    CHECK(test::relative_difference(pipe.parameters(), history.back()) <= 1e-12);
  }
  CHECK(test::relative_difference(history.back(), undelayed) > 1e-6);
  CHECK(pipe.updates() == std::int64_t(batches * steps));
}

}  // namespace

TEST_CASE("PipeDream-2BW follows the delayed-gradient recurrence", "[pipeline][2bw]") {
  using Tiny = StageList<Stage<Linear<3, 2>, SoftmaxCrossEntropy<2>>>;
  using TwoStages = StageList<Stage<Linear<3, 4>, ReLU>, Stage<Linear<4, 2>, SoftmaxCrossEntropy<2>>>;
  check_delayed_gradients<Tiny>(1, 5);
  check_delayed_gradients<Tiny>(2, 3);
  check_delayed_gradients<TwoStages>(1, 5);
  check_delayed_gradients<TwoStages>(2, 3);
}
