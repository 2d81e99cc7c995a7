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
//   saved_per_row(in)           values per row the forward saves beyond the layer's input
//   forward_flops_per_sample(in)  for the cost model used by partition<> and the simulator
//   describe()                  "Linear<784, 512>"
//   init(params, in, rng)       PyTorch's default initialisation, on host memory
//   forward / backward_input / backward_weight, templated on the backend (see Linear for the form).
// Layers call ops unqualified (`gemm(be, ...)`): argument-dependent lookup on the backend picks the
// op of that backend (see ops::Dispatch).
#pragma once

#include <array>
#include <concepts>
#include <cstddef>
#include <span>
#include <string>
#include <string_view>

#include "cupipe/core/rng.hpp"
#include "cupipe/core/shape.hpp"
#include "cupipe/core/tensor.hpp"

namespace cupipe {

/// Width of a layer that adopts its neighbour's (ReLU, GELU).
inline constexpr index_t any_features = -1;

/// One parameter tensor of a layer: its PyTorch name and shape (cols == 0 for a 1-D tensor).
struct ParamSpec {
  std::string_view name;
  index_t rows = 0;
  index_t cols = 0;

  constexpr index_t numel() const noexcept { return cols == 0 ? rows : rows * cols; }
  constexpr Shape shape() const { return cols == 0 ? Shape{rows} : Shape{rows, cols}; }
};

template <class L>
concept Layer = requires(index_t in) {
  { L::in_features } -> std::convertible_to<index_t>;
  { L::out_features_for(in) } -> std::convertible_to<index_t>;
  { L::takes_token_ids } -> std::convertible_to<bool>;
  { L::is_loss } -> std::convertible_to<bool>;
  { L::params(in) };
  { L::saved_per_row(in) } -> std::convertible_to<index_t>;
  { L::forward_flops_per_sample(in) } -> std::convertible_to<double>;
  { L::describe() } -> std::convertible_to<std::string>;
};

/// Total parameter elements of layer L at input width `in`.
template <class L>
constexpr index_t param_elements(index_t in) {
  index_t n = 0;
  for (const ParamSpec& p : L::params(in)) n += p.numel();
  return n;
}

/// Defaults for layers without parameters or saved state.
struct Stateless {
  static constexpr bool takes_token_ids = false;
  static constexpr bool is_loss = false;
  static constexpr std::array<ParamSpec, 0> params(index_t) { return {}; }
  static constexpr index_t saved_per_row(index_t) { return 0; }
  template <class T>
  static void init(std::span<T>, index_t, Rng&) {}
  template <class B, class T>
  static void backward_weight(B&, ConstView<T>, ConstView<T>, ConstView<T>, T*) {}
};

}  // namespace cupipe
