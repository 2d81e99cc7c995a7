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
  /// mean and rstd, one each per row, in the compute precision (stat_slots storage elements each).
  static constexpr index_t saved_per_row(index_t) { return 2 * stat_slots; }
  static constexpr double forward_flops_per_sample(index_t) { return 8.0 * N; }
  static std::string describe() { return "LayerNorm<" + std::to_string(N) + ">"; }

  template <class T>
  static void init(std::span<T> p, index_t, Rng&) {
    for (index_t i = 0; i < N; ++i) p[i] = T(1);
    for (index_t i = N; i < 2 * N; ++i) p[i] = T(0);
  }

  template <class B, class T>
  static void forward(B& be, const T* p, ConstViewOn<B, T> x, ViewOn<B, T> y, ViewOn<B, T> saved) {
    const index_t n = x.rows();
    auto* stats = stats_at<B>(saved.data());
    layernorm_forward(be, x, ConstViewOn<B, T>{p, Shape{N}}, ConstViewOn<B, T>{p + N, Shape{N}}, y,
                      ViewOn<B, grad_t<B>>{stats, Shape{n}}, ViewOn<B, grad_t<B>>{stats + n, Shape{n}}, eps);
  }
  template <class B, class T>
  static void backward_input(B& be, const T* p, ConstViewOn<B, T> x, ConstViewOn<B, T> saved, ConstViewOn<B, T> dy, ViewOn<B, T> dx) {
    const index_t n = x.rows();
    const auto* stats = stats_at<B>(saved.data());
    layernorm_backward_input(be, x, ConstViewOn<B, T>{p, Shape{N}}, ConstViewOn<B, grad_t<B>>{stats, Shape{n}},
                             ConstViewOn<B, grad_t<B>>{stats + n, Shape{n}}, dy, dx);
  }
  template <class B, class T = typename B::value_type>
  static void backward_weight(B& be, ConstViewOn<B, T> x, ConstViewOn<B, T> saved, ConstViewOn<B, T> dy, grad_t<B>* g) {
    const index_t n = x.rows();
    const auto* stats = stats_at<B>(saved.data());
    layernorm_backward_weight(be, x, ConstViewOn<B, grad_t<B>>{stats, Shape{n}}, ConstViewOn<B, grad_t<B>>{stats + n, Shape{n}},
                              dy, ViewOn<B, grad_t<B>>{g, Shape{N}}, ViewOn<B, grad_t<B>>{g + N, Shape{N}});
  }
};

}  // namespace cupipe
