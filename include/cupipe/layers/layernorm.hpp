// SPDX-License-Identifier: Apache-2.0
// LayerNorm<N> over the last axis, as torch.nn.LayerNorm(N) (eps 1e-5, weight = gamma, bias = beta).
#pragma once

#include <string>

#include "cupipe/core/rng.hpp"
#include "cupipe/layers/layer.hpp"

namespace cupipe {

template <index_t N>
struct LayerNorm {
  static_assert(N > 0, "LayerNorm<N> needs a positive size");
  static constexpr double eps = 1e-5;
  static constexpr index_t in_features = N;
  static constexpr index_t out_features_for(index_t) { return N; }
  static constexpr bool takes_token_ids = false;
  static constexpr bool is_loss = false;
  static constexpr std::array<ParamSpec, 2> params(index_t) { return {{{"weight", N, 0}, {"bias", N, 0}}}; }
  /// mean and rstd, one each per row.
  static constexpr index_t saved_per_row(index_t) { return 2; }
  static constexpr double forward_flops_per_sample(index_t) { return 8.0 * N; }
  static std::string describe() { return "LayerNorm<" + std::to_string(N) + ">"; }

  template <class T>
  static void init(std::span<T> p, index_t, Rng&) {
    for (index_t i = 0; i < N; ++i) p[i] = T(1);
    for (index_t i = N; i < 2 * N; ++i) p[i] = T(0);
  }

  template <class B, class T>
  static void forward(B& be, const T* p, ConstView<T> x, TensorView<T> y, TensorView<T> saved) {
    const index_t n = x.rows();
    layernorm_forward(be, x, ConstView<T>{p, Shape{N}}, ConstView<T>{p + N, Shape{N}}, y,
                           TensorView<T>{saved.data(), Shape{n}}, TensorView<T>{saved.data() + n, Shape{n}}, eps);
  }
  template <class B, class T>
  static void backward_input(B& be, const T* p, ConstView<T> x, ConstView<T> saved, ConstView<T> dy, TensorView<T> dx) {
    const index_t n = x.rows();
    layernorm_backward_input(be, x, ConstView<T>{p, Shape{N}}, ConstView<T>{saved.data(), Shape{n}},
                                  ConstView<T>{saved.data() + n, Shape{n}}, dy, dx);
  }
  template <class B, class T>
  static void backward_weight(B& be, ConstView<T> x, ConstView<T> saved, ConstView<T> dy, T* g) {
    const index_t n = x.rows();
    layernorm_backward_weight(be, x, ConstView<T>{saved.data(), Shape{n}}, ConstView<T>{saved.data() + n, Shape{n}},
                                   dy, TensorView<T>{g, Shape{N}}, TensorView<T>{g + N, Shape{N}});
  }
};

}  // namespace cupipe
