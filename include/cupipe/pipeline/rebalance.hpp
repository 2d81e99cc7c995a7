// SPDX-License-Identifier: Apache-2.0
// Profiled rebalancing: time every layer's forward and backward on real inputs, then search the
// contiguous splits of the layers into the same number of stages for the one whose simulated
// makespan (under the pipeline's own plan) is smallest. The current split is always a candidate,
// so the proposal never predicts worse than what runs now.
#pragma once

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include <unistd.h>

#include "cupipe/backend/staging.hpp"
#include "cupipe/core/error.hpp"
#include "cupipe/core/rng.hpp"
#include "cupipe/core/tensor_group.hpp"
#include "cupipe/layers/sequential.hpp"
#include "cupipe/pipeline/stage_list.hpp"
#include "cupipe/schedule/simulate.hpp"

namespace cupipe {

/// Measured seconds per layer for one microbatch of the profiled size.
struct LayerProfile {
  std::vector<std::string> names;
  std::vector<double> forward;
  std::vector<double> backward_input;
  std::vector<double> backward_weight;
  index_t rows = 0;
  /// With a tensor-parallel group (profile_layers' `group`): per layer, the values one run of its
  /// forward and of its input gradient summed over the group, and how many sums each ran.
  std::vector<double> sum_forward, sum_backward, sum_forward_calls, sum_backward_calls;
};

/// A tensor-parallel group that counts what its ranks would sum and passes the sums on to `inner`
/// (none: a rank's part timed alone, the sums counted but not run; its values then stay one rank's
/// partial sums, which changes no layer's cost). Without `inner`, `device_memory` says whether it
/// takes device memory as a real group would (NCCL does): a CUDA part is then timed without the
/// copies to the host and back that tensor_group_sum makes for a host-memory group.
class CountingGroup final : public TensorGroup {
 public:
  CountingGroup(int size, int rank, TensorGroup* inner = nullptr, bool device_memory = false)
      : size_(size), rank_(rank), inner_(inner), device_memory_(device_memory) {
    CUPIPE_REQUIRE(size >= 1 && rank >= 0 && rank < size, "CountingGroup: rank ", rank, " of a group of ", size);
  }
  int size() const override { return size_; }
  int rank() const override { return rank_; }
  void sum(float* data, std::size_t count) override { count_and_sum(data, count); }
  void sum(double* data, std::size_t count) override { count_and_sum(data, count); }
  bool device_memory() const override { return inner_ ? inner_->device_memory() : device_memory_; }
  double values = 0, calls = 0;  ///< since the last reset()
  void reset() { values = calls = 0; }

 private:
  template <class T>
  void count_and_sum(T* data, std::size_t count) {
    values += double(count);
    calls += 1;
    if (inner_) inner_->sum(data, count);
  }
  int size_, rank_;
  TensorGroup* inner_;
  bool device_memory_;
};

struct RebalanceProposal {
  std::vector<std::string> layer_names;
  std::vector<std::size_t> current;   ///< first layer of each stage, then the layer count
  std::vector<std::size_t> proposed;  ///< same form
  double current_makespan = 0;        ///< predicted by the simulator from the profile
  double proposed_makespan = 0;       ///< predicted by the simulator from the profile
};

/// First layer index of each stage of a StageList, then the total layer count.
template <class Stages>
std::vector<std::size_t> stage_cuts() {
  std::vector<std::size_t> cuts;
  [&]<std::size_t... K>(std::index_sequence<K...>) {
    (cuts.push_back(Stages::template stage<K>::first_index), ...);
  }(std::make_index_sequence<Stages::size>());
  using last = typename Stages::template stage<Stages::size - 1>;
  cuts.push_back(last::first_index + last::size);
  return cuts;
}

/// "Linear<784, 1024>, ReLU" for stage k (run-time k).
template <class Stages>
std::string stage_description(int k) {
  std::string out;
  [&]<std::size_t... K>(std::index_sequence<K...>) {
    ((int(K) == k ? (out = Stages::template stage<K>::describe(), 0) : 0), ...);
  }(std::make_index_sequence<Stages::size>());
  return out;
}

namespace detail {
/// The median of `values` (the upper one of an even count); at least one value.
inline double median(std::vector<double> values) {
  std::nth_element(values.begin(), values.begin() + std::ptrdiff_t(values.size() / 2), values.end());
  return values[values.size() / 2];
}

template <class F>
double median_seconds(int repeats, F&& f) {
  std::vector<double> times;
  for (int r = 0; r < std::max(repeats, 1); ++r) {
    const auto start = std::chrono::steady_clock::now();
    f();
    times.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
  }
  return median(std::move(times));
}

/// Bytes evict_host_caches reads: this CPU's last two cache levels as the OS reports them (32 MiB
/// where it does not), 8 to 64 MiB.
inline std::size_t eviction_bytes() {
  long cached = 0;
#if defined(_SC_LEVEL3_CACHE_SIZE) && defined(_SC_LEVEL2_CACHE_SIZE)
  cached = std::max(0L, sysconf(_SC_LEVEL3_CACHE_SIZE)) + std::max(0L, sysconf(_SC_LEVEL2_CACHE_SIZE));
#endif
  if (cached <= 0) cached = 32L << 20;
  return std::clamp<std::size_t>(std::size_t(cached), std::size_t(8) << 20, std::size_t(64) << 20);
}

/// Reads a buffer larger than the CPU's caches (eviction_bytes), one value per 64-byte line, so
/// that what runs next finds its weights and inputs in memory, not in a cache. Reads only: no dirty
/// lines are left to be written back during what is timed next. One buffer per thread.
inline void evict_host_caches() {
  thread_local const std::vector<std::uint64_t> buffer(eviction_bytes() / sizeof(std::uint64_t), 1);
  std::uint64_t sum = 0;
  for (std::size_t i = 0; i < buffer.size(); i += 64 / sizeof(std::uint64_t)) sum += buffer[i];
  [[maybe_unused]] volatile std::uint64_t sink = sum;
}
}  // namespace detail

/// Times each layer of `Body` on `x_host` (one microbatch of real inputs, in host memory) on a fresh
/// context of `Backend`, median of `repeats` runs. A tensor-parallel Body runs on `group` (a
/// CountingGroup of one rank's place: each layer's sums are counted into the profile).
///
/// Each run goes in step order, as a stage runs a microbatch: every forward, then every input and
/// weight gradient from the last layer, each action timed alone. With `cold_caches` (host backends)
/// each run starts by evicting the CPU's caches (detail::evict_host_caches, untimed): inside a step
/// a layer's input is warm (the action before wrote it) and its weights are not (the step read
/// every other layer's data since their last use). Against each action timed back to back with warm
/// caches, the MLP's forwards took 12-37% longer inside its steps, and its backwards 7-20%, on a
/// 2-core EPYC VM (docs/benchmarks.md, 2026-11-28). Device backends are timed without eviction.
template <class Body, class Backend>
LayerProfile profile_layers(ConstView<typename Body::template input_t<typename Backend::value_type>> x_host, int repeats = 5,
                            CountingGroup* group = nullptr, bool cold_caches = true) {
  using T = typename Backend::value_type;
  using space = typename Backend::space;
  Backend be;
  be.tensor_group = group;
  const index_t rows = x_host.rows();
  auto params = be.template allocate<T>(Body::param_count, MemoryTag::weights);
  auto grads = be.template allocate<grad_t<Backend>>(Body::param_count, MemoryTag::gradients);
  Body::init_on(be, params.data(), 0);
  backend::Staging<Backend, typename Body::template input_t<T>> staging;
  const auto x = staging(be, x_host);
  auto record = be.template allocate<T>(Body::record_elements(rows), MemoryTag::activations);
  Body::forward(be, params.data(), x, record.data());
  // Output gradients with realistic magnitudes: what backward really sees is data-dependent only in
  // its values, not its cost, so random ones serve.
  index_t widest = 0;
  for (index_t w : Body::widths) widest = std::max(widest, w);
  std::vector<T> random(static_cast<std::size_t>(rows * widest));
  Rng rng(1);
  for (T& v : random) v = T(rng.normal());
  auto dy = be.template allocate<T>(rows * widest, MemoryTag::workspace);
  auto dx = be.template allocate<T>(rows * widest, MemoryTag::workspace);
  be.upload(std::span<const T>(random), dy.data());

  LayerProfile profile;
  profile.rows = rows;
  constexpr std::size_t n = Body::size;
  const int runs = std::max(repeats, 1);
  const bool cold = cold_caches && host_accessible<space>;
  // Per layer and action (0 forward, 1 input gradient, 2 weight gradient): each run's seconds; per
  // layer, the group's sums over all runs of its forward and input gradient.
  std::vector<double> seconds[3], values[2], calls[2];
  for (int a = 0; a < 3; ++a) seconds[a].assign(n * std::size_t(runs), 0.0);
  for (int a = 0; a < 2; ++a) values[a].assign(n, 0.0), calls[a].assign(n, 0.0);
  const auto timed = [&](int action, std::size_t layer, int run, auto&& work) {
    if (group) group->reset();
    const auto start = std::chrono::steady_clock::now();
    work();
    be.synchronize();
    seconds[action][layer * std::size_t(runs) + std::size_t(run)] =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    if (group && action < 2) values[action][layer] += group->values, calls[action][layer] += group->calls;
    if (group) group->reset();
  };
  T* rec = record.data();
  // Layer I's input: the batch, or the activation the layer before it wrote into the record.
  const auto input_of = [&]<std::size_t I>(std::integral_constant<std::size_t, I>) {
    if constexpr (I == 0) return x;
    else return ConstViewOn<Backend, T>(Body::template activation<space>(rec, rows, I));
  };
  const auto forward = [&]<std::size_t I>(std::integral_constant<std::size_t, I> layer, int run) {
    using L = typename Body::template layer<I>;
    timed(0, I, run, [&] {
      L::forward(be, params.data() + Body::param_offsets[I], input_of(layer), Body::template activation<space>(rec, rows, I + 1),
                 Body::template saved<space>(rec, rows, I));
    });
  };
  const auto backward = [&]<std::size_t I>(std::integral_constant<std::size_t, I> layer, int run) {
    using L = typename Body::template layer<I>;
    const T* p = params.data() + Body::param_offsets[I];
    const auto input = input_of(layer);
    const ViewOn<Backend, T> saved = Body::template saved<space>(rec, rows, I);
    const ConstViewOn<Backend, T> g{dy.data(), Shape{rows, Body::widths[I + 1]}};
    // The first layer has no input gradient; Sequential still runs its backward_input (with no
    // dx) where its weight gradient needs it (weight_grads_need_backward_input).
    if constexpr (I > 0)
      timed(1, I, run, [&] { L::backward_input(be, p, input, saved, g, ViewOn<Backend, T>{dx.data(), Shape{rows, Body::widths[I]}}); });
    else if constexpr (weight_grads_need_backward_input<L>())
      timed(1, I, run, [&] { L::backward_input(be, p, input, saved, g, ViewOn<Backend, T>{}); });
    timed(2, I, run, [&] { L::backward_weight(be, input, saved, g, grads.data() + Body::param_offsets[I]); });
  };
  // In step order, as a stage runs a microbatch: every layer's forward, first to last, then each
  // layer's input and weight gradients, last to first. Each action is timed alone, and reads
  // what the actions before it left in the caches, as it would in a step (a layer's input, just
  // written; the next layer's gradient); with cold_caches each run starts from caches that hold
  // none of it.
  for (int run = 0; run < runs; ++run) {
    if (cold) detail::evict_host_caches();
    [&]<std::size_t... I>(std::index_sequence<I...>) {
      (forward(std::integral_constant<std::size_t, I>{}, run), ...);
      (backward(std::integral_constant<std::size_t, n - 1 - I>{}, run), ...);
    }(std::make_index_sequence<n>());
  }
  [&]<std::size_t... I>(std::index_sequence<I...>) { (profile.names.push_back(Body::template describe_layer<I>()), ...); }(
      std::make_index_sequence<n>());
  std::vector<double>* medians[3] = {&profile.forward, &profile.backward_input, &profile.backward_weight};
  for (int a = 0; a < 3; ++a)
    for (std::size_t l = 0; l < n; ++l)
      medians[a]->push_back(detail::median(std::vector<double>(seconds[a].begin() + std::ptrdiff_t(l * std::size_t(runs)),
                                                               seconds[a].begin() + std::ptrdiff_t((l + 1) * std::size_t(runs)))));
  // The sums one run makes.
  for (std::size_t l = 0; l < n; ++l) {
    profile.sum_forward.push_back(values[0][l] / runs);
    profile.sum_forward_calls.push_back(calls[0][l] / runs);
    profile.sum_backward.push_back(values[1][l] / runs);
    profile.sum_backward_calls.push_back(calls[1][l] / runs);
  }
  return profile;
}

namespace detail {

/// Simulated makespan of `plan` when virtual stage k runs layers [cuts[k], cuts[k+1]).
inline double predicted_makespan(const schedule::Plan& plan, const LayerProfile& profile, const std::vector<std::size_t>& cuts) {
  const int stages = plan.config.stages, chunks = plan.config.chunks;
  schedule::Costs costs;
  costs.per_stage.assign(std::size_t(stages), schedule::StageCosts{0, 0, 0, 0});
  for (std::size_t k = 0; k + 1 < cuts.size(); ++k) {
    schedule::StageCosts& c = costs.per_stage[k % std::size_t(stages)];
    for (std::size_t i = cuts[k]; i < cuts[k + 1]; ++i) {
      c.forward += profile.forward[i];
      if (plan.split_backward) {
        c.backward += profile.backward_input[i];
        c.weight += profile.backward_weight[i];
      } else {
        c.backward += profile.backward_input[i] + profile.backward_weight[i];
      }
    }
  }
  (void)chunks;  // a stage's cost is the sum of its chunks; the simulator gives each chunk 1/V of it
  return schedule::simulate(plan, costs).makespan;
}

inline void each_split(std::size_t layers, std::size_t parts, std::vector<std::size_t>& cuts, std::size_t k,
                       const std::function<void(const std::vector<std::size_t>&)>& visit) {
  if (k == parts) {
    visit(cuts);
    return;
  }
  for (std::size_t next = cuts[k - 1] + 1; next + (parts - k) <= layers; ++next) {
    cuts[k] = next;
    each_split(layers, parts, cuts, k + 1, visit);
  }
}

}  // namespace detail

/// Proposes the split of the profiled layers that minimises the simulated makespan of `plan`.
inline RebalanceProposal rebalance(const schedule::Plan& plan, const LayerProfile& profile, std::vector<std::size_t> current) {
  const std::size_t layers = profile.forward.size();
  CUPIPE_REQUIRE(current.size() >= 2 && current.front() == 0 && current.back() == layers, "rebalance: the current split ",
                 "must start at layer 0 and end at layer ", layers);
  // Stage k's layers go to worker k % stages: a split with another stage count would be priced as
  // if several of its stages ran on one worker, and proposed as if it fit the plan.
  CUPIPE_REQUIRE(int(current.size()) - 1 == plan.config.virtual_stages(), "rebalance: the current split has ",
                 current.size() - 1, " stages but the plan runs ", plan.config.virtual_stages(), " (virtual) stages");
  for (std::size_t k = 0; k + 1 < current.size(); ++k)
    CUPIPE_REQUIRE(current[k] < current[k + 1], "rebalance: stage ", k, " of the current split is empty (it starts at layer ",
                   current[k], " and the next stage at layer ", current[k + 1], ")");
  RebalanceProposal out;
  out.layer_names = profile.names;
  out.current = current;
  out.current_makespan = detail::predicted_makespan(plan, profile, current);
  out.proposed = current;
  out.proposed_makespan = out.current_makespan;
  const std::size_t parts = current.size() - 1;
  std::vector<std::size_t> cuts(parts + 1, 0);
  cuts[parts] = layers;
  detail::each_split(layers, parts, cuts, 1, [&](const std::vector<std::size_t>& candidate) {
    const double makespan = detail::predicted_makespan(plan, profile, candidate);
    if (makespan < out.proposed_makespan) {
      out.proposed_makespan = makespan;
      out.proposed = candidate;
    }
  });
  return out;
}

/// Both splits, stage by stage, with both predicted makespans.
inline std::string describe(const RebalanceProposal& p) {
  auto split = [&](const std::vector<std::size_t>& cuts) {
    std::string out;
    for (std::size_t k = 0; k + 1 < cuts.size(); ++k) {
      out += "  stage " + std::to_string(k) + ":";
      for (std::size_t i = cuts[k]; i < cuts[k + 1]; ++i) out += (i == cuts[k] ? " " : ", ") + p.layer_names[i];
      out += "\n";
    }
    return out;
  };
  char line[160];
  std::string out = "current split:\n" + split(p.current);
  std::snprintf(line, sizeof line, "  predicted makespan %.3f ms per step (simulated from profiled layer times)\n",
                p.current_makespan * 1e3);
  out += line;
  out += p.proposed == p.current ? std::string("proposed split: keep the current split\n") : "proposed split:\n" + split(p.proposed);
  std::snprintf(line, sizeof line, "  predicted makespan %.3f ms per step (%.1f%% of current)\n", p.proposed_makespan * 1e3,
                p.current_makespan > 0 ? 100 * p.proposed_makespan / p.current_makespan : 100.0);
  return out + line;
}

}  // namespace cupipe
