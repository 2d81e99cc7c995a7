// SPDX-License-Identifier: Apache-2.0
// Host ops for backend::Host<bfloat16, float>: bf16 storage, fp32 compute, as a GPU runs it. Every op
// widens its bf16 inputs to float (exactly), runs the float op of backend/host/ops.hpp through the
// context's float twin, and rounds each result to the nearest bf16 (ties to even) when it stores it.
// A device kernel that reads bf16, computes in float and rounds on its store gives the same values up
// to the order of its float additions, so this backend is a reference for the device's bf16 path.
// Statistics a layer saves for its backward (LayerNorm's mean and rstd, attention's log-sum-exp) are
// float views: the layer keeps them in its record in float (layers/layer.hpp, stat_slots), as fused
// GPU kernels do, so they are never rounded.
//
// Gradients, master weights, optimizer state and the loss are float (the compute type): the ops that
// write them (gemm into a float c, bias_backward, layernorm_backward_weight, embedding_backward,
// softmax_cross_entropy_forward) take bf16 inputs and a float output, and accumulate in float. Ops on
// float views forward to the float twin unchanged. The vocabulary-parallel cross-entropy ops
// (softmax_cross_entropy_part_stats, _part_backward) widen their bf16 logits the same way.
#pragma once

#include <algorithm>
#include <cstdint>
#include <string_view>
#include <utility>
#include <vector>

#include "cupipe/backend/host/host.hpp"
#include "cupipe/backend/host/ops.hpp"
#include "cupipe/core/dtype.hpp"
#include "cupipe/core/tensor.hpp"

namespace cupipe::ops {

using HostBf16 = backend::Host<bfloat16, float>;

namespace detail {

/// A float copy of a bf16 tensor (or a float tensor of its shape, to be rounded into it afterwards).
class Widened {
 public:
  /// The values of `from`, widened exactly. A null view with elements is refused, naming `op`.
  Widened(TensorView<const bfloat16> from, std::string_view op, std::string_view what) : shape_(from.shape()) {
    check_view(from, from.shape(), op, what);
    values_.resize(static_cast<std::size_t>(from.numel()));
    for (std::size_t i = 0; i < values_.size(); ++i) values_[i] = static_cast<float>(from.data()[i]);
  }
  /// Zeros in the shape of `to` (an output the op overwrites); refuses a null view with elements.
  Widened(const TensorView<bfloat16>& to, std::string_view op, std::string_view what, bool read) : shape_(to.shape()) {
    check_view(to, to.shape(), op, what);
    values_.resize(static_cast<std::size_t>(to.numel()));
    if (read)
      for (std::size_t i = 0; i < values_.size(); ++i) values_[i] = static_cast<float>(to.data()[i]);
  }
  TensorView<float> view() noexcept { return {values_.data(), shape_}; }
  /// Rounds every value to the nearest bf16 into `to` (same shape).
  void store(const TensorView<bfloat16>& to) const noexcept {
    for (std::size_t i = 0; i < values_.size(); ++i) to.data()[i] = bfloat16(values_[i]);
  }

 private:
  Shape shape_;
  std::vector<float> values_;
};

inline Widened in(TensorView<const bfloat16> v, std::string_view op, std::string_view what) { return {v, op, what}; }
inline Widened out(const TensorView<bfloat16>& v, std::string_view op, std::string_view what) { return {v, op, what, false}; }
inline Widened inout(const TensorView<bfloat16>& v, std::string_view op, std::string_view what) { return {v, op, what, true}; }

}  // namespace detail

// ---- GEMM: bf16 a and b, float accumulation; c in bf16 (rounded once) or float (accumulated) ----

inline void gemm(HostBf16& be, Transpose ta, Transpose tb, ComputeScalar alpha, ConstView<bfloat16> a, ConstView<bfloat16> b,
                 ComputeScalar beta, TensorView<bfloat16> c) {
  auto wa = detail::in(a, "gemm", "a"), wb = detail::in(b, "gemm", "b");
  auto wc = beta.value != 0.0f ? detail::inout(c, "gemm", "c") : detail::out(c, "gemm", "c");
  gemm(be.widened(), ta, tb, alpha.value, wa.view(), wb.view(), beta.value, wc.view());
  wc.store(c);
}
inline void gemm(HostBf16& be, Transpose ta, Transpose tb, ComputeScalar alpha, ConstView<bfloat16> a, ConstView<bfloat16> b,
                 ComputeScalar beta, TensorView<float> c) {
  auto wa = detail::in(a, "gemm", "a"), wb = detail::in(b, "gemm", "b");
  gemm(be.widened(), ta, tb, alpha.value, wa.view(), wb.view(), beta.value, c);
}

/// y = alpha op(a) op(b) + bias, the bias added in float and y rounded once: what cuBLASLt's bias
/// epilogue computes on Cuda<bfloat16, float>, so a Linear (layers/linear.hpp, fuses_bias) rounds
/// its output once on both backends.
inline void gemm_bias(HostBf16& be, Transpose ta, Transpose tb, ComputeScalar alpha, ConstView<bfloat16> a,
                      ConstView<bfloat16> b, ConstView<bfloat16> bias, TensorView<bfloat16> y) {
  check_view(bias, Shape{y.cols()}, "gemm_bias", "bias");
  auto wa = detail::in(a, "gemm_bias", "a"), wb = detail::in(b, "gemm_bias", "b"), wbias = detail::in(bias, "gemm_bias", "bias");
  auto wy = detail::out(y, "gemm_bias", "y");
  gemm(be.widened(), ta, tb, alpha.value, wa.view(), wb.view(), 0.0f, wy.view());
  bias_add(be.widened(), wy.view(), wbias.view());
  wy.store(y);
}

// ---- elementwise and broadcast ----

inline void bias_add(HostBf16& be, TensorView<bfloat16> y, ConstView<bfloat16> bias) {
  auto wy = detail::inout(y, "bias_add", "y"), wb = detail::in(bias, "bias_add", "bias");
  bias_add(be.widened(), wy.view(), wb.view());
  wy.store(y);
}
inline void bias_backward(HostBf16& be, ConstView<bfloat16> dy, TensorView<float> dbias) {
  auto wdy = detail::in(dy, "bias_backward", "dy");
  bias_backward(be.widened(), wdy.view(), dbias);
}
inline void relu_forward(HostBf16& be, ConstView<bfloat16> x, TensorView<bfloat16> y) {
  auto wx = detail::in(x, "relu_forward", "x"), wy = detail::out(y, "relu_forward", "y");
  relu_forward(be.widened(), wx.view(), wy.view());
  wy.store(y);
}
inline void relu_backward(HostBf16& be, ConstView<bfloat16> x, ConstView<bfloat16> dy, TensorView<bfloat16> dx) {
  auto wx = detail::in(x, "relu_backward", "x"), wdy = detail::in(dy, "relu_backward", "dy");
  auto wdx = detail::out(dx, "relu_backward", "dx");
  relu_backward(be.widened(), wx.view(), wdy.view(), wdx.view());
  wdx.store(dx);
}
inline void gelu_forward(HostBf16& be, ConstView<bfloat16> x, TensorView<bfloat16> y) {
  auto wx = detail::in(x, "gelu_forward", "x"), wy = detail::out(y, "gelu_forward", "y");
  gelu_forward(be.widened(), wx.view(), wy.view());
  wy.store(y);
}
inline void gelu_backward(HostBf16& be, ConstView<bfloat16> x, ConstView<bfloat16> dy, TensorView<bfloat16> dx) {
  auto wx = detail::in(x, "gelu_backward", "x"), wdy = detail::in(dy, "gelu_backward", "dy");
  auto wdx = detail::out(dx, "gelu_backward", "dx");
  gelu_backward(be.widened(), wx.view(), wdy.view(), wdx.view());
  wdx.store(dx);
}
/// bf16 storage: a bf16 wire is the storage itself (a copy); e4m3 runs on the widened values.
inline void wire_round_trip(HostBf16& be, ConstView<bfloat16> x, TensorView<bfloat16> y, Wire wire) {
  checks::wire_round_trip(x, y);
  if (wire != Wire::e4m3) {
    if (y.data() != x.data()) std::copy_n(x.data(), x.numel(), y.data());
    return;
  }
  auto wx = detail::in(x, "wire_round_trip", "x");
  auto wy = detail::out(y, "wire_round_trip", "y");
  wire_round_trip(be.widened(), wx.view(), wy.view(), wire);
  wy.store(y);
}
/// bf16 storage packs only for e4m3, from the widened values, as wire_round_trip computes.
inline void wire_pack(HostBf16&, ConstView<bfloat16> x, TensorView<bfloat16> packed, Wire wire) {
  checks::wire_pack(x, packed, wire);
  auto wx = detail::in(x, "wire_pack", "x");
  detail::pack_wire(wx.view().data(), x.numel(), detail::zero_padding(packed, wire, x.numel()), wire);
}
inline void wire_unpack(HostBf16&, ConstView<bfloat16> packed, TensorView<bfloat16> y, Wire wire) {
  checks::wire_unpack(packed, y, wire);
  auto wy = detail::out(y, "wire_unpack", "y");
  detail::unpack_wire(reinterpret_cast<const unsigned char*>(packed.data()), y.numel(), wy.view().data(), wire);
  wy.store(y);
}
inline void residual_add(HostBf16& be, ConstView<bfloat16> a, ConstView<bfloat16> b, TensorView<bfloat16> y) {
  auto wa = detail::in(a, "residual_add", "a"), wb = detail::in(b, "residual_add", "b");
  auto wy = detail::out(y, "residual_add", "y");
  residual_add(be.widened(), wa.view(), wb.view(), wy.view());
  wy.store(y);
}
inline void axpy(HostBf16& be, ComputeScalar alpha, ConstView<bfloat16> x, TensorView<bfloat16> y) {
  auto wx = detail::in(x, "axpy", "x"), wy = detail::inout(y, "axpy", "y");
  axpy(be.widened(), alpha.value, wx.view(), wy.view());
  wy.store(y);
}
inline void axpy(HostBf16& be, ComputeScalar alpha, ConstView<float> x, TensorView<float> y) {
  axpy(be.widened(), alpha.value, x, y);
}
/// y (float, a gradient) += alpha x (bf16, an activation gradient).
inline void axpy(HostBf16& be, ComputeScalar alpha, ConstView<bfloat16> x, TensorView<float> y) {
  auto wx = detail::in(x, "axpy", "x");
  axpy(be.widened(), alpha.value, wx.view(), y);
}
/// A copy moves bits: no rounding happens.
inline void copy(HostBf16&, ConstView<bfloat16> from, TensorView<bfloat16> to) {
  checks::copy(from, to);
  std::copy_n(from.data(), from.numel(), to.data());
}
inline void copy(HostBf16& be, ConstView<float> from, TensorView<float> to) { copy(be.widened(), from, to); }
inline void fill(HostBf16&, TensorView<bfloat16> y, ComputeScalar value) {
  checks::fill(y);
  std::fill_n(y.data(), y.numel(), bfloat16(value.value));
}
inline void fill(HostBf16& be, TensorView<float> y, ComputeScalar value) { fill(be.widened(), y, value.value); }

/// Float to bf16 (nearest even) and bf16 to float (exact): master weights to the parameters in use.
inline void convert(HostBf16&, ConstView<float> from, TensorView<bfloat16> to) {
  check_view(from, from.shape(), "convert", "from");
  check_view(to, from.shape(), "convert", "to");
  for (index_t i = 0; i < from.numel(); ++i) to.data()[i] = bfloat16(from.data()[i]);
}
inline void convert(HostBf16&, ConstView<bfloat16> from, TensorView<float> to) {
  check_view(from, from.shape(), "convert", "from");
  check_view(to, from.shape(), "convert", "to");
  for (index_t i = 0; i < from.numel(); ++i) to.data()[i] = static_cast<float>(from.data()[i]);
}

// ---- LayerNorm: statistics in float, kept in float (as a fused GPU kernel keeps them) ----

inline void layernorm_forward(HostBf16& be, ConstView<bfloat16> x, ConstView<bfloat16> gamma, ConstView<bfloat16> beta,
                              TensorView<bfloat16> y, TensorView<float> mean, TensorView<float> rstd, double eps) {
  auto wx = detail::in(x, "layernorm_forward", "x"), wg = detail::in(gamma, "layernorm_forward", "gamma");
  auto wb = detail::in(beta, "layernorm_forward", "beta");
  auto wy = detail::out(y, "layernorm_forward", "y");
  layernorm_forward(be.widened(), wx.view(), wg.view(), wb.view(), wy.view(), mean, rstd, eps);
  wy.store(y);
}
inline void layernorm_backward_input(HostBf16& be, ConstView<bfloat16> x, ConstView<bfloat16> gamma, ConstView<float> mean,
                                     ConstView<float> rstd, ConstView<bfloat16> dy, TensorView<bfloat16> dx) {
  constexpr std::string_view op = "layernorm_backward_input";
  auto wx = detail::in(x, op, "x"), wg = detail::in(gamma, op, "gamma"), wdy = detail::in(dy, op, "dy");
  auto wdx = detail::out(dx, op, "dx");
  layernorm_backward_input(be.widened(), wx.view(), wg.view(), mean, rstd, wdy.view(), wdx.view());
  wdx.store(dx);
}
inline void layernorm_backward_weight(HostBf16& be, ConstView<bfloat16> x, ConstView<float> mean, ConstView<float> rstd,
                                      ConstView<bfloat16> dy, TensorView<float> dgamma, TensorView<float> dbeta) {
  constexpr std::string_view op = "layernorm_backward_weight";
  auto wx = detail::in(x, op, "x"), wdy = detail::in(dy, op, "dy");
  layernorm_backward_weight(be.widened(), wx.view(), mean, rstd, wdy.view(), dgamma, dbeta);
}

// ---- softmax cross-entropy: bf16 logits, the loss in float ----

inline void softmax_cross_entropy_forward(HostBf16& be, ConstView<bfloat16> logits, ConstView<std::int32_t> labels,
                                          TensorView<float> loss, index_t normalizer) {
  auto wz = detail::in(logits, "softmax_cross_entropy_forward", "logits");
  softmax_cross_entropy_forward(be.widened(), wz.view(), labels, loss, normalizer);
}
inline void softmax_cross_entropy_backward(HostBf16& be, ConstView<bfloat16> logits, ConstView<std::int32_t> labels,
                                           TensorView<bfloat16> dlogits, index_t normalizer, ComputeScalar dloss = 1.0f) {
  auto wz = detail::in(logits, "softmax_cross_entropy_backward", "logits");
  auto wd = detail::out(dlogits, "softmax_cross_entropy_backward", "dlogits");
  softmax_cross_entropy_backward(be.widened(), wz.view(), labels, wd.view(), normalizer, dloss.value);
  wd.store(dlogits);
}
/// The vocabulary-parallel loss's parts (tensor parallelism): bf16 logits, float statistics and
/// log-sum-exp, bf16 dlogits.
inline void softmax_cross_entropy_part_stats(HostBf16& be, ConstView<bfloat16> logits, ConstView<std::int32_t> labels,
                                             TensorView<float> stats, VocabPart part) {
  auto wz = detail::in(logits, "softmax_cross_entropy_part_stats", "logits");
  softmax_cross_entropy_part_stats(be.widened(), wz.view(), labels, stats, part);
}
inline void softmax_cross_entropy_part_backward(HostBf16& be, ConstView<bfloat16> logits, ConstView<std::int32_t> labels,
                                                ConstView<float> lse, TensorView<bfloat16> dlogits, index_t normalizer,
                                                VocabPart part, ComputeScalar dloss = 1.0f) {
  auto wz = detail::in(logits, "softmax_cross_entropy_part_backward", "logits");
  auto wd = detail::out(dlogits, "softmax_cross_entropy_part_backward", "dlogits");
  softmax_cross_entropy_part_backward(be.widened(), wz.view(), labels, lse, wd.view(), normalizer, part, dloss.value);
  wd.store(dlogits);
}

// ---- embedding: a bf16 table gathers exactly; its gradient accumulates in float ----

inline void embedding_forward(HostBf16& be, ConstView<std::int32_t> ids, ConstView<bfloat16> table, TensorView<bfloat16> y,
                              VocabPart part) {
  auto wt = detail::in(table, "embedding_forward", "table"), wy = detail::out(y, "embedding_forward", "y");
  embedding_forward(be.widened(), ids, wt.view(), wy.view(), part);
  wy.store(y);
}
inline void embedding_forward(HostBf16& be, ConstView<std::int32_t> ids, ConstView<bfloat16> table, TensorView<bfloat16> y) {
  embedding_forward(be, ids, table, y, VocabPart{0, table.rows()});
}
inline void embedding_backward(HostBf16& be, ConstView<std::int32_t> ids, ConstView<bfloat16> dy, TensorView<float> dtable,
                               VocabPart part) {
  auto wdy = detail::in(dy, "embedding_backward", "dy");
  embedding_backward(be.widened(), ids, wdy.view(), dtable, part);
}
inline void embedding_backward(HostBf16& be, ConstView<std::int32_t> ids, ConstView<bfloat16> dy, TensorView<float> dtable) {
  embedding_backward(be, ids, dy, dtable, VocabPart{0, dtable.rows()});
}

// ---- causal attention: scores, softmax and sums in float; out and dqkv stored in bf16, lse in float ----

inline void causal_attention_forward(HostBf16& be, ConstView<bfloat16> qkv, TensorView<bfloat16> out, TensorView<float> lse,
                                     index_t heads, index_t seq_len, const DocumentStarts& documents = {}) {
  constexpr std::string_view op = "causal_attention_forward";
  auto wq = detail::in(qkv, op, "qkv"), wo = detail::out(out, op, "out");
  causal_attention_forward(be.widened(), wq.view(), wo.view(), lse, heads, seq_len, documents);
  wo.store(out);
}
inline void causal_attention_backward(HostBf16& be, ConstView<bfloat16> qkv, ConstView<bfloat16> out, ConstView<float> lse,
                                      ConstView<bfloat16> dout, TensorView<bfloat16> dqkv, index_t heads, index_t seq_len,
                                      const DocumentStarts& documents = {}) {
  constexpr std::string_view op = "causal_attention_backward";
  auto wq = detail::in(qkv, op, "qkv"), wo = detail::in(out, op, "out");
  auto wd = detail::in(dout, op, "dout"), wdq = detail::out(dqkv, op, "dqkv");
  causal_attention_backward(be.widened(), wq.view(), wo.view(), lse, wd.view(), wdq.view(), heads, seq_len, documents);
  wdq.store(dqkv);
}

// ---- reductions and optimizer updates (in float, on the master weights) ----

inline double sum_of_squares(HostBf16& be, ConstView<bfloat16> x) {
  auto wx = detail::in(x, "sum_of_squares", "x");
  return sum_of_squares(be.widened(), wx.view());
}
inline double sum_of_squares(HostBf16& be, ConstView<float> x) { return sum_of_squares(be.widened(), x); }

inline void sgd_update(HostBf16& be, TensorView<float> param, ConstView<float> grad, TensorView<float> velocity, const SgdHyper& h,
                       ComputeScalar grad_scale) {
  sgd_update(be.widened(), param, grad, velocity, h, grad_scale.value);
}
inline void adamw_update(HostBf16& be, TensorView<float> param, ConstView<float> grad, TensorView<float> m, TensorView<float> v,
                         const AdamWHyper& h, std::int64_t step, ComputeScalar grad_scale) {
  adamw_update(be.widened(), param, grad, m, v, h, step, grad_scale.value);
}
/// AdamW on the float master weights, then the bf16 parameters in use become their rounding (as
/// the CUDA backend's adamw_update_master).
inline void adamw_update_master(HostBf16& be, TensorView<float> master, TensorView<bfloat16> param, ConstView<float> grad,
                                TensorView<float> m, TensorView<float> v, const AdamWHyper& h, std::int64_t step,
                                ComputeScalar grad_scale) {
  check_view(param, master.shape(), "adamw_update_master", "param");
  adamw_update(be.widened(), master, grad, m, v, h, step, grad_scale.value);
  convert(be, ConstView<float>(master), param);
}

}  // namespace cupipe::ops
