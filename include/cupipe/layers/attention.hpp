// SPDX-License-Identifier: Apache-2.0
// CausalSelfAttention<C, Heads, SeqLen>: GPT-2's attention, as nanoGPT's CausalSelfAttention:
//   qkv = x c_attn^T + b (n, 3C);  att = causal softmax attention per head;  y = att c_proj^T + b.
// Its rows are whole sequences of SeqLen tokens (rows_per_sample), so a microbatch never cuts one.
// Packed sequences (the backend context's documents, core/documents.hpp): each document attends
// within itself, a causal sequence of its own length; the attention op takes the borders (on CUDA,
// every document of the microbatch in one launch). Context parallelism (the backend context's
// context_group, cp/context_group.hpp): the rows are this rank's share of each sequence, and the
// attention runs round the ring: ring_attention_forward and its backward (backend/host/ops_ring.hpp,
// backend/cuda/ops_ring.cuh).
// Parameters, in nanoGPT's names and layouts: c_attn.weight (3C, C), c_attn.bias (3C),
// c_proj.weight (C, C), c_proj.bias (C). The one-part case of detail::HeadSplitAttention, which
// TensorParallelAttention (layers/tensor_parallel.hpp) splits by heads: one code path for both.
#pragma once

#include <cmath>
#include <string>
#include <type_traits>

#include "cupipe/core/documents.hpp"
#include "cupipe/core/memory.hpp"
#include "cupipe/core/rng.hpp"
#include "cupipe/backend/host/ops_ring.hpp"
#include "cupipe/layers/layer.hpp"
#include "cupipe/layers/tensor_group_sum.hpp"

namespace cupipe {

namespace detail {

/// CausalSelfAttention<C, Heads, SeqLen> as tensor-parallel rank t of Parts runs it: heads
/// [t H/P, (t+1) H/P), c_attn.weight (3 C/P, C) and c_attn.bias (3 C/P) its rows of each of q, k and v,
/// c_proj.weight (C, C/P) its columns, c_proj.bias (C) whole; the output and the input gradient are
/// summed over the group (nothing to sum with one part: the plain layer).
template <index_t C, index_t Heads, index_t SeqLen, int Parts>
struct HeadSplitAttention {
  static_assert(C > 0 && Heads > 0 && SeqLen > 0 && Parts > 0, "CausalSelfAttention<C, Heads, SeqLen> needs positive sizes");
  static_assert(C % Heads == 0, "CausalSelfAttention<C, Heads, SeqLen>: C must be a multiple of Heads");
  static_assert(Heads % Parts == 0, "TensorParallelAttention<C, Heads, SeqLen, Parts>: Parts must divide Heads");
  static constexpr index_t heads = Heads / Parts;  ///< this rank's
  static constexpr index_t width = C / Parts;      ///< this rank's heads' channels
  static constexpr index_t in_features = C;
  static constexpr index_t out_features_for(index_t) { return C; }
  static constexpr bool takes_token_ids = false;
  static constexpr bool is_loss = false;
  static constexpr index_t rows_per_sample = SeqLen;
  static constexpr bool weight_grads_need_backward_input = true;
  /// Under context parallelism each ring step passes this rank's keys and values (cp/ring_layer.hpp).
  static constexpr index_t ring_values_per_row = 2 * width;
  static constexpr std::array<ParamSpec, 4> params(index_t) {
    return {{{"c_attn.weight", 3 * width, C, split_over<Parts>(TensorSplit::row_thirds), Parts},
             {"c_attn.bias", 3 * width, 0, split_over<Parts>(TensorSplit::row_thirds), Parts},
             {"c_proj.weight", C, width, split_over<Parts>(TensorSplit::cols), Parts},
             {"c_proj.bias", C, 0}}};
  }
  /// Per row: the log-sum-exp per head (in the compute precision, stat_slots elements each), qkv
  /// (3C), the attention output (C), and dqkv (3C), which backward_input writes for backward_weight
  /// (the zero-bubble W pass runs after B); this rank's share of each when split.
  static constexpr index_t saved_per_row(index_t) { return stat_slots * heads + 7 * width; }
  /// Two GEMMs (2 * 3C * C + 2 * C * C) and, on average over a causal sequence, (T + 1) / 2 keys per
  /// query for scores and values (2 * 2 * C each); this rank's share when split.
  static constexpr double forward_flops_per_sample(index_t) {
    return 8.0 * double(width) * double(C) + 2.0 * double(width) * double(SeqLen + 1);
  }

  /// GPT-2's initialisation (nanoGPT's _init_weights): weights N(0, 0.02), biases 0. The residual
  /// projection's extra 1/sqrt(2 L) scaling depends on the depth, so the GPT model applies it.
  template <class T>
  static void init(std::span<T> p, index_t, Rng& rng) {
    std::size_t at = 0;
    for (const ParamSpec& spec : params(C))
      for (index_t i = 0; i < spec.numel(); ++i) p[at++] = spec.cols != 0 ? T(0.02 * rng.normal()) : T(0);
  }

  template <class B, class T>
  static void forward(B& be, const T* p, ConstViewOn<B, T> x, ViewOn<B, T> y, ViewOn<B, T> saved) {
    const Parts_<B, T> s(saved.data(), x.rows());
    gemm(be, ops::Transpose::no, ops::Transpose::yes, T(1), x, w_attn<B>(p), T(0), s.qkv);
    bias_add(be, s.qkv, b_attn<B>(p));
    if (in_ring(be)) {
      if constexpr (ring_runs<B, T>)
        ring_attention_forward(be, *be.context_group, ConstViewOn<B, T>(s.qkv), s.att, s.lse, heads, SeqLen);
    } else causal_attention_forward(be, ConstViewOn<B, T>(s.qkv), s.att, s.lse, heads, SeqLen, be.documents);
    gemm(be, ops::Transpose::no, ops::Transpose::yes, T(1), ConstViewOn<B, T>(s.att), w_proj<B>(p), T(0), y);
    tensor_group_sum<Parts>(be, y, "TensorParallelAttention");
    bias_add(be, y, b_proj<B>(p));  // once, after the sum
  }

  /// datt = dy c_proj;  dqkv = attention backward (kept in `saved`);  dx = dqkv c_attn (summed).
  template <class B, class T>
  static void backward_input(B& be, const T* p, ConstViewOn<B, T> x, ViewOn<B, T> saved, ConstViewOn<B, T> dy, ViewOn<B, T> dx) {
    const index_t n = x.rows();
    const Parts_<B, T> s(saved.data(), n);
    auto datt = be.template allocate<T>(n * width, MemoryTag::workspace);
    const ViewOn<B, T> datt_view{datt.data(), Shape{n, width}};
    gemm(be, ops::Transpose::no, ops::Transpose::no, T(1), dy, w_proj<B>(p), T(0), datt_view);
    if (in_ring(be)) {
      if constexpr (ring_runs<B, T>)
        ring_attention_backward(be, *be.context_group, ConstViewOn<B, T>(s.qkv), ConstViewOn<B, T>(s.att),
                                ConstViewOn<B, T>(s.lse), ConstViewOn<B, T>(datt_view), s.dqkv, heads, SeqLen);
    } else causal_attention_backward(be, ConstViewOn<B, T>(s.qkv), ConstViewOn<B, T>(s.att), ConstViewOn<B, grad_t<B>>(s.lse),
                                     ConstViewOn<B, T>(datt_view), s.dqkv, heads, SeqLen, be.documents);
    if (dx.empty()) return;
    gemm(be, ops::Transpose::no, ops::Transpose::no, T(1), ConstViewOn<B, T>(s.dqkv), w_attn<B>(p), T(0), dx);
    tensor_group_sum<Parts>(be, dx, "TensorParallelAttention");
  }

  /// From the dqkv that backward_input kept: dc_proj += dy^T att, dc_attn += dqkv^T x, biases likewise.
  template <class B, class T = typename B::value_type>
  static void backward_weight(B& be, ConstViewOn<B, T> x, ViewOn<B, T> saved, ConstViewOn<B, T> dy, grad_t<B>* g) {
    using G = grad_t<B>;
    const Parts_<B, T> s(saved.data(), x.rows());
    gemm(be, ops::Transpose::yes, ops::Transpose::no, T(1), ConstViewOn<B, T>(s.dqkv), x, T(1),
         ViewOn<B, G>{g, Shape{3 * width, C}});
    bias_backward(be, ConstViewOn<B, T>(s.dqkv), ViewOn<B, G>{g + 3 * width * C, Shape{3 * width}});
    G* gp = g + 3 * width * C + 3 * width;
    gemm(be, ops::Transpose::yes, ops::Transpose::no, T(1), dy, ConstViewOn<B, T>(s.att), T(1), ViewOn<B, G>{gp, Shape{C, width}});
    bias_backward(be, dy, ViewOn<B, G>{gp + C * width, Shape{C}});
  }

 private:
  /// Whether the ring's attention runs: a backend context with a ring, storing activations in the
  /// compute type (fp32 or fp64: the running output is stored between the ring's steps).
  template <class B, class T>
  static constexpr bool ring_runs = requires(B& be) { be.context_group; } && std::is_same_v<T, grad_t<B>>;
  /// Whether `be` has a context-parallel ring of 2 or more ranks; refused where the ring cannot run
  /// (bf16 storage) or with document borders (packed sequences).
  template <class B>
  static bool in_ring(B& be) {
    if (cp::ring_size(be) == 1) return false;
    if constexpr (!ring_runs<B, typename B::value_type>)
      CUPIPE_THROW("CausalSelfAttention: context parallelism runs in fp32 or fp64 storage; this backend stores ",
                   "activations in another type (bf16)");
    if (!be.documents.empty())
      CUPIPE_THROW("CausalSelfAttention: packed sequences (document borders) with context parallelism are not supported; "
                   "give whole sequences or leave the ring out");
    return true;
  }
  /// The saved area of n rows, split: lse (n, Heads) first, where the saved area's alignment holds
  /// for the compute type, then qkv (n, 3C), att (n, C), dqkv (n, 3C) (this rank's share of each).
  template <class B, class T>
  struct Parts_ {
    ViewOn<B, grad_t<B>> lse;
    ViewOn<B, T> qkv, att, dqkv;
    Parts_(T* base, index_t n)
        : lse{stats_at<B>(base), Shape{n, heads}},
          qkv{base + n * stat_slots * heads, Shape{n, 3 * width}},
          att{base + n * (stat_slots * heads + 3 * width), Shape{n, width}},
          dqkv{base + n * (stat_slots * heads + 4 * width), Shape{n, 3 * width}} {}
  };
  template <class B, class T>
  static ConstViewOn<B, T> w_attn(const T* p) { return {p, Shape{3 * width, C}}; }
  template <class B, class T>
  static ConstViewOn<B, T> b_attn(const T* p) { return {p + 3 * width * C, Shape{3 * width}}; }
  template <class B, class T>
  static ConstViewOn<B, T> w_proj(const T* p) { return {p + 3 * width * C + 3 * width, Shape{C, width}}; }
  template <class B, class T>
  static ConstViewOn<B, T> b_proj(const T* p) { return {p + 3 * width * C + 3 * width + C * width, Shape{C}}; }
};

}  // namespace detail

template <index_t C, index_t Heads, index_t SeqLen>
struct CausalSelfAttention : detail::HeadSplitAttention<C, Heads, SeqLen, 1> {
  static std::string describe() {
    return "CausalSelfAttention<" + std::to_string(C) + ", " + std::to_string(Heads) + ", " + std::to_string(SeqLen) + ">";
  }
};

}  // namespace cupipe
