// SPDX-License-Identifier: Apache-2.0
// StageStates: the states of every virtual stage of a StageList, each a different type, held in one
// tuple; null where the stage runs in another process. Visits them with their compile-time index,
// and reads or writes all their parameters in the whole model's flat layout.
#pragma once

#include <cstddef>
#include <memory>
#include <span>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "cupipe/core/error.hpp"
#include "cupipe/pipeline/stage_state.hpp"

namespace cupipe::pipeline {

template <class Stages, class Backend, int MaxVersions>
class StageStates {
  template <std::size_t... K>
  static auto make(std::index_sequence<K...>)
      -> std::tuple<std::unique_ptr<StageState<typename Stages::template stage<K>, Backend, MaxVersions>>...>;
  using Tuple = decltype(make(std::make_index_sequence<Stages::size>()));

 public:
  using T = typename Backend::value_type;
  using G = grad_t<Backend>;  ///< what gather and scatter move: master weights, gradients, slots
  using backend_type = Backend;
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

  /// Offset of virtual stage K's parameters in the whole model's flat layout.
  template <int K>
  static constexpr index_t model_offset() {
    return []<std::size_t... J>(std::index_sequence<J...>) {
      return (index_t{0} + ... + Stages::template stage<J>::param_count);
    }(std::make_index_sequence<std::size_t(K)>());
  }

  /// The whole model's flat array from each local stage's slice (`pointer(state)`); slices of stages
  /// in other processes stay zero.
  template <class Pointer>
  std::vector<G> gather(Pointer pointer) {
    std::vector<G> out(static_cast<std::size_t>(param_count), G(0));
    for_each([&](auto k, auto& st) {
      constexpr int K = decltype(k)::value;
      st.be->download(pointer(st), std::span<G>(out.data() + model_offset<K>(), std::size_t(st.param_count)));
    });
    return out;
  }
  template <class Pointer>
  void scatter(std::span<const G> values, Pointer pointer) {
    CUPIPE_REQUIRE(index_t(values.size()) == param_count, "Pipeline: got ", values.size(), " values for a model of ",
                   param_count, " parameters");
    for_each([&](auto k, auto& st) {
      constexpr int K = decltype(k)::value;
      st.be->upload(values.subspan(std::size_t(model_offset<K>()), std::size_t(st.param_count)), pointer(st));
    });
  }

 private:
  Tuple states_;
};

}  // namespace cupipe::pipeline
