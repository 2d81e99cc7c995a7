// SPDX-License-Identifier: Apache-2.0
// Shared by the pipeline runtime tests: seeded batches, comparisons, the unpipelined reference update,
// and a guard that turns a hang into a failure.
#pragma once

#include <catch2/catch.hpp>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <future>
#include <span>
#include <string>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

#include "cupipe/cupipe.hpp"
#include "cupipe/pipeline/pipeline.hpp"
#include "cupipe/schedule/schedule.hpp"
#include "identity_layers.hpp"

namespace cupipe::test {

using Host = backend::Host<double>;

/// A seeded batch: x (rows, features) uniform in [-1, 1), labels uniform in [0, classes).
struct Batch {
  index_t rows = 0;
  index_t features = 0;
  std::vector<double> x;
  std::vector<std::int32_t> labels;

  ConstView<double> inputs() const { return {x.data(), Shape{rows, features}}; }
  ConstView<std::int32_t> targets() const { return {labels.data(), Shape{rows}}; }
  /// Rows [first, first + count) as a batch of their own.
  Batch slice(index_t first, index_t count) const {
    Batch b{count, features, {}, {}};
    b.x.assign(x.begin() + first * features, x.begin() + (first + count) * features);
    b.labels.assign(labels.begin() + first, labels.begin() + first + count);
    return b;
  }
};

inline Batch make_batch(index_t rows, index_t features, index_t classes, std::uint64_t seed) {
  Rng rng(seed);
  Batch b{rows, features, std::vector<double>(std::size_t(rows * features)), std::vector<std::int32_t>(std::size_t(rows))};
  for (double& v : b.x) v = rng.uniform(-1.0, 1.0);
  for (auto& l : b.labels) l = std::int32_t(std::min<index_t>(index_t(rng.uniform() * double(classes)), classes - 1));
  return b;
}

/// max |a - b| / max |b|: relative to the reference's scale, so tiny entries do not dominate.
inline double relative_difference(std::span<const double> a, std::span<const double> b) {
  REQUIRE(a.size() == b.size());
  double diff = 0, scale = 0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    diff = std::max(diff, std::abs(a[i] - b[i]));
    scale = std::max(scale, std::abs(b[i]));
  }
  return scale > 0 ? diff / scale : diff;
}

inline bool bitwise_equal(std::span<const double> a, std::span<const double> b) {
  return a.size() == b.size() && (a.empty() || std::memcmp(a.data(), b.data(), a.size_bytes()) == 0);
}

/// The update a flush pipeline applies, done by hand on a Network: global-norm clipping, then the
/// optimizer on the whole parameter array, tensor by tensor as its decay_on says (optim::update_runs).
/// `slots` persist across calls; `step` is 0-based.
template <class Net, class Optimizer>
double reference_update(Net& net, const Optimizer& optimizer, std::vector<std::vector<double>>& slots, std::int64_t step) {
  constexpr index_t count = Net::Body::param_count;
  if (slots.empty()) slots.assign(Optimizer::slot_names.size(), std::vector<double>(std::size_t(count), 0.0));
  std::vector<TensorView<double>> views;
  for (auto& s : slots) views.push_back({s.data(), Shape{count}});
  const ConstView<double> grads{net.gradient_data(), Shape{count}};
  // A tied tensor (GPT-2's wte and lm_head) is one parameter: its copies take the summed gradient,
  // and it counts once in the norm.
  net.sum_tied_gradients();
  double squares = sum_of_squares(net.backend(), grads);
  if constexpr (Net::tied.count > 0)
    squares -= sum_of_squares(net.backend(), ConstView<double>{net.gradient_data() + Net::tied.second, Shape{Net::tied.count}});
  const double norm = std::sqrt(squares);
  const std::vector<optim::DecayRun> runs = optim::decay_runs(Net::parameter_table());
  optim::update_runs(optimizer, std::span<const optim::DecayRun>(runs), 0, net.backend(),
                     TensorView<double>{net.parameter_data(), Shape{count}}, grads, std::span<const TensorView<double>>(views),
                     step, optim::clip_factor(norm, optimizer.clip_norm()));
  return norm;
}

/// Runs `call` on another thread and fails the whole test binary if it has not returned after
/// `seconds`: a pipeline that deadlocks must not hang the test suite.
template <class Call>
auto bounded(double seconds, Call&& call) {
  auto done = std::async(std::launch::async, std::forward<Call>(call));
  if (done.wait_for(std::chrono::duration<double>(seconds)) != std::future_status::ready) {
    std::fprintf(stderr, "pipeline call did not return within %.1f s: the runtime hangs\n", seconds);
    std::fflush(stderr);
    std::abort();
  }
  return done.get();
}

// Layers for runtime tests whose work is a sleep: identities of known duration.

/// Behaviour of the Knob<Id> layers, set by each test before it runs a step.
struct Knobs {
  std::atomic<int> forward_us{0};
  std::atomic<int> backward_us{0};
  std::atomic<bool> fail_on_marker{false};
};
inline std::array<Knobs, 12> knobs;
inline constexpr double marker = 999.0;

inline void reset_knobs() {
  for (Knobs& k : knobs) {
    k.forward_us = 0;
    k.backward_us = 0;
    k.fail_on_marker = false;
  }
}

/// Knob<Id>'s hooks: the sleeps and the failure knobs[Id] sets.
template <int Id>
struct KnobHooks : NoHooks {
  static void forward(const auto& x) {
    using T = std::remove_cvref_t<decltype(x[0])>;
    if (knobs[Id].fail_on_marker && x.numel() > 0 && x[0] == T(marker)) CUPIPE_THROW("injected failure");
    std::this_thread::sleep_for(std::chrono::microseconds(knobs[Id].forward_us.load()));
  }
  static void backward_input(const auto&) {
    std::this_thread::sleep_for(std::chrono::microseconds(knobs[Id].backward_us.load()));
  }
};

/// An identity that sleeps a set time in forward and in backward_input, and can throw in forward on
/// the microbatch whose first value is `marker` (identities upstream pass it through unchanged).
template <int Id>
struct Knob : Identity<KnobHooks<Id>> {
  static constexpr double forward_flops_per_sample(index_t in) { return double(in); }
  static std::string describe() { return "Knob<" + std::to_string(Id) + ">"; }
};

/// A fixed-width identity: a model must start with a known input width.
template <index_t W>
struct Entry : Identity<> {
  static constexpr index_t in_features = W;
  static constexpr double forward_flops_per_sample(index_t) { return W; }
  static std::string describe() { return "Entry<" + std::to_string(W) + ">"; }
};

/// The message of the cupipe::error `call` throws; fails when it throws nothing.
template <class Call>
std::string error_message(Call&& call) {
  try {
    call();
  } catch (const error& e) {
    return e.message();
  }
  FAIL("expected a cupipe::error");
  return {};
}

}  // namespace cupipe::test
