// SPDX-License-Identifier: Apache-2.0
// Residual<Layers...>: y = x + f(x), where f runs Layers... in order (a LayerSeq). A layer built from
// layers, so a user writes a transformer block as two of them:
//   Residual<Named<"ln_1", LayerNorm<C>>, Named<"attn", CausalSelfAttention<C, H, T>>>
//   Residual<Named<"ln_2", LayerNorm<C>>, Named<"mlp.c_fc", Linear<C, 4 * C>>, GELU, Named<"mlp.c_proj", Linear<4 * C, C>>>
// The block keeps what its backward needs in its own `saved` area: the inner record (every inner
// activation and extra) and the inner output gradients (for the zero-bubble W pass). Its parameters
// are the inner layers' in order, named "<index>.<name>" as Sequential names them, or by Named names.
#pragma once

#include <array>
#include <cstddef>
#include <span>
#include <string>
#include <utility>

#include "cupipe/core/rng.hpp"
#include "cupipe/layers/layer.hpp"
#include "cupipe/layers/named.hpp"
#include "cupipe/layers/sequential.hpp"

namespace cupipe {

template <class... Layers>
struct Residual {
  using Inner = LayerSeq<0, any_features, Layers...>;
  static_assert(!Inner::takes_token_ids, "Residual: a layer that reads token ids cannot be inside a residual block");
  static_assert(!(Layers::is_loss || ...), "Residual: a loss layer cannot be inside a residual block");
  static_assert(Inner::out_features == Inner::in_features,
                "Residual: the inner layers must give back their input width (y = x + f(x))");

  static constexpr index_t in_features = Inner::in_features;
  static constexpr index_t out_features_for(index_t) { return in_features; }
  static constexpr bool takes_token_ids = false;
  static constexpr bool is_loss = false;
  static constexpr index_t rows_per_sample = Inner::rows_per_sample;
  static constexpr index_t ring_values_per_row = ring_values_of<Inner>();
  static constexpr index_t all_to_all_values_per_row = all_to_all_values_of<Inner>();
  /// backward_input fills the inner output gradients that backward_weight reads.
  static constexpr bool weight_grads_need_backward_input = true;

 private:
  static constexpr std::size_t param_tensors = (std::size_t(0) + ... + Layers::params(detail::naming_width<Layers>).size());
  struct Entries {
    static constexpr auto entries = [] {
      std::array<detail::NameEntry, param_tensors> out{};
      std::size_t at = 0;
      [&]<std::size_t... I>(std::index_sequence<I...>) {
        (
            [&] {
              using L = typename Inner::template layer<I>;
              for (const ParamSpec& p : L::params(Inner::widths[I]))
                out[at++] = {std::string_view{}, is_named<L> ? -1 : int(I), p.name, p.rows, p.cols, p.split, p.parts};
            }(),
            ...);
      }(std::make_index_sequence<Inner::size>());
      return out;
    }();
  };

 public:
  static constexpr const auto& params(index_t) { return detail::joined_names<Entries>::specs; }
  static constexpr index_t saved_per_row(index_t) { return Inner::record_per_row + Inner::grad_record_per_row; }
  static constexpr double forward_flops_per_sample(index_t) { return Inner::forward_flops_per_sample + double(in_features); }
  static std::string describe() { return "Residual<" + Inner::describe() + ">"; }

  /// The inner layers initialise as they would in a Sequential, from a seed drawn from `rng`.
  template <class T>
  static void init(std::span<T> p, index_t, Rng& rng) {
    Inner::init(p, rng.next_u64());
  }

  template <class B, class T>
  static void forward(B& be, const T* p, ConstViewOn<B, T> x, ViewOn<B, T> y, ViewOn<B, T> saved) {
    const index_t n = x.rows();
    T* record = saved.data();
    Inner::forward(be, p, x, record);
    residual_add(be, x, ConstViewOn<B, T>(Inner::template output<typename B::space>(record, n)), y);
  }

  /// dx = dy + (df/dx)^T dy; the inner output gradients stay in `saved` for backward_weight.
  template <class B, class T>
  static void backward_input(B& be, const T* p, ConstViewOn<B, T> x, ViewOn<B, T> saved, ConstViewOn<B, T> dy, ViewOn<B, T> dx) {
    const index_t n = x.rows();
    T* record = saved.data();
    Inner::backward(be, p, x, record, dy, dx, static_cast<grad_t<B>*>(nullptr), record + Inner::record_elements(n), false);
    if (!dx.empty()) axpy(be, T(1), dy, dx);
  }

  template <class B, class T = typename B::value_type>
  static void backward_weight(B& be, ConstViewOn<B, T> x, ViewOn<B, T> saved, ConstViewOn<B, T> dy, grad_t<B>* g) {
    const index_t n = x.rows();
    const T* record = saved.data();
    Inner::backward_weight(be, x, record, dy, record + Inner::record_elements(n), g);
  }
};

template <class... Layers>
struct whole_layer<Residual<Layers...>> {
  using type = Residual<whole_layer_t<Layers>...>;
};

}  // namespace cupipe
