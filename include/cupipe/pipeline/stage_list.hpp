// SPDX-License-Identifier: Apache-2.0
// Stage lists: a model split into pipeline stages, by hand (StageList<Stage<...>, ...>) or by the
// compile-time cost model (partition<Model, P>). Layers keep their index in the whole model, so
// parameter names, initialisation and checkpoints do not depend on the split.
#pragma once

#include <algorithm>
#include <array>
#include <cstddef>
#include <tuple>
#include <type_traits>
#include <utility>

#include "cupipe/layers/network.hpp"
#include "cupipe/layers/sequential.hpp"

namespace cupipe {

/// The layers of one pipeline stage, in order.
template <class... Layers>
struct Stage {
  static_assert(sizeof...(Layers) > 0, "Stage<>: a pipeline stage needs at least one layer (empty stages are not allowed)");
  static constexpr std::size_t size = sizeof...(Layers);
};

/// Instantiated for each pair of neighbouring stages. When the sizes differ, the compiler shows
/// this template with both stage indices and both sizes, under one sentence.
template <std::size_t PreviousStage, index_t PreviousOutFeatures, std::size_t NextStage, index_t NextInFeatures>
struct stage_boundary_fits {
  static_assert(PreviousOutFeatures == NextInFeatures,
                "StageList: a stage's output features must equal the next stage's input features (the stage "
                "indices and both sizes are the arguments of stage_boundary_fits<previous stage, its output "
                "features, next stage, its input features> named above)");
  static constexpr bool value = PreviousOutFeatures == NextInFeatures;
};

namespace detail {

template <class... Ts>
struct type_list {
  static constexpr std::size_t size = sizeof...(Ts);
};

template <class A, class B>
struct concat;
template <class... A, class... B>
struct concat<type_list<A...>, type_list<B...>> {
  using type = type_list<A..., B...>;
};

template <class S>
struct stage_layers;
template <class... Ls>
struct stage_layers<Stage<Ls...>> {
  using type = type_list<Ls...>;
};

template <class List>
struct last_is_loss;
template <class... Ls>
struct last_is_loss<type_list<Ls...>> {
  static constexpr bool value = std::tuple_element_t<sizeof...(Ls) - 1, std::tuple<Ls...>>::is_loss;
};

template <class List, class Indices>
struct take;
template <class... Ls, std::size_t... I>
struct take<type_list<Ls...>, std::index_sequence<I...>> {
  using type = type_list<std::tuple_element_t<I, std::tuple<Ls...>>...>;
};

template <class List>
struct front;
template <class L0, class... Ls>
struct front<type_list<L0, Ls...>> {
  using type = L0;
};

template <class List>
struct back;
template <class... Ls>
struct back<type_list<Ls...>> {
  using type = std::tuple_element_t<sizeof...(Ls) - 1, std::tuple<Ls...>>;
};

template <std::size_t First, index_t In, class List>
struct seq_of;
template <std::size_t First, index_t In, class... Ls>
struct seq_of<First, In, type_list<Ls...>> {
  using type = LayerSeq<First, In, Ls...>;
};

template <class List>
struct sequential_of;
template <class... Ls>
struct sequential_of<type_list<Ls...>> {
  using type = Sequential<Ls...>;
};

template <std::size_t K, index_t PreviousOut, class FirstLayer>
constexpr bool boundary_ok() {
  if constexpr (FirstLayer::in_features == any_features) return true;
  else return stage_boundary_fits<K - 1, PreviousOut, K, FirstLayer::in_features>::value;
}

}  // namespace detail

/// Stages in pipeline order. stage<k> is stage k's LayerSeq (numbered within the whole model); a loss
/// layer ending the last stage is split off as `loss`. `model` is the whole, unsplit Sequential.
template <class... Stages>
struct StageList {
  static_assert(sizeof...(Stages) > 0, "StageList<>: a pipeline needs at least one stage");
  static constexpr std::size_t size = sizeof...(Stages);

 private:
  using stage_types = std::tuple<Stages...>;
  static constexpr std::array<std::size_t, size> stage_sizes{Stages::size...};
  static constexpr std::array<std::size_t, size + 1> first = [] {
    std::array<std::size_t, size + 1> f{};
    for (std::size_t k = 0; k < size; ++k) f[k + 1] = f[k] + stage_sizes[k];
    return f;
  }();

  template <std::size_t K>
  using raw_layers = typename detail::stage_layers<std::tuple_element_t<K, stage_types>>::type;

  static constexpr bool ends_with_loss = detail::last_is_loss<raw_layers<size - 1>>::value;
  static_assert(!ends_with_loss || stage_sizes[size - 1] > 1,
                "StageList: the last stage needs a layer before its loss (a stage holding only a loss is empty)");

  // The layers a stage runs: all of them, but the loss for the last stage.
  template <std::size_t K>
  using body_layers = std::conditional_t<K + 1 == size && ends_with_loss,
                                         typename detail::take<raw_layers<K>, std::make_index_sequence<stage_sizes[K] - (K + 1 == size && ends_with_loss ? 1 : 0)>>::type,
                                         raw_layers<K>>;

  template <std::size_t K, bool First = (K == 0)>
  struct resolve {
    using type = typename detail::seq_of<0, any_features, body_layers<0>>::type;
  };
  template <std::size_t K>
  struct resolve<K, false> {
    using previous = typename resolve<K - 1>::type;
    using first_layer = typename detail::front<body_layers<K>>::type;
    static constexpr bool boundary_ok = detail::boundary_ok<K, previous::out_features, first_layer>();
    // On a mismatch only stage_boundary_fits reports, with its sentence.
    using type = typename detail::seq_of<first[K], boundary_ok ? previous::out_features : first_layer::in_features,
                                         body_layers<K>>::type;
  };

  template <class Acc, std::size_t K>
  struct join {
    using type = typename join<typename detail::concat<Acc, raw_layers<K>>::type, K + 1>::type;
  };
  template <class Acc>
  struct join<Acc, size> {
    using type = Acc;
  };

 public:
  template <std::size_t K>
  using stage = typename resolve<K>::type;
  /// The whole model, unsplit: the reference every synchronous schedule must reproduce.
  using model = typename detail::sequential_of<typename join<detail::type_list<>, 0>::type>::type;
  /// The last stage's loss layer, or softmax cross-entropy over the outputs. Taken from the stage list
  /// itself, so that naming it does not instantiate `model` (whose own checks would repeat a stage
  /// boundary error under a second sentence).
  using loss = std::conditional_t<ends_with_loss, typename detail::back<raw_layers<size - 1>>::type,
                                  SoftmaxCrossEntropy<stage<size - 1>::out_features>>;
  static constexpr index_t in_features = stage<0>::in_features;
  static constexpr index_t out_features = stage<size - 1>::out_features;
  static constexpr bool takes_token_ids = stage<0>::takes_token_ids;

  /// Forward FLOPs per sample of each stage, from the layer cost model.
  static constexpr std::array<double, size> stage_flops = []<std::size_t... K>(std::index_sequence<K...>) {
    return std::array<double, size>{stage<K>::forward_flops_per_sample...};
  }(std::make_index_sequence<size>());
};

namespace detail {

/// Cut points minimising the most expensive stage (exact dynamic programme over contiguous splits).
template <std::size_t L, std::size_t P>
constexpr std::array<std::size_t, P + 1> balanced_cuts(const std::array<double, L>& cost) {
  std::array<double, L + 1> prefix{};
  for (std::size_t i = 0; i < L; ++i) prefix[i + 1] = prefix[i] + cost[i];
  // best[k][i]: the smallest possible maximum stage cost splitting the first i layers into k stages.
  std::array<std::array<double, L + 1>, P + 1> best{};
  std::array<std::array<std::size_t, L + 1>, P + 1> cut{};
  constexpr double inf = 1e300;
  for (auto& row : best) row.fill(inf);
  best[0][0] = 0;
  for (std::size_t k = 1; k <= P; ++k)
    for (std::size_t i = k; i <= L; ++i)
      for (std::size_t j = k - 1; j < i; ++j) {
        const double stage_cost = prefix[i] - prefix[j];
        const double value = best[k - 1][j] > stage_cost ? best[k - 1][j] : stage_cost;
        if (value < best[k][i]) {
          best[k][i] = value;
          cut[k][i] = j;
        }
      }
  std::array<std::size_t, P + 1> cuts{};
  cuts[P] = L;
  for (std::size_t k = P; k > 0; --k) cuts[k - 1] = cut[k][cuts[k]];
  return cuts;
}

/// The cost model's view of a model's body: forward FLOPs per sample of each layer, and where cuts may
/// fall. A unit is a layer with parameters (or the first layer) and the parameter-free layers after
/// it, so that activations stay with their producer; splits fall between units when there are enough.
template <class Body>
struct layer_cost_model {
  static constexpr std::size_t L = Body::size;
  static constexpr std::array<double, L> costs = []<std::size_t... I>(std::index_sequence<I...>) {
    return std::array<double, L>{Body::template layer<I>::forward_flops_per_sample(Body::widths[I])...};
  }(std::make_index_sequence<L>());
  static constexpr std::array<bool, L> starts_unit = []<std::size_t... I>(std::index_sequence<I...>) {
    return std::array<bool, L>{(I == 0 || param_elements<typename Body::template layer<I>>(Body::widths[I]) > 0)...};
  }(std::make_index_sequence<L>());
  static constexpr std::size_t units = [] {
    std::size_t n = 0;
    for (bool s : starts_unit) n += s;
    return n;
  }();
};

/// The stage list of Model's body cut at `Cuts` (first layer of each stage, then the layer count),
/// the loss on the last stage.
template <class Model, auto Cuts>
struct stages_at {
  using body = typename Model::body;
  static constexpr std::size_t P = Cuts.size() - 1;
  template <std::size_t K, std::size_t... J>
  static auto stage_type(std::index_sequence<J...>) {
    if constexpr (K + 1 == P && Model::has_loss)
      return Stage<typename body::template layer<Cuts[K] + J>..., typename Model::loss>{};
    else
      return Stage<typename body::template layer<Cuts[K] + J>...>{};
  }
  template <std::size_t... K>
  static auto list(std::index_sequence<K...>) {
    return StageList<decltype(stage_type<K>(std::make_index_sequence<Cuts[K + 1] - Cuts[K]>()))...>{};
  }
  using type = decltype(list(std::make_index_sequence<P>()));
};

/// partition_at's checks: each stage's first layer after the last one's, inside the body.
template <class Model, std::size_t... Starts>
struct cut_at {
  static constexpr std::size_t L = Model::body::size;
  static constexpr std::array<std::size_t, sizeof...(Starts) + 2> requested{0, Starts..., L};
  static constexpr bool ascending = [] {
    for (std::size_t k = 0; k + 1 < requested.size(); ++k)
      if (requested[k] >= requested[k + 1]) return false;
    return true;
  }();
  static_assert(ascending, "partition_at<Model, Starts...>: each stage starts at a layer after the previous stage's first "
                           "and before the body's layer count (stage 0 starts at layer 0: leave it out)");
  // After a failed check, one stage, so that the sentence above is the only error.
  static constexpr auto cuts = [] {
    if constexpr (ascending) return requested;
    else return std::array<std::size_t, 2>{0, L};
  }();
  using type = typename stages_at<Model, cuts>::type;
};

/// `Multiple`: partition_for's chunks per worker; after a failed check the count stays a multiple of it.
template <class Model, std::size_t Requested, std::size_t Multiple = 1>
struct partition_impl {
  using body = typename Model::body;
  static constexpr std::size_t L = body::size;
  static_assert(Requested >= 1, "partition<Model, P>: a pipeline needs at least one stage");
  static_assert(Requested <= L, "partition<Model, P>: more stages than layers; every stage needs at least one layer");
  // After a failed check, go on with a count that works (and that the schedule can deal out), so the
  // sentence above is the only error.
  static constexpr std::size_t P =
      Requested < 1 ? Multiple : (Requested > L ? std::max(Multiple, L / Multiple * Multiple) : Requested);

  static constexpr const auto& layer_costs = layer_cost_model<body>::costs;
  static constexpr const auto& starts_unit = layer_cost_model<body>::starts_unit;
  static constexpr std::size_t units = layer_cost_model<body>::units;
  static constexpr std::array<std::size_t, P + 1> cuts = [] {
    if constexpr (units < P) {
      return balanced_cuts<L, P>(layer_costs);
    } else {
      std::array<double, units> unit_cost{};
      std::array<std::size_t, units + 1> unit_first{};
      std::size_t u = 0;
      for (std::size_t i = 0; i < L; ++i) {
        if (starts_unit[i]) unit_first[u++] = i;
        unit_cost[u - 1] += layer_costs[i];
      }
      unit_first[units] = L;
      const auto unit_cuts = balanced_cuts<units, P>(unit_cost);
      std::array<std::size_t, P + 1> c{};
      for (std::size_t k = 0; k <= P; ++k) c[k] = unit_first[unit_cuts[k]];
      return c;
    }
  }();

  using type = typename stages_at<Model, cuts>::type;
};

}  // namespace detail

namespace detail {
/// partition<Model, P>: the stage list, marked with the count it was asked for, so that a Pipeline with
/// a multi-chunk schedule can refuse it (pipeline/stage_list_fit.hpp) instead of running P / V workers.
template <class Model, std::size_t P>
struct counted_partition : partition_impl<Model, P>::type {
  static constexpr std::size_t partition_count = P;
};
}  // namespace detail

/// Model split into P stages that balance forward FLOPs per sample (the layer cost model), for a
/// schedule of one chunk per worker (GPipe, 1F1B, ZB-H1, ...): P workers. A multi-chunk schedule
/// (Interleaved<V>, ZeroBubbleV, DualPipeV, ...) refuses it at compile time: use partition_for there.
template <class Model, std::size_t P>
using partition = detail::counted_partition<Model, P>;

/// Model split into stages that start at the layers `Starts` (besides stage 0, at layer 0): a split
/// chosen by hand or by the planner (planner::Request::cut_points, for unequal workers) among those a
/// program compiles. A list of virtual stages, as one written out: Workers x Schedule::chunks of them.
template <class Model, std::size_t... Starts>
using partition_at = typename detail::cut_at<Model, Starts...>::type;

/// Model split for `Workers` workers of `Schedule`: Workers x Schedule::chunks virtual stages. Any
/// schedule: swapping 1F1B for ZeroBubbleV or Interleaved<2> keeps the worker count.
template <class Model, std::size_t Workers, class Schedule>
using partition_for =
    typename detail::partition_impl<Model, Workers * std::size_t(Schedule::chunks), std::size_t(Schedule::chunks)>::type;

}  // namespace cupipe
