// SPDX-License-Identifier: Apache-2.0
// Profiled rebalancing: time every layer's forward and backward on real inputs, then search the
// contiguous splits of the layers into the same number of stages for the one whose simulated
// makespan (under the pipeline's own plan) is smallest. The current split is always a candidate,
// so the proposal never predicts worse than what runs now.
#pragma once

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <functional>
#include <span>
#include <string>
#include <utility>
#include <vector>

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
}  // namespace detail

/// Times each layer of `Body` on `x_host` (one microbatch of real inputs, in host memory) on a fresh
/// context of `Backend`, median of `repeats` runs. A tensor-parallel Body runs on `group` (a
/// CountingGroup of one rank's place: each layer's sums are counted into the profile).
template <class Body, class Backend>
LayerProfile profile_layers(ConstView<typename Body::template input_t<typename Backend::value_type>> x_host, int repeats = 5,
                            CountingGroup* group = nullptr) {
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
  [&]<std::size_t... I>(std::index_sequence<I...>) {
    ((void)[&] {
      using L = typename Body::template layer<I>;
      const T* p = params.data() + Body::param_offsets[I];
      T* rec = record.data();
      auto input = [&] {
        if constexpr (I == 0) return x;
        else return ConstViewOn<Backend, T>(Body::template activation<space>(rec, rows, I));
      }();
      const ViewOn<Backend, T> saved = Body::template saved<space>(rec, rows, I);
      const ConstViewOn<Backend, T> g{dy.data(), Shape{rows, Body::widths[I + 1]}};
      profile.names.push_back(Body::template describe_layer<I>());
      const int runs = std::max(repeats, 1);  // median_seconds' runs
      // The sums one run makes, from the group's counts over `runs` runs.
      const auto count = [&](std::vector<double>& values, std::vector<double>& calls) {
        values.push_back(group ? group->values / runs : 0.0);
        calls.push_back(group ? group->calls / runs : 0.0);
        if (group) group->reset();
      };
      if (group) group->reset();
      profile.forward.push_back(detail::median_seconds(repeats, [&] {
        L::forward(be, p, input, Body::template activation<space>(rec, rows, I + 1), saved);
        be.synchronize();
      }));
      count(profile.sum_forward, profile.sum_forward_calls);
      // The first layer has no input gradient; Sequential still runs its backward_input (with no
      // dx) where its weight gradient needs it (weight_grads_need_backward_input).
      constexpr bool timed_b = I > 0 || weight_grads_need_backward_input<L>();
      profile.backward_input.push_back(!timed_b ? 0.0 : detail::median_seconds(repeats, [&] {
        if constexpr (I > 0) L::backward_input(be, p, input, saved, g, ViewOn<Backend, T>{dx.data(), Shape{rows, Body::widths[I]}});
        else if constexpr (timed_b) L::backward_input(be, p, input, saved, g, ViewOn<Backend, T>{});
        be.synchronize();
      }));
      count(profile.sum_backward, profile.sum_backward_calls);
      profile.backward_weight.push_back(detail::median_seconds(repeats, [&] {
        L::backward_weight(be, input, saved, g, grads.data() + Body::param_offsets[I]);
        be.synchronize();
      }));
    }(), ...);
  }(std::make_index_sequence<Body::size>());
  return profile;
}

namespace detail {

/// Simulated makespan of `plan` when virtual stage k runs layers [cuts[k], cuts[k+1]).
inline double predicted_makespan(const schedule::Plan& plan, const LayerProfile& profile, const std::vector<std::size_t>& cuts) {
  const int stages = plan.config.stages, chunks = plan.config.chunks;
  schedule::Costs costs;
  costs.per_stage.assign(std::size_t(stages), schedule::StageCosts{0, 0, 0});
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
