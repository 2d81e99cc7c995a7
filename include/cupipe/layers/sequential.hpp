// SPDX-License-Identifier: Apache-2.0
// LayerSeq and Sequential: a compile-time list of layers with resolved widths, a flat parameter
// layout with PyTorch state_dict names, and forward/backward over a microbatch.
//
// Memory layout, for a microbatch of n rows through layers 0..L-1 with widths w[0..L]:
//   parameters  one flat array; layer i's tensors at param_offsets[i], in L::params() order;
//   record      the forward's saved state: x_1..x_L (x_L is the output), then each layer's extras;
//               x_0, the input, stays with the caller (a received message, or the batch itself);
//   grad record the backward's per-layer output gradients g_0..g_{L-2} (g_{L-1} is the incoming dy),
//               kept between the B and W passes of zero-bubble schedules.
#pragma once

#include <algorithm>
#include <array>
#include <cstdint>
#include <numeric>
#include <span>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "cupipe/core/error.hpp"
#include "cupipe/core/rng.hpp"
#include "cupipe/core/tensor.hpp"
#include "cupipe/layers/layer.hpp"

namespace cupipe {

/// Instantiated for each pair of neighbouring layers. When the sizes differ, the compiler shows this
/// template with both layers and both sizes, under one sentence.
template <class Previous, index_t PreviousOutFeatures, class Next, index_t NextInFeatures>
struct neighbouring_layers_fit {
  static_assert(PreviousOutFeatures == NextInFeatures,
                "Sequential: the previous layer's output features must equal the next layer's input features "
                "(both layers and both sizes are the arguments of neighbouring_layers_fit<previous layer, "
                "its output features, next layer, its input features> named above)");
  static constexpr bool value = PreviousOutFeatures == NextInFeatures;
};

/// Two copies of one tensor in a model's flat parameter array (GPT-2's wte and its tied lm_head):
/// they start equal, and a flush update replaces both gradients by their sum and counts the tensor once
/// in the gradient norm, so they stay equal. count == 0: the model ties nothing.
struct TiedCopies {
  index_t first = 0;
  index_t second = 0;
  index_t count = 0;
};

/// One parameter tensor of a model: its PyTorch state_dict name, shape and offset in the flat array.
struct ParamInfo {
  std::string name;
  Shape shape;
  index_t offset = 0;
  index_t numel = 0;
  TensorSplit split = TensorSplit::none;  ///< tensor parallelism: how the whole tensor is split
  int parts = 1;                          ///< into how many parts (shape is one part's)
};

namespace detail {
template <bool Ok>
struct checked {};
}  // namespace detail

namespace detail {
/// Rows and columns of a tensor of `info`'s shape (a 1-D tensor: one column).
inline index_t split_rows_of(const ParamInfo& info) { return info.shape.rank() == 2 ? info.shape[0] : info.numel; }
inline index_t split_cols_of(const ParamInfo& info) { return info.shape.rank() == 2 ? info.shape[1] : 1; }

/// Calls copy(part_offset, whole_offset, count) for every run of part t of a tensor split as
/// `info` says (offsets in elements within the tensor).
template <class Copy>
void for_each_split_run(const ParamInfo& info, int t, Copy&& copy) {
  const index_t r = split_rows_of(info), c = split_cols_of(info), P = info.parts;
  switch (info.split) {
    case TensorSplit::none: copy(index_t(0), index_t(0), info.numel); break;
    case TensorSplit::rows:
    case TensorSplit::expert_rows: copy(index_t(0), index_t(t) * r * c, r * c); break;
    case TensorSplit::cols:
      for (index_t i = 0; i < r; ++i) copy(i * c, i * c * P + index_t(t) * c, c);
      break;
    case TensorSplit::row_thirds: {
      const index_t third = r / 3;  // this part's rows of each of q, k and v
      for (index_t k = 0; k < 3; ++k) copy(k * third * c, (k * third * P + index_t(t) * third) * c, third * c);
      break;
    }
  }
}
}  // namespace detail

/// Layers numbered from FirstIndex (their index in the whole model, for names and initialisation),
/// with input width InFeatures (any_features: taken from the first layer).
template <std::size_t FirstIndex, index_t InFeatures, class... Layers>
struct LayerSeq;

template <std::size_t FirstIndex, index_t InFeatures, class... Layers>
struct LayerSeq {
  static_assert(sizeof...(Layers) > 0, "a layer sequence needs at least one layer");
  // Instantiates layer_is_complete<L> for every layer, whose static_assert names a layer that lacks
  // something and what; this assertion itself always holds, so each mistake is reported once.
  static_assert(((void)layer_is_complete<Layers>::value, ..., true));
  static constexpr bool all_layers = (Layer<Layers> && ...);

  static constexpr std::size_t size = sizeof...(Layers);
  static constexpr std::size_t first_index = FirstIndex;
  template <std::size_t I>
  using layer = std::tuple_element_t<I, std::tuple<Layers...>>;
  using first_layer = layer<0>;
  using last_layer = layer<size - 1>;

  static_assert(InFeatures != any_features || first_layer::in_features != any_features,
                "Sequential: the first layer of a model must have a fixed input size (ReLU or GELU cannot start a model)");
  static constexpr bool takes_token_ids = first_layer::takes_token_ids;
  /// Element type of the input: int32 token ids for an Embedding, else the backend's T.
  template <class T>
  using input_t = std::conditional_t<takes_token_ids, std::int32_t, T>;

  /// widths[i] is layer i's input width; widths[size] the output width.
  static constexpr std::array<index_t, size + 1> widths = [] {
    std::array<index_t, size + 1> w{};
    w[0] = InFeatures != any_features ? InFeatures : first_layer::in_features;
    std::size_t i = 0;
    ((w[i + 1] = Layers::out_features_for(w[i]), ++i), ...);
    return w;
  }();
  static constexpr index_t in_features = widths[0];
  static constexpr index_t out_features = widths[size];

 private:
  template <std::size_t I>
  static constexpr bool fits() {
    using L = layer<I>;
    if constexpr (L::takes_token_ids) {
      static_assert(I == 0 && FirstIndex == 0,
                    "Sequential: a layer that reads token ids (Embedding) can only be the first layer of a model");
      return true;
    } else if constexpr (L::is_loss && I + 1 != size) {
      static_assert(I + 1 == size, "Sequential: a loss layer can only be the last layer of a model");
      return false;
    } else if constexpr (L::in_features == any_features || widths[I] == any_features) {
      return true;  // adopts its neighbour's width, or follows a model start already reported above
    } else if constexpr (I == 0) {
      static_assert(InFeatures == any_features || InFeatures == L::in_features,
                    "Sequential: the first layer's input features must equal the features given to the sequence");
      return true;
    } else {
      return neighbouring_layers_fit<layer<I - 1>, widths[I], L, L::in_features>::value;
    }
  }
  template <std::size_t... I>
  static constexpr bool all_fit(std::index_sequence<I...>) {
    return (fits<I>() && ...);
  }
  // Instantiating this member's type runs the checks above, so a bad model fails where it is named.
  [[no_unique_address]] detail::checked<all_fit(std::make_index_sequence<size>())> check_;

  template <std::size_t... I>
  static constexpr std::array<index_t, size + 1> param_offsets_impl(std::index_sequence<I...>) {
    std::array<index_t, size + 1> o{};
    ((o[I + 1] = o[I] + param_elements<layer<I>>(widths[I])), ...);
    return o;
  }
  template <std::size_t... I>
  static constexpr std::array<index_t, size + 1> saved_offsets_impl(std::index_sequence<I...>) {
    std::array<index_t, size + 1> o{};
    ((o[I + 1] = o[I] + round_up_to_stat_slots(layer<I>::saved_per_row(widths[I]))), ...);
    return o;
  }

 public:
  /// Offset of layer i's parameters in the flat array; param_offsets[size] is the total.
  static constexpr std::array<index_t, size + 1> param_offsets = param_offsets_impl(std::make_index_sequence<size>());
  static constexpr index_t param_count = param_offsets[size];

  /// Per-row offsets inside a record: x_i (i >= 1) starts at act_offsets[i - 1]; extras after.
  static constexpr std::array<index_t, size + 1> act_offsets = [] {
    std::array<index_t, size + 1> o{};
    for (std::size_t i = 0; i < size; ++i) o[i + 1] = o[i] + widths[i + 1];
    return o;
  }();
  /// Per-row offsets of the layers' saved areas, from saved_base; each area is a whole number of
  /// stat_slots, and so is saved_base, so a saved area starts aligned for a statistic.
  static constexpr std::array<index_t, size + 1> saved_offsets = saved_offsets_impl(std::make_index_sequence<size>());
  static constexpr index_t saved_base = saved_offsets[size] > 0 ? round_up_to_stat_slots(act_offsets[size]) : act_offsets[size];
  static constexpr index_t record_per_row = saved_base + saved_offsets[size];
  /// Output gradients g_0..g_{L-2}, per row.
  static constexpr index_t grad_record_per_row = act_offsets[size - 1];

  /// Index of the layer tied to the input embedding, or -1.
  static constexpr int tied_layer = [] {
    int found = -1, i = 0;
    ((found = tied_to_input_embedding<Layers>() ? i : found, ++i), ...);
    return found;
  }();
  /// The tied copies in this sequence's flat array (count 0 unless it holds the whole model's first
  /// layer and a layer tied to it).
  static constexpr TiedCopies tied = [] {
    if constexpr (tied_layer >= 0 && FirstIndex == 0) {
      constexpr index_t count = param_elements<layer<std::size_t(tied_layer)>>(widths[std::size_t(tied_layer)]);
      static_assert(count == first_layer::params(widths[0])[0].numel(),
                    "Sequential: a layer tied to the input embedding must have exactly the embedding table's size");
      return TiedCopies{0, param_offsets[std::size_t(tied_layer)], count};
    } else {
      return TiedCopies{};
    }
  }();

  static constexpr index_t record_elements(index_t rows) { return rows * record_per_row; }
  static constexpr index_t grad_record_elements(index_t rows) { return rows * grad_record_per_row; }

  /// Rows that make one sample (the least common multiple of the layers'): a batch splits into
  /// microbatches only between samples.
  static constexpr index_t rows_per_sample = [] {
    index_t r = 1;
    ((r = std::lcm(r, rows_per_sample_of<Layers>())), ...);
    return r;
  }();
  /// Values per row the layers pass round a context-parallel ring per step, together.
  static constexpr index_t ring_values_per_row = (ring_values_of<Layers>() + ... + index_t(0));
  /// Values per row one all-to-all of the layers sends over an expert-parallel group, together.
  static constexpr index_t all_to_all_values_per_row = (all_to_all_values_of<Layers>() + ... + index_t(0));

  /// Forward FLOPs per row, from the layer types (the cost model of partition<>).
  static constexpr double forward_flops_per_sample = [] {
    double f = 0;
    std::size_t i = 0;
    ((f += Layers::forward_flops_per_sample(widths[i]), ++i), ...);
    return f;
  }();

  static std::string describe() {
    std::string out;
    std::size_t i = 0;
    ((out += (i++ ? ", " : "") + Layers::describe()), ...);
    return out;
  }
  template <std::size_t I>
  static std::string describe_layer() {
    return layer<I>::describe() + " (layer " + std::to_string(FirstIndex + I) + ")";
  }

  /// Names, shapes and offsets of every parameter, as torch.nn.Sequential's state_dict names them.
  static std::vector<ParamInfo> parameter_table() {
    std::vector<ParamInfo> table;
    [&]<std::size_t... I>(std::index_sequence<I...>) {
      (add_params<I>(table), ...);
    }(std::make_index_sequence<size>());
    return table;
  }

  /// Initialises host parameters as PyTorch would. Layer i draws from its own stream derived from
  /// (seed, its index in the model), so a model initialises identically however it is split (a
  /// layer tied to the input embedding draws from layer 0's, so the copies start equal). A layer
  /// split over tensor-parallel ranks draws its whole layer's values (whole_layer_t) and keeps part
  /// `part` (the rank's place in its group), so each rank holds its part of the whole model's
  /// initialisation; only one layer's whole values are ever held.
  template <class T>
  static void init(std::span<T> params, std::uint64_t seed, int part = 0) {
    CUPIPE_REQUIRE(index_t(params.size()) == param_count, "init: ", params.size(), " parameters given, ",
                   param_count, " needed");
    if constexpr (all_layers)
      [&]<std::size_t... I>(std::index_sequence<I...>) {
        ((void)[&] {
          // A copy of the input embedding draws what the embedding drew: from layer 0's stream.
          Rng rng = Rng::derive(seed, tied_to_input_embedding<layer<I>>() ? 0 : FirstIndex + I);
          const std::span<T> mine = params.subspan(param_offsets[I], param_elements<layer<I>>(widths[I]));
          if constexpr (splits_parameters<layer<I>>(widths[I])) init_part<layer<I>>(mine, widths[I], rng, part);
          else layer<I>::init(mine, widths[I], rng);
        }(), ...);
      }(std::make_index_sequence<size>());
  }

  /// Initialises parameters as init() does, on the host, and uploads them to `params` in be's memory.
  template <class B, class T>
  static void init_on(B& be, T* params, std::uint64_t seed, int part = 0) {
    std::vector<T> host(static_cast<std::size_t>(param_count));
    init(std::span<T>(host), seed, part);
    be.upload(std::span<const T>(host), params);
  }

  /// Layer i's input (i >= 1) or the output (i == size) inside a record of `rows` rows.
  /// The accessors return views in `Space`, the memory space of the record (a backend's B::space).
  template <class Space = HostSpace, class T>
  static TensorView<T, Space> activation(T* record, index_t rows, std::size_t i) {
    return {record + rows * act_offsets[i - 1], Shape{rows, widths[i]}};
  }
  template <class Space = HostSpace, class T>
  static TensorView<T, Space> saved(T* record, index_t rows, std::size_t i) {
    return {record + rows * (saved_base + saved_offsets[i]), Shape{rows * (saved_offsets[i + 1] - saved_offsets[i])}};
  }
  template <class Space = HostSpace, class T>
  static TensorView<T, Space> output(T* record, index_t rows) { return activation<Space>(record, rows, size); }
  /// Gradient of layer i's output (i < size - 1) inside a grad record.
  template <class Space = HostSpace, class T>
  static TensorView<T, Space> output_grad(T* grad_record, index_t rows, std::size_t i) {
    return {grad_record + rows * act_offsets[i], Shape{rows, widths[i + 1]}};
  }

  /// Runs every layer on x0 (rows, in_features), filling `record` (record_elements(rows)).
  template <class B, class T>
  static void forward(B& be, const T* params, ConstViewOn<B, input_t<T>> x0, T* record) {
    const index_t rows = x0.rows();
    check_view(x0, Shape{rows, in_features}, [] { return describe_layer<0>(); }, "input");
    CUPIPE_REQUIRE((params != nullptr || param_count == 0) && record != nullptr, describe_layer<0>(),
                   ": null parameters or record");
    // Without a complete layer (reported above) the passes are not instantiated, so nothing follows that report.
    if constexpr (all_layers)
      [&]<std::size_t... I>(std::index_sequence<I...>) {
        (forward_layer<I>(be, params, x0, record, rows), ...);
      }(std::make_index_sequence<size>());
  }

  /// Backward through every layer, last to first, from dy (rows, out_features). Two neighbours that
  /// a backward_pair fuses on B (a LinearGELU and the Linear after it, on CUDA) run their input
  /// passes as one.
  /// - dx (rows, in_features) receives the input gradient; pass an empty view to skip it (first stage).
  /// - with_weight_grads: also accumulate parameter gradients into `grads` now (the fused B of flush
  ///   schedules); otherwise leave them to backward_weight (the W of zero-bubble schedules).
  /// - grad_record (grad_record_elements(rows)) receives the per-layer output gradients W needs.
  template <class B, class T>
  static void backward(B& be, const T* params, ConstViewOn<B, input_t<T>> x0, const T* record, ConstViewOn<B, T> dy, ViewOn<B, T> dx,
                       grad_t<B>* grads, T* grad_record, bool with_weight_grads) {
    const index_t rows = x0.rows();
    check_view(dy, Shape{rows, out_features}, [] { return describe_layer<size - 1>(); }, "output gradient");
    if (!dx.empty()) check_view(dx, Shape{rows, in_features}, [] { return describe_layer<0>(); }, "input gradient");
    CUPIPE_REQUIRE((params != nullptr || param_count == 0) && record != nullptr, describe_layer<0>(),
                   ": null parameters or record");
    CUPIPE_REQUIRE(grad_record != nullptr || size == 1, describe_layer<0>(), ": null grad record");
    CUPIPE_REQUIRE(grads != nullptr || !with_weight_grads || param_count == 0, describe_layer<0>(), ": null gradients");
    if constexpr (all_layers)
      [&]<std::size_t... R>(std::index_sequence<R...>) {
        (backward_layer<size - 1 - R>(be, params, x0, record, rows, dy, dx, grads, grad_record, with_weight_grads), ...);
      }(std::make_index_sequence<size>());
  }

  /// Accumulates parameter gradients from a grad record that backward(..., false) filled.
  template <class B, class T>
  static void backward_weight(B& be, ConstViewOn<B, input_t<T>> x0, const T* record, ConstViewOn<B, T> dy, const T* grad_record,
                              grad_t<B>* grads) {
    const index_t rows = x0.rows();
    check_view(dy, Shape{rows, out_features}, [] { return describe_layer<size - 1>(); }, "output gradient");
    CUPIPE_REQUIRE(record != nullptr && (grad_record != nullptr || size == 1) && (grads != nullptr || param_count == 0),
                   describe_layer<0>(), ": null record, grad record or gradients");
    if constexpr (all_layers)
      [&]<std::size_t... I>(std::index_sequence<I...>) {
        (weight_layer<I>(be, x0, record, rows, dy, grad_record, grads), ...);
      }(std::make_index_sequence<size>());
  }

 private:
  /// Whether layer L holds a tensor-parallel part of any of its parameters.
  template <class L>
  static constexpr bool splits_parameters(index_t in) {
    for (const ParamSpec& spec : L::params(in))
      if (spec.split != TensorSplit::none) return true;
    return false;
  }

  /// Part `part` of the whole layer's initial values (split layer L at input width `in`): the whole
  /// layer draws from `rng` as it would in the whole model, and each tensor keeps its part's runs.
  template <class L, class T>
  static void init_part(std::span<T> mine, index_t in, Rng& rng, int part) {
    using W = whole_layer_t<L>;
    static_assert(!std::is_same_v<W, L>, "a layer split over tensor-parallel ranks needs a whole_layer specialisation "
                                         "naming the unsplit layer it is a part of (see layers/layer.hpp)");
    const index_t whole_in = W::in_features == any_features ? in : W::in_features;
    std::vector<T> whole(static_cast<std::size_t>(param_elements<W>(whole_in)));
    W::init(std::span<T>(whole), whole_in, rng);
    const auto& parts = L::params(in);
    const auto& wholes = W::params(whole_in);
    CUPIPE_REQUIRE(parts.size() == wholes.size(), "init: ", L::describe(), " has ", parts.size(),
                   " parameter tensors but its whole layer ", wholes.size());
    index_t at = 0, whole_at = 0;
    for (std::size_t k = 0; k < parts.size(); ++k) {
      const ParamSpec& p = parts[k];
      CUPIPE_REQUIRE(p.name == wholes[k].name, "init: ", L::describe(), "'s parameter ", k, " is '", p.name,
                     "' but its whole layer's is '", wholes[k].name, "'");
      const index_t count = p.split == TensorSplit::none ? 1 : p.parts;
      CUPIPE_REQUIRE(part >= 0 && (p.split == TensorSplit::none || part < count), "init: part ", part, " of ",
                     L::describe(), "'s '", p.name, "', which is split into ", count);
      CUPIPE_REQUIRE(wholes[k].numel() == p.numel() * count, "init: ", L::describe(), "'s '", p.name, "' has ",
                     p.numel(), " values in ", count, " part(s), but ", wholes[k].numel(), " in its whole layer");
      const ParamInfo info{std::string(p.name), p.shape(), 0, p.numel(), p.split, p.parts};
      detail::for_each_split_run(info, p.split == TensorSplit::none ? 0 : part, [&](index_t to, index_t from, index_t n) {
        std::copy_n(whole.begin() + (whole_at + from), n, mine.begin() + (at + to));
      });
      at += p.numel();
      whole_at += wholes[k].numel();
    }
  }

  template <std::size_t I>
  static void add_params(std::vector<ParamInfo>& table) {
    index_t offset = param_offsets[I];
    for (const ParamSpec& spec : layer<I>::params(widths[I])) {
      table.push_back({std::to_string(FirstIndex + I) + "." + std::string(spec.name), spec.shape(), offset, spec.numel(),
                       spec.split, spec.parts});
      offset += spec.numel();
    }
  }

  template <std::size_t I, class B, class T>
  static auto layer_input(ConstViewOn<B, input_t<T>> x0, const T* record, index_t rows) {
    if constexpr (I == 0) return x0;
    else return ConstViewOn<B, T>(activation<typename B::space>(const_cast<T*>(record), rows, I));
  }

  template <std::size_t I, class B, class T>
  static void forward_layer(B& be, const T* params, ConstViewOn<B, input_t<T>> x0, T* record, index_t rows) {
    using L = layer<I>;
    try {
      L::forward(be, params + param_offsets[I], layer_input<I, B>(x0, record, rows), activation<typename B::space>(record, rows, I + 1),
                 saved<typename B::space>(record, rows, I));
    } catch (const error& e) {
      rethrow_naming<I>(e, "forward");
    }
  }

  /// Whether layers I - 1 and I run their backward as a pair on B (layer.hpp's backward_pair).
  template <std::size_t I, class B, class T>
  static constexpr bool paired_with_previous() {
    if constexpr (I == 0 || I >= size) return false;
    else return backward_pair<layer<I - 1>, layer<I>, B, T>::fused;
  }

  template <std::size_t I, class B, class T>
  static void backward_layer(B& be, const T* params, ConstViewOn<B, input_t<T>> x0, const T* record, index_t rows, ConstViewOn<B, T> dy,
                             ViewOn<B, T> dx, grad_t<B>* grads, T* grad_record, bool with_weight_grads) {
    using L = layer<I>;
    T* rec = const_cast<T*>(record);
    const ConstViewOn<B, T> g = I + 1 == size ? dy : ConstViewOn<B, T>(output_grad<typename B::space>(grad_record, rows, I));
    try {
      if constexpr (paired_with_previous<I, B, T>()) {
        // Layer I's input gradient goes through layer I - 1's backward (backward_pair), into its saved area.
        backward_pair<layer<I - 1>, L, B, T>::next_backward_input(be, params + param_offsets[I], g,
                                                                  saved<typename B::space>(rec, rows, I - 1).data(), rows);
      } else if constexpr (paired_with_previous<I + 1, B, T>()) {
        // Layer I + 1 has done the first half of this layer's backward.
        using Pair = backward_pair<L, layer<I + 1>, B, T>;
        T* mine = saved<typename B::space>(rec, rows, I).data();
        if constexpr (I == 0) Pair::prev_backward_input(be, params, mine, dx);
        else Pair::prev_backward_input(be, params + param_offsets[I], mine, output_grad<typename B::space>(grad_record, rows, I - 1));
      } else if constexpr (I == 0) {
        if (!dx.empty() || weight_grads_need_backward_input<L>())
          L::backward_input(be, params, x0, saved<typename B::space>(rec, rows, 0), g, dx);
      } else {
        L::backward_input(be, params + param_offsets[I], layer_input<I, B>(x0, record, rows), saved<typename B::space>(rec, rows, I), g,
                          output_grad<typename B::space>(grad_record, rows, I - 1));
      }
      if (with_weight_grads && param_elements<L>(widths[I]) > 0)
        L::backward_weight(be, layer_input<I, B>(x0, record, rows), saved<typename B::space>(rec, rows, I), g, grads + param_offsets[I]);
    } catch (const error& e) {
      rethrow_naming<I>(e, "backward");
    }
  }

  template <std::size_t I, class B, class T>
  static void weight_layer(B& be, ConstViewOn<B, input_t<T>> x0, const T* record, index_t rows, ConstViewOn<B, T> dy,
                           const T* grad_record, grad_t<B>* grads) {
    using L = layer<I>;
    if constexpr (param_elements<L>(widths[I]) > 0) {
      T* rec = const_cast<T*>(record);
      const ConstViewOn<B, T> g = I + 1 == size ? dy : ConstViewOn<B, T>(output_grad<typename B::space>(const_cast<T*>(grad_record), rows, I));
      try {
        L::backward_weight(be, layer_input<I, B>(x0, record, rows), saved<typename B::space>(rec, rows, I), g, grads + param_offsets[I]);
      } catch (const error& e) {
        rethrow_naming<I>(e, "weight gradient");
      }
    }
  }

  template <std::size_t I>
  [[noreturn]] static void rethrow_naming(const error& e, std::string_view pass) {
    throw error(describe_layer<I>() + " " + std::string(pass) + ": " + e.message(), e.call(), e.file(), e.line());
  }
};

namespace detail {
template <class Seq, class Indices>
struct drop_last_impl;
template <std::size_t F, index_t In, class... Ls, std::size_t... I>
struct drop_last_impl<LayerSeq<F, In, Ls...>, std::index_sequence<I...>> {
  using type = LayerSeq<F, In, std::tuple_element_t<I, std::tuple<Ls...>>...>;
};
template <class Last>
struct loss_of {
  using type = std::conditional_t<Last::is_loss, Last, void>;
};
}  // namespace detail

/// A model: layers in order, optionally ending with a loss layer. `body` is the model without its
/// loss; `loss` is the loss layer, or void when the model has none (the pipeline then uses
/// SoftmaxCrossEntropy over the output).
template <class... Layers>
struct Sequential;

namespace detail {
template <class... Layers>
struct split_loss {
  using all = LayerSeq<0, any_features, Layers...>;
  using loss = typename loss_of<typename all::last_layer>::type;
  static constexpr bool has_loss = !std::is_void_v<loss>;
  static_assert(!has_loss || sizeof...(Layers) > 1, "Sequential: a model needs a layer before its loss");
  using body = std::conditional_t<has_loss,
                                  typename drop_last_impl<all, std::make_index_sequence<sizeof...(Layers) - 1>>::type, all>;
};
}  // namespace detail

/// Sequential<Layers...> runs as its body (the layers before the loss); forward and backward stop
/// at the logits, and whoever trains it applies the loss.
template <class... Layers>
struct Sequential : detail::split_loss<Layers...>::body {
  using all = typename detail::split_loss<Layers...>::all;
  using body = typename detail::split_loss<Layers...>::body;
  using loss = typename detail::split_loss<Layers...>::loss;
  static constexpr bool has_loss = detail::split_loss<Layers...>::has_loss;
  static constexpr std::size_t layer_count = sizeof...(Layers);
};

}  // namespace cupipe
