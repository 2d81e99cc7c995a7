// SPDX-License-Identifier: Apache-2.0
// What every layer type provides. Layers are stateless descriptions: parameters, gradients and saved
// activations live in buffers owned by whoever runs them (a Network, a pipeline stage), so one layer
// type serves any backend and any number of weight versions.
//
// A layer L provides, all static:
//   in_features                 per-sample input width, or any_features for shape-preserving layers
//   out_features_for(in)        per-sample output width for input width `in`
//   takes_token_ids, is_loss    an Embedding reads int32 ids; a loss layer ends a model
//   params(in)                  std::array<ParamSpec, N>: PyTorch names and shapes, in storage order
//   saved_per_row(in)           values per row the forward saves beyond the layer's input (a
//                               statistic kept in the compute precision counts stat_slots)
//   forward_flops_per_sample(in)  for the cost model used by partition<> and the simulator
//   describe()                  "Linear<784, 512>"
//   init(params, in, rng)       PyTorch's default initialisation, on host memory
//   forward / backward_input / backward_weight, templated on the backend (see Linear for the form).
// and optionally:
//   rows_per_sample             rows that form one sample and must stay together (a sequence of
//                               SeqLen tokens for attention); microbatches split between samples
//   weight_grads_need_backward_input  backward_input keeps, in `saved`, state backward_weight reads
//                               (attention's dqkv, a Residual's inner gradients), so it runs even
//                               where no input gradient is wanted (then with an empty dx)
//   tied_to_input_embedding     its one parameter tensor is a copy of the model's first layer's first
//                               tensor (GPT-2's lm_head and wte): it initialises from that layer's
//                               random stream, and the flush update sums the two copies' gradients
// The concept Layer checks all of these (the three passes and init for every layer but a loss), and
// layer_is_complete<L> says in one sentence which one a layer lacks.
// A layer that derives from LayerDefaults gets the usual values and declares only what differs (its
// own static member hides the default): not a loss, no token ids, no parameters, nothing saved, no
// cost, shape-preserving, and empty backward_weight and init. An identity is then
//   struct Identity : LayerDefaults {
//     static std::string describe() { return "Identity"; }
//     template <class B, class T>
//     static void forward(B& be, const T*, ConstViewOn<B, T> x, ViewOn<B, T> y, ViewOn<B, T>) { copy(be, x, y); }
//     template <class B, class T>
//     static void backward_input(B& be, const T*, ConstViewOn<B, T>, ConstViewOn<B, T>, ConstViewOn<B, T> dy,
//                                ViewOn<B, T> dx) { copy(be, dy, dx); }
//   };
// (tests/layers/test_layers.cpp builds and runs it.)
// Layers call ops unqualified (`gemm(be, ...)`): argument-dependent lookup on the backend picks the
// op of that backend (see ops::Dispatch).
#pragma once

#include <array>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>

#include "cupipe/backend/op_types.hpp"
#include "cupipe/core/rng.hpp"
#include "cupipe/core/shape.hpp"
#include "cupipe/core/tensor.hpp"

namespace cupipe {

/// Width of a layer that adopts its neighbour's (ReLU, GELU).
inline constexpr index_t any_features = -1;

/// Storage slots one statistic takes in a layer's saved area. Statistics (LayerNorm's mean and rstd,
/// attention's log-sum-exp per head) are kept in the compute precision, as fused GPU kernels keep
/// them: rounding an lse of 10 to bf16 would scale a row's recomputed probabilities by up to 2%. Two
/// slots hold an fp32 value in bf16 storage; float and double storage use the first of the two.
/// Sequential starts every saved area at a multiple of stat_slots elements, so a statistic placed at
/// an even offset inside it is aligned for its type.
inline constexpr index_t stat_slots = 2;

/// `elements` rounded up to a whole number of stat_slots.
constexpr index_t round_up_to_stat_slots(index_t elements) { return (elements + stat_slots - 1) / stat_slots * stat_slots; }

/// The compute-precision statistics at `at`, a place in a saved area at a multiple of stat_slots
/// elements from its start (const when `at` is).
template <class B, class T>
auto stats_at(T* at) {
  using G = grad_t<B>;
  static_assert(sizeof(G) <= std::size_t(stat_slots) * sizeof(T) && alignof(G) <= std::size_t(stat_slots) * alignof(T),
                "stats_at: a statistic in the compute type must fit in stat_slots storage elements");
  if constexpr (std::is_same_v<G, std::remove_const_t<T>>) return at;
  else if constexpr (std::is_const_v<T>) return reinterpret_cast<const G*>(at);
  else return reinterpret_cast<G*>(at);
}

/// How tensor parallelism (Megatron's scheme) or expert parallelism splits a parameter tensor over a
/// group of `parts` ranks; rank t of the group holds part t. ParamSpec's rows and cols are the part's
/// shape.
enum class TensorSplit : std::uint8_t {
  none,        ///< replicated: every rank holds the whole tensor (LayerNorm, a row-parallel bias)
  rows,        ///< rows [t R, (t + 1) R) of the whole (a column-parallel Linear's weight and bias)
  cols,        ///< columns [t C, (t + 1) C) of the whole (a row-parallel Linear's weight)
  row_thirds,  ///< three equal row blocks (q, k and v), each split by rows (attention's c_attn)
  expert_rows, ///< rows as `rows`, over the expert-parallel group (a mixture of experts' stacked
               ///< experts, layers/moe.hpp), not the tensor-parallel one
};

/// One parameter tensor of a layer: its PyTorch name and shape (cols == 0 for a 1-D tensor), and,
/// for a tensor-parallel layer, how the whole tensor is split into `parts` (its shape here is one
/// part's).
struct ParamSpec {
  std::string_view name;
  index_t rows = 0;
  index_t cols = 0;
  TensorSplit split = TensorSplit::none;
  int parts = 1;

  constexpr index_t numel() const noexcept { return cols == 0 ? rows : rows * cols; }
  constexpr Shape shape() const { return cols == 0 ? Shape{rows} : Shape{rows, cols}; }
};

/// The static members that describe a layer (widths, parameters, cost, name).
template <class L>
concept LayerDescription = requires(index_t in) {
  { L::in_features } -> std::convertible_to<index_t>;
  { L::out_features_for(in) } -> std::convertible_to<index_t>;
  { L::takes_token_ids } -> std::convertible_to<bool>;
  { L::is_loss } -> std::convertible_to<bool>;
  { L::params(in) };
  { L::saved_per_row(in) } -> std::convertible_to<index_t>;
  { L::forward_flops_per_sample(in) } -> std::convertible_to<double>;
  { L::describe() } -> std::convertible_to<std::string>;
};

namespace detail {
/// A backend without ops, to check a layer's signatures in requires-expressions; nothing runs on it.
struct SignatureProbe : ops::Dispatch {
  using value_type = float;
  using compute_type = float;
  using space = HostSpace;
};
/// What a layer reads: token ids for an Embedding, else the backend's values.
template <class L>
using layer_input_t = std::conditional_t<L::takes_token_ids, std::int32_t, float>;
}  // namespace detail

// The calls Sequential makes, with the argument types it passes (layers/sequential.hpp).
template <class L>
concept LayerForward = requires(detail::SignatureProbe& be, const float* params, ConstView<detail::layer_input_t<L>> x,
                                TensorView<float> y, TensorView<float> saved) { L::forward(be, params, x, y, saved); };
template <class L>
concept LayerBackwardInput =
    requires(detail::SignatureProbe& be, const float* params, ConstView<detail::layer_input_t<L>> x,
             TensorView<float> saved, ConstView<float> dy, TensorView<float> dx) {
      L::backward_input(be, params, x, saved, dy, dx);
    };
template <class L>
concept LayerBackwardWeight =
    requires(detail::SignatureProbe& be, ConstView<detail::layer_input_t<L>> x, TensorView<float> saved,
             ConstView<float> dy, float* grads) { L::backward_weight(be, x, saved, dy, grads); };
template <class L>
concept LayerInit = requires(std::span<float> params, index_t in, Rng& rng) { L::init(params, in, rng); };

/// A loss layer ends a model; the trainer, not Sequential, runs it.
template <class L>
concept LossLayer = LayerDescription<L> && L::is_loss;

/// A layer Sequential can hold: described, and (unless it is the loss) able to run forward, both
/// backward passes and init.
template <class L>
concept Layer = LayerDescription<L> &&
                (LossLayer<L> || (LayerForward<L> && LayerBackwardInput<L> && LayerBackwardWeight<L> && LayerInit<L>));

/// Instantiated by Sequential for each of its layers: a layer that is not a Layer fails here, with the
/// layer as the template argument and one sentence naming what it lacks.
template <class L>
struct layer_is_complete {
  static constexpr bool described = LayerDescription<L>;
  static_assert(described,
                "Sequential: this layer lacks a static member every layer has (in_features, out_features_for, "
                "takes_token_ids, is_loss, params, saved_per_row, forward_flops_per_sample, describe); the layer is "
                "the argument of layer_is_complete<layer> named above");
  // A layer that is not described is reported once, above, and not again below.
  static constexpr bool has_forward = !described || LossLayer<L> || LayerForward<L>;
  static constexpr bool has_backward_input = !described || LossLayer<L> || LayerBackwardInput<L>;
  static constexpr bool has_backward_weight = !described || LossLayer<L> || LayerBackwardWeight<L>;
  static constexpr bool has_init = !described || LossLayer<L> || LayerInit<L>;
  static_assert(has_forward,
                "Sequential: the layer named in layer_is_complete<layer> above has no static "
                "forward(be, params, x, y, saved) that Sequential can call");
  static_assert(has_backward_input,
                "Sequential: the layer named in layer_is_complete<layer> above has no static "
                "backward_input(be, params, x, saved, dy, dx) that Sequential can call");
  static_assert(has_backward_weight,
                "Sequential: the layer named in layer_is_complete<layer> above has no static "
                "backward_weight(be, x, saved, dy, grads) that Sequential can call (LayerDefaults provides an empty one)");
  static_assert(has_init,
                "Sequential: the layer named in layer_is_complete<layer> above has no static init(params, in, rng) "
                "that Sequential can call (LayerDefaults provides an empty one)");
  static constexpr bool value = Layer<L>;
};

/// Rows of one sample of layer L (1 unless it declares rows_per_sample).
template <class L>
constexpr index_t rows_per_sample_of() {
  if constexpr (requires { L::rows_per_sample; }) return L::rows_per_sample;
  else return 1;
}

/// Values per row layer L passes round a context-parallel ring per step (0 unless it declares
/// ring_values_per_row: the attention's keys and values); the planner prices the ring's hand-overs by it.
template <class L>
constexpr index_t ring_values_of() {
  if constexpr (requires { L::ring_values_per_row; }) return L::ring_values_per_row;
  else return 0;
}

/// Values per row one of layer L's all-to-alls sends over an expert-parallel group (0 unless it
/// declares all_to_all_values_per_row: a mixture of experts' dispatch); the planner prices the
/// exchanges by it.
template <class L>
constexpr index_t all_to_all_values_of() {
  if constexpr (requires { L::all_to_all_values_per_row; }) return L::all_to_all_values_per_row;
  else return 0;
}

/// Whether L's backward_weight reads state its backward_input wrote (see the list above).
template <class L>
constexpr bool weight_grads_need_backward_input() {
  if constexpr (requires { L::weight_grads_need_backward_input; }) return L::weight_grads_need_backward_input;
  else return false;
}

/// Whether L's parameter is a copy of the input embedding's table (see the list above).
template <class L>
constexpr bool tied_to_input_embedding() {
  if constexpr (requires { L::tied_to_input_embedding; }) return L::tied_to_input_embedding;
  else return false;
}

/// Into how many tensor-parallel parts L's output is split by columns (a column-parallel Linear's
/// Parts: each rank computes its slice of the features); 1 for a layer whose output is whole.
template <class L>
constexpr int output_parts() {
  if constexpr (requires { L::output_parts; }) return L::output_parts;
  else return 1;
}

/// The unsplit layer a tensor-parallel layer is a part of (ColumnParallelLinear<In, Out, P> is part of
/// Linear<In, Out>; wrappers map their inner layers): a split layer initialises by drawing the whole
/// layer's values and keeping its part (LayerSeq::init), so a tensor-parallel model starts exactly
/// where the whole model does. Every other layer is its own whole.
template <class L>
struct whole_layer {
  using type = L;
};
template <class L>
using whole_layer_t = typename whole_layer<L>::type;

/// The layer whose forward and backward passes L runs: L itself, or, for a wrapper that changes only
/// names or initialisation (Named, gpt::Init), the layer it wraps. backward_pair looks through these
/// wrappers and no others, so a layer that overrides a pass of the layer it derives from is never
/// paired behind its back.
template <class L>
struct passes_of {
  using type = L;
};
template <class L>
using passes_of_t = typename passes_of<L>::type;

/// Two neighbouring layers of a LayerSeq whose backward passes run as one on backend B with element
/// type T: Next's input-gradient pass writes what Prev's backward would compute from it, and Prev's
/// backward starts from there (linear.hpp pairs a LinearGELU with the Linear after it when the
/// backend fuses GELU's gradient into a GEMM). A specialisation with `fused = true` provides
///   next_backward_input(be, next_params, dy, prev_saved, rows)   (instead of Next's backward_input)
///   prev_backward_input(be, prev_params, prev_saved, dx)          (instead of Prev's; dx may be empty)
/// and leaves Prev's saved area as Prev's own backward_input would, so the weight passes (either
/// layer's backward_weight) are unchanged. The gradient of Prev's output is then never written.
template <class Prev, class Next, class B, class T>
struct backward_pair {
  static constexpr bool fused = false;
};

/// Total parameter elements of layer L at input width `in`.
template <class L>
constexpr index_t param_elements(index_t in) {
  index_t n = 0;
  for (const ParamSpec& p : L::params(in)) n += p.numel();
  return n;
}

/// The usual values of a layer's static members, for a layer to derive from and hide what differs
/// (see the list at the top): not a loss, reads values (not token ids), no parameters, saves nothing,
/// costs nothing, keeps its input's width, and its backward_weight and init do nothing. The passes
/// forward and backward_input and describe() have no default: every layer says what it computes.
struct LayerDefaults {
  static constexpr index_t in_features = any_features;
  static constexpr index_t out_features_for(index_t in) { return in; }
  static constexpr bool takes_token_ids = false;
  static constexpr bool is_loss = false;
  static constexpr std::array<ParamSpec, 0> params(index_t) { return {}; }
  static constexpr index_t saved_per_row(index_t) { return 0; }
  static constexpr double forward_flops_per_sample(index_t) { return 0; }
  template <class T>
  static void init(std::span<T>, index_t, Rng&) {}
  template <class B, class T = typename B::value_type>
  static void backward_weight(B&, ConstViewOn<B, T>, ConstViewOn<B, T>, ConstViewOn<B, T>, grad_t<B>*) {}
};

}  // namespace cupipe
