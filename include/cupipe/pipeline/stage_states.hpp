// SPDX-License-Identifier: Apache-2.0
// StageStates: the states of every virtual stage of a StageList, each a different type, held in one
// tuple; null where the stage runs in another process. Visits them with their compile-time index,
// and reads or writes all their parameters in the whole model's flat layout.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "cupipe/comm/communicator.hpp"
#include "cupipe/core/error.hpp"
#include "cupipe/pipeline/stage_state.hpp"

namespace cupipe::pipeline {

/// `Backends::at<K>` is virtual stage K's backend (its worker's): one type for every stage, or one
/// per worker with backend::PerWorker.
template <class Stages, class Backends, int MaxVersions>
class StageStates {
  template <std::size_t K>
  using state_at = StageState<typename Stages::template stage<K>, typename Backends::template at<int(K)>, MaxVersions>;
  template <std::size_t... K>
  static auto make(std::index_sequence<K...>) -> std::tuple<std::unique_ptr<state_at<K>>...>;
  template <std::size_t... K>
  static auto compute(std::index_sequence<K...>) -> std::common_type_t<typename state_at<K>::G...>;
  template <std::size_t... K>
  static constexpr bool same_backends(std::index_sequence<K...>) {
    return (std::is_same_v<typename Backends::template at<0>, typename Backends::template at<int(K)>> && ...);
  }
  using Tuple = decltype(make(std::make_index_sequence<Stages::size>()));

 public:
  /// Whether every stage has the same backend type.
  static constexpr bool uniform = same_backends(std::make_index_sequence<Stages::size>());
  /// What gather and scatter move (master weights, gradients, slots): the stages' compute type, or
  /// with stages of several, the widest (each stage's values convert exactly to it).
  using G = decltype(compute(std::make_index_sequence<Stages::size>()));
  /// Whether any stage keeps master weights beside narrower ones in use (bf16 storage).
  static constexpr bool master_weights = []<std::size_t... K>(std::index_sequence<K...>) {
    return (state_at<K>::master_weights || ...);
  }(std::make_index_sequence<Stages::size>());
  /// The stages' backend type where they share one (void otherwise).
  using backend_type = std::conditional_t<uniform, typename Backends::template at<0>, void>;
  static constexpr int size = int(Stages::size);
  static constexpr index_t param_count = Stages::model::body::param_count;

  /// Every virtual stage, in order, with its (possibly null, when remote) state pointer.
  template <class F>
  void for_each_slot(F&& f) {
    [&]<std::size_t... K>(std::index_sequence<K...>) {
      (f(std::integral_constant<int, int(K)>{}, std::get<K>(states_)), ...);
    }(std::make_index_sequence<Stages::size>());
  }
  /// Every virtual stage that runs in this process.
  template <class F>
  void for_each(F&& f) {
    for_each_slot([&](auto k, auto& slot) {
      if (slot) f(k, *slot);
    });
  }
  /// Calls f(integral_constant<K>, state) for the virtual stage k known only at run time.
  template <class F>
  void visit(int k, F&& f) {
    [&]<std::size_t... K>(std::index_sequence<K...>) {
      ((int(K) == k ? (f(std::integral_constant<int, int(K)>{}, *std::get<K>(states_)), 0) : 0), ...);
    }(std::make_index_sequence<Stages::size>());
  }

  /// Makes the state of every virtual stage whose worker (`WorkerAt(k)`) has a context in
  /// `contexts`: `versions[w]` weight versions on worker w, recompute where `recompute` names the
  /// stage, parameters drawn from `seed` (tensor-parallel rank `tp_rank` draws its part of the
  /// whole model's), and with ZeRO (`zero` stage 1 to 3, over the replicas of `comm`) this replica's
  /// shard of the optimizer state (ZeRO-2: and of the summed gradients; ZeRO-3: and of the weights).
  template <auto WorkerAt, class Contexts>
  void build(Contexts& contexts, const std::vector<int>& versions, const std::vector<int>& recompute,
             std::uint64_t seed, int tp_rank, int zero = 0, const comm::Communicator* comm = nullptr) {
    const int replicas = zero > 0 && comm ? comm->topology().replicas : 1;
    const int replica = replicas > 1 ? comm->topology().replica() : 0;
    for_each_slot([&](auto k, auto& slot) {
      constexpr int K = decltype(k)::value;
      constexpr int w = WorkerAt(K);
      if (!contexts.present(w)) return;
      using Seq = typename Stages::template stage<K>;
      auto& be = *contexts.template get<w>();
      const bool again = std::find(recompute.begin(), recompute.end(), K) != recompute.end();
      slot = std::make_unique<std::remove_reference_t<decltype(*slot)>>(be, versions[std::size_t(w)], again);
      Seq::init_on(be, slot->master_data(), seed, tp_rank);
      slot->publish_master(slot->weights.latest_data());
      if (replicas > 1) slot->shard = Shard::of(Seq::param_count, replicas, replica);
      if (replicas > 1 && zero >= 2) slot->shard_gradients();
      if (replicas > 1 && zero >= 3) slot->shard_parameters();
    });
  }

  /// Offset of virtual stage K's parameters in the whole model's flat layout.
  template <int K>
  static constexpr index_t model_offset() {
    return []<std::size_t... J>(std::index_sequence<J...>) {
      return (index_t{0} + ... + Stages::template stage<J>::param_count);
    }(std::make_index_sequence<std::size_t(K)>());
  }

  /// The whole model's flat array from each local stage's slice (`pointer(state)`, in the stage's
  /// compute type); slices of stages in other processes stay zero.
  template <class Pointer>
  std::vector<G> gather(Pointer pointer) {
    std::vector<G> out(static_cast<std::size_t>(param_count), G(0));
    for_each([&](auto k, auto& st) {
      const std::span<G> slice(out.data() + model_offset<decltype(k)::value>(), std::size_t(st.param_count));
      download_as(st, pointer(st), slice);
    });
    return out;
  }
  template <class Pointer>
  void scatter(std::span<const G> values, Pointer pointer) {
    CUPIPE_REQUIRE(index_t(values.size()) == param_count, "Pipeline: got ", values.size(), " values for a model of ",
                   param_count, " parameters");
    for_each([&](auto k, auto& st) {
      upload_as(st, values.subspan(std::size_t(model_offset<decltype(k)::value>()), std::size_t(st.param_count)), pointer(st));
    });
  }

  /// Stage values (`from`, in the stage's memory and compute type) into `to` in host memory as U.
  template <class St, class U>
  static void download_as(St& st, const typename St::G* from, std::span<U> to) {
    if constexpr (std::is_same_v<typename St::G, U>) {
      st.be->download(from, to);
    } else {
      std::vector<typename St::G> own(to.size());
      st.be->download(from, std::span<typename St::G>(own));
      std::transform(own.begin(), own.end(), to.begin(), [](auto v) { return U(v); });
    }
  }
  /// Host values as U into stage memory as the stage's compute type (rounded to nearest where it is
  /// narrower).
  template <class St, class U>
  static void upload_as(St& st, std::span<const U> from, typename St::G* to) {
    using SG = typename St::G;
    if constexpr (std::is_same_v<SG, U>) {
      st.be->upload(from, to);
    } else {
      std::vector<SG> own(from.size());
      std::transform(from.begin(), from.end(), own.begin(), [](U v) { return SG(v); });
      st.be->upload(std::span<const SG>(own), to);
    }
  }

 private:
  Tuple states_;
};

}  // namespace cupipe::pipeline
