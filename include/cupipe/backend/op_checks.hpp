// SPDX-License-Identifier: Apache-2.0
// The argument checks of every op, backend-neutral: the layer between an op's public overload and its
// backend implementation. Each backend's overload of op X calls checks::X first, with the same
// arguments, and only then does its own work, so every backend rejects the same calls with the same
// message (naming the op, the argument and both shapes) before touching memory.
//
// Checks that read tensor contents stay with the backend that can read them: the host checks labels
// and token ids itself; the CUDA kernels report them and throw through the messages below.
#pragma once

#include <array>
#include <cstdint>
#include <string_view>

#include "cupipe/backend/op_types.hpp"
#include "cupipe/core/documents.hpp"
#include "cupipe/core/error.hpp"
#include "cupipe/core/shape.hpp"
#include "cupipe/core/tensor.hpp"
#include "cupipe/core/wire.hpp"
#include "cupipe/cp/zigzag.hpp"

namespace cupipe::ops::checks {

inline Shape transposed_if(const Shape& s, Transpose t) {
  return t == Transpose::yes ? Shape{s.cols(), s.rows()} : Shape{s.rows(), s.cols()};
}

/// c = op(a) op(b): op(a) (m, k), op(b) (k, n), c (m, n). Returns {m, n, k}. `op` names the entry
/// point (gemm, gemm_bias, ...); a and b may have another element type than c (bf16 GEMM).
template <class AB, class C, class S>
std::array<index_t, 3> gemm(std::string_view op, Transpose ta, Transpose tb, TensorView<const AB, S> a,
                            TensorView<const AB, S> b, const TensorView<C, S>& c) {
  const Shape opa = transposed_if(a.shape(), ta), opb = transposed_if(b.shape(), tb);
  const index_t m = opa[0], k = opa[1], n = opb[1];
  if (opb[0] != k)
    CUPIPE_THROW(op, ": op(a) is ", opa, " and op(b) is ", opb, ": their inner extents ", k, " and ", opb[0],
                 " must be equal");
  if (c.rows() != m || c.cols() != n)
    CUPIPE_THROW(op, ": op(a) is ", opa, " and op(b) is ", opb, ", so c must be (", m, ", ", n, ") but is ",
                 c.shape());
  if (m != 0 && n != 0)
    CUPIPE_REQUIRE(c.data() != nullptr && (k == 0 || (a.data() && b.data())), op, ": null operand");
  return {m, n, k};
}

// ---- elementwise and broadcast ops ----------------------------------------------------------

/// The views of an elementwise op, named in order by `names`: each must be a valid view of the first
/// one's shape.
template <class First, class... Rest>
void same_shape(std::string_view op, const std::array<std::string_view, 1 + sizeof...(Rest)>& names, const First& first,
                const Rest&... rest) {
  std::size_t i = 0;
  check_view(first, first.shape(), op, names[i++]);
  (check_view(rest, first.shape(), op, names[i++]), ...);
}

template <class T, class S>
void bias_add(const TensorView<T, S>& y, TensorView<const T, S> bias) {
  check_view(y, y.shape(), "bias_add", "y");
  check_view(bias, Shape{y.cols()}, "bias_add", "bias");
}

template <class T, class S, class G>
void bias_backward(TensorView<const T, S> dy, const TensorView<G, S>& dbias) {
  check_view(dy, dy.shape(), "bias_backward", "dy");
  check_view(dbias, Shape{dy.cols()}, "bias_backward", "dbias");
}

template <class T, class S>
void relu_forward(TensorView<const T, S> x, const TensorView<T, S>& y) {
  same_shape("relu_forward", {"x", "y"}, x, y);
}

template <class T, class S>
void relu_backward(TensorView<const T, S> x, TensorView<const T, S> dy, const TensorView<T, S>& dx) {
  same_shape("relu_backward", {"x", "dy", "dx"}, x, dy, dx);
}

template <class T, class S>
void gelu_forward(TensorView<const T, S> x, const TensorView<T, S>& y) {
  same_shape("gelu_forward", {"x", "y"}, x, y);
}

template <class T, class S>
void gelu_backward(TensorView<const T, S> x, TensorView<const T, S> dy, const TensorView<T, S>& dx) {
  same_shape("gelu_backward", {"x", "dy", "dx"}, x, dy, dx);
}

template <class T, class S>
void residual_add(TensorView<const T, S> a, TensorView<const T, S> b, const TensorView<T, S>& y) {
  same_shape("residual_add", {"a", "b", "y"}, a, b, y);
}

template <class T, class S, class Y>
void axpy(TensorView<const T, S> x, const TensorView<Y, S>& y) {
  same_shape("axpy", {"x", "y"}, x, y);
}

template <class T, class S>
void copy(TensorView<const T, S> from, const TensorView<T, S>& to) {
  same_shape("copy", {"source", "destination"}, from, to);
}

template <class T, class S>
void fill(const TensorView<T, S>& y) {
  check_view(y, y.shape(), "fill", "y");
}

/// The stage-to-stage hand-over (backend/host/host.hpp, backend/cuda/transfer.cuh).
template <class T, class S>
void transfer(TensorView<const T, S> src, const TensorView<T, S>& dst) {
  same_shape("transfer", {"source", "destination"}, src, dst);
}

/// A hand-over's round trip through its wire precision (core/wire.hpp).
template <class T, class S>
void wire_round_trip(TensorView<const T, S> x, const TensorView<T, S>& y) {
  same_shape("wire_round_trip", {"x", "y"}, x, y);
}

/// A compressed hand-over's message (core/wire.hpp): `packed` holds wire_elements<T>(wire, n) values
/// of storage for the n values of `values`.
template <class T, class S, class V, class P>
void wire_message(const char* op, const TensorView<V, S>& values, const TensorView<P, S>& packed, Wire wire) {
  check_view(values, values.shape(), op, "values");
  check_view(packed, packed.shape(), op, "packed");
  if (!wire_packs<T>(wire))
    CUPIPE_THROW(op, ": a ", name(wire), " link over ", sizeof(T), "-byte storage sends the values themselves, "
                 "not a packed message");
  if (packed.numel() != wire_elements<T>(wire, values.numel()))
    CUPIPE_THROW(op, ": ", values.numel(), " values as ", name(wire), " take ", wire_elements<T>(wire, values.numel()),
                 " elements of storage, but the packed message has ", packed.numel());
}
template <class T, class S>
void wire_pack(TensorView<const T, S> x, const TensorView<T, S>& packed, Wire wire) {
  wire_message<T>("wire_pack", x, packed, wire);
}
template <class T, class S>
void wire_unpack(TensorView<const T, S> packed, const TensorView<T, S>& y, Wire wire) {
  wire_message<T>("wire_unpack", y, packed, wire);
}

// ---- LayerNorm --------------------------------------------------------------------------------

template <class T, class S, class M>
void layernorm_forward(TensorView<const T, S> x, TensorView<const T, S> gamma, TensorView<const T, S> beta,
                       const TensorView<T, S>& y, const TensorView<M, S>& mean, const TensorView<M, S>& rstd) {
  const index_t rows = x.rows(), n = x.cols();
  check_view(x, x.shape(), "layernorm_forward", "x");
  check_view(gamma, Shape{n}, "layernorm_forward", "gamma");
  check_view(beta, Shape{n}, "layernorm_forward", "beta");
  check_view(y, x.shape(), "layernorm_forward", "y");
  check_view(mean, Shape{rows}, "layernorm_forward", "mean");
  check_view(rstd, Shape{rows}, "layernorm_forward", "rstd");
}

template <class T, class S, class M>
void layernorm_backward_input(TensorView<const T, S> x, TensorView<const T, S> gamma, TensorView<const M, S> mean,
                              TensorView<const M, S> rstd, TensorView<const T, S> dy, const TensorView<T, S>& dx) {
  const index_t rows = x.rows(), n = x.cols();
  check_view(x, x.shape(), "layernorm_backward_input", "x");
  check_view(gamma, Shape{n}, "layernorm_backward_input", "gamma");
  check_view(mean, Shape{rows}, "layernorm_backward_input", "mean");
  check_view(rstd, Shape{rows}, "layernorm_backward_input", "rstd");
  check_view(dy, x.shape(), "layernorm_backward_input", "dy");
  check_view(dx, x.shape(), "layernorm_backward_input", "dx");
}

template <class T, class S, class M, class G>
void layernorm_backward_weight(TensorView<const T, S> x, TensorView<const M, S> mean, TensorView<const M, S> rstd,
                               TensorView<const T, S> dy, const TensorView<G, S>& dgamma, const TensorView<G, S>& dbeta) {
  const index_t rows = x.rows(), n = x.cols();
  check_view(x, x.shape(), "layernorm_backward_weight", "x");
  check_view(mean, Shape{rows}, "layernorm_backward_weight", "mean");
  check_view(rstd, Shape{rows}, "layernorm_backward_weight", "rstd");
  check_view(dy, x.shape(), "layernorm_backward_weight", "dy");
  check_view(dgamma, Shape{n}, "layernorm_backward_weight", "dgamma");
  check_view(dbeta, Shape{n}, "layernorm_backward_weight", "dbeta");
}

// ---- softmax cross-entropy --------------------------------------------------------------------

template <class T, class S, class L>
void softmax_cross_entropy_forward(TensorView<const T, S> logits, TensorView<const std::int32_t, S> labels,
                                   const TensorView<L, S>& loss, index_t normalizer) {
  check_view(logits, logits.shape(), "softmax_cross_entropy_forward", "logits");
  check_view(labels, Shape{logits.rows()}, "softmax_cross_entropy_forward", "labels");
  check_view(loss, Shape{1}, "softmax_cross_entropy_forward", "loss");
  CUPIPE_REQUIRE(normalizer > 0, "softmax_cross_entropy_forward: normalizer must be positive, got ", normalizer);
}

template <class T, class S>
void softmax_cross_entropy_backward(TensorView<const T, S> logits, TensorView<const std::int32_t, S> labels,
                                    const TensorView<T, S>& dlogits, index_t normalizer) {
  check_view(logits, logits.shape(), "softmax_cross_entropy_backward", "logits");
  check_view(labels, Shape{logits.rows()}, "softmax_cross_entropy_backward", "labels");
  check_view(dlogits, logits.shape(), "softmax_cross_entropy_backward", "dlogits");
  CUPIPE_REQUIRE(normalizer > 0, "softmax_cross_entropy_backward: normalizer must be positive, got ", normalizer);
}

/// The message for a label outside the class range [0, classes), wherever a backend finds it.
[[noreturn]] inline void label_out_of_range(std::string_view op, std::int64_t label, index_t row, const Shape& logits,
                                            index_t classes) {
  CUPIPE_THROW(op, ": label ", label, " at row ", row, " is outside [0, ", classes, ") for logits ", logits);
}
[[noreturn]] inline void label_out_of_range(std::string_view op, std::int64_t label, index_t row, const Shape& logits) {
  label_out_of_range(op, label, row, logits, logits.cols());
}

/// A vocabulary part of `count` entries (a table's rows, the logits' columns) must lie inside its
/// whole vocabulary.
inline void vocab_part(std::string_view op, const ops::VocabPart& part, index_t count) {
  CUPIPE_REQUIRE(part.first >= 0 && part.first + count <= part.whole, op, ": a vocabulary part of ", count,
                 " entries from ", part.first, " does not fit a vocabulary of ", part.whole);
}

// ---- vocabulary-parallel cross-entropy ----------------------------------------------------------
// logits (rows, count) are columns [first, first + count) of a whole vocabulary's logits; labels
// (rows,) index the whole vocabulary.

template <class T, class C, class S>
void softmax_cross_entropy_part_stats(TensorView<const T, S> logits, TensorView<const std::int32_t, S> labels,
                                      const TensorView<C, S>& stats, const ops::VocabPart& part) {
  check_view(logits, logits.shape(), "softmax_cross_entropy_part_stats", "logits");
  check_view(labels, Shape{logits.rows()}, "softmax_cross_entropy_part_stats", "labels");
  check_view(stats, Shape{logits.rows(), 3}, "softmax_cross_entropy_part_stats", "stats");
  vocab_part("softmax_cross_entropy_part_stats", part, logits.cols());
}

template <class T, class C, class S>
void softmax_cross_entropy_part_backward(TensorView<const T, S> logits, TensorView<const std::int32_t, S> labels,
                                         TensorView<const C, S> lse, const TensorView<T, S>& dlogits, index_t normalizer,
                                         const ops::VocabPart& part) {
  check_view(logits, logits.shape(), "softmax_cross_entropy_part_backward", "logits");
  check_view(labels, Shape{logits.rows()}, "softmax_cross_entropy_part_backward", "labels");
  check_view(lse, Shape{logits.rows()}, "softmax_cross_entropy_part_backward", "lse");
  check_view(dlogits, logits.shape(), "softmax_cross_entropy_part_backward", "dlogits");
  CUPIPE_REQUIRE(normalizer > 0, "softmax_cross_entropy_part_backward: normalizer must be positive, got ", normalizer);
  vocab_part("softmax_cross_entropy_part_backward", part, logits.cols());
}

// ---- embedding --------------------------------------------------------------------------------

// The table may be a part of the vocabulary (ops::VocabPart): ids outside it give zero rows and no
// gradient.

template <class T, class S>
void embedding_forward(TensorView<const std::int32_t, S> ids, TensorView<const T, S> table, const TensorView<T, S>& y,
                       const ops::VocabPart& part) {
  check_view(table, table.shape(), "embedding_forward", "table");
  check_view(y, Shape{ids.numel(), table.cols()}, "embedding_forward", "y");
  check_view(ids, ids.shape(), "embedding_forward", "ids");
  vocab_part("embedding_forward", part, table.rows());
}

template <class T, class S, class G>
void embedding_backward(TensorView<const std::int32_t, S> ids, TensorView<const T, S> dy, const TensorView<G, S>& dtable,
                        const ops::VocabPart& part) {
  check_view(dtable, dtable.shape(), "embedding_backward", "dtable");
  check_view(dy, Shape{ids.numel(), dtable.cols()}, "embedding_backward", "dy");
  check_view(ids, ids.shape(), "embedding_backward", "ids");
  vocab_part("embedding_backward", part, dtable.rows());
}

/// The message for a token id outside the vocabulary, wherever a backend finds it.
[[noreturn]] inline void token_id_out_of_range(std::string_view op, std::int64_t id, index_t row, index_t vocab) {
  CUPIPE_THROW(op, ": token id ", id, " at row ", row, " is outside the vocabulary [0, ", vocab, ")");
}

// ---- causal self-attention ----------------------------------------------------------------------
// qkv (n, 3C): each row is [q | k | v] of one token, each C = heads * head_dim wide, head h in columns
// [h * head_dim, (h + 1) * head_dim) of its part (nanoGPT's split and view); the n rows are n / seq_len
// whole sequences of seq_len tokens. out (n, C); lse (n, heads): each query's log-sum-exp of its
// scaled scores, which backward reuses instead of a (T, T) matrix.

template <class T, class S>
void attention_shapes(std::string_view op, TensorView<const T, S> qkv, index_t heads, index_t seq_len) {
  check_view(qkv, qkv.shape(), op, "qkv");
  CUPIPE_REQUIRE(heads > 0 && seq_len > 0, op, ": heads (", heads, ") and sequence length (", seq_len,
                 ") must be positive");
  if (qkv.cols() % (3 * heads) != 0)
    CUPIPE_THROW(op, ": qkv is ", qkv.shape(), ": its ", qkv.cols(), " columns are not 3 * C with C a multiple of ",
                 heads, " heads");
  if (qkv.rows() % seq_len != 0)
    CUPIPE_THROW(op, ": qkv has ", qkv.rows(), " rows, not whole sequences of ", seq_len,
                 " tokens (a microbatch holds whole sequences)");
}

/// With document borders (`documents`, packed sequences: core/documents.hpp) each document is a causal
/// sequence of its own; the borders, in host memory, must describe qkv's rows.
template <class T, class S, class M>
void causal_attention_forward(TensorView<const T, S> qkv, const TensorView<T, S>& out, const TensorView<M, S>& lse,
                              index_t heads, index_t seq_len, const DocumentStarts& documents = {}) {
  attention_shapes("causal_attention_forward", qkv, heads, seq_len);
  check_view(out, Shape{qkv.rows(), qkv.cols() / 3}, "causal_attention_forward", "out");
  check_view(lse, Shape{qkv.rows(), heads}, "causal_attention_forward", "lse");
  check_documents(documents, qkv.rows(), seq_len, "causal_attention_forward (document borders)");
}

template <class T, class S, class M>
void causal_attention_backward(TensorView<const T, S> qkv, TensorView<const T, S> out, TensorView<const M, S> lse,
                               TensorView<const T, S> dout, const TensorView<T, S>& dqkv, index_t heads, index_t seq_len,
                               const DocumentStarts& documents = {}) {
  attention_shapes("causal_attention_backward", qkv, heads, seq_len);
  check_documents(documents, qkv.rows(), seq_len, "causal_attention_backward (document borders)");
  check_view(out, Shape{qkv.rows(), qkv.cols() / 3}, "causal_attention_backward", "out");
  check_view(lse, Shape{qkv.rows(), heads}, "causal_attention_backward", "lse");
  check_view(dout, out.shape(), "causal_attention_backward", "dout");
  check_view(dqkv, qkv.shape(), "causal_attention_backward", "dqkv");
}

// ---- context parallelism's ring attention ----------------------------------------------------------
// qkv (rows, 3C), out (rows, C), lse (rows, heads): this rank's rows of a ring of `cp` ranks, whole
// shares of sequences of `seq_len` tokens (2 chunks of seq_len / (2 cp) rows each), cp/ring_layer.hpp.

template <class T, class S>
void ring_rows(std::string_view op, TensorView<const T, S> qkv, index_t heads, index_t seq_len, int cp) {
  check_view(qkv, qkv.shape(), op, "qkv");
  CUPIPE_REQUIRE(heads > 0 && seq_len > 0 && cp >= 1, op, ": heads (", heads, "), sequence length (", seq_len,
                 ") and ring size (", cp, ") must be positive");
  if (qkv.cols() % (3 * heads) != 0)
    CUPIPE_THROW(op, ": qkv is ", qkv.shape(), ": its ", qkv.cols(), " columns are not 3 * C with C a multiple of ",
                 heads, " heads");
  cp::check_ring_rows(qkv.rows(), seq_len, cp, op);
}

template <class T, class S, class M>
void ring_attention_forward(TensorView<const T, S> qkv, const TensorView<T, S>& out, const TensorView<M, S>& lse,
                            index_t heads, index_t seq_len, int cp) {
  ring_rows("ring attention", qkv, heads, seq_len, cp);
  check_view(out, Shape{qkv.rows(), qkv.cols() / 3}, "ring attention", "out");
  check_view(lse, Shape{qkv.rows(), heads}, "ring attention", "lse");
}

template <class T, class S, class M>
void ring_attention_backward(TensorView<const T, S> qkv, TensorView<const T, S> out, TensorView<const M, S> lse,
                             TensorView<const T, S> dout, const TensorView<T, S>& dqkv, index_t heads, index_t seq_len, int cp) {
  ring_rows("ring attention (backward)", qkv, heads, seq_len, cp);
  check_view(out, Shape{qkv.rows(), qkv.cols() / 3}, "ring attention (backward)", "out");
  check_view(lse, Shape{qkv.rows(), heads}, "ring attention (backward)", "lse");
  check_view(dout, out.shape(), "ring attention (backward)", "dout");
  check_view(dqkv, qkv.shape(), "ring attention (backward)", "dqkv");
}

// ---- a mixture of experts' token movement ---------------------------------------------------------
// slots (n, k): where token t's choice j sits among the expert-sorted rows (S, C), or -1 where the
// choice was dropped (moe/routing.hpp's dispatch); gates (n, k) the choices' weights. The backends
// check the slot values they can read: the host as it goes, the CUDA kernels by report.

/// The message for a slot outside [-1, rows), wherever a backend finds it.
[[noreturn]] inline void moe_slot_out_of_range(std::string_view op, std::int64_t slot, index_t at, index_t rows) {
  CUPIPE_THROW(op, ": slot ", slot, " at choice ", at, " is outside the ", rows, " expert-sorted rows (and not -1, dropped)");
}

template <class T, class S>
void moe_permute(TensorView<const T, S> x, TensorView<const std::int32_t, S> slots, const TensorView<T, S>& xs) {
  check_view(x, x.shape(), "moe_permute", "x");
  check_view(slots, Shape{x.rows(), slots.cols()}, "moe_permute", "slots");
  check_view(xs, Shape{xs.rows(), x.cols()}, "moe_permute", "xs");
}

template <class T, class S>
void moe_unpermute(TensorView<const T, S> o, TensorView<const std::int32_t, S> slots, TensorView<const T, S> gates,
                   const TensorView<T, S>& y) {
  check_view(o, o.shape(), "moe_unpermute", "o");
  check_view(slots, slots.shape(), "moe_unpermute", "slots");
  check_view(gates, slots.shape(), "moe_unpermute", "gates");
  check_view(y, Shape{slots.rows(), o.cols()}, "moe_unpermute", "y");
}

template <class T, class S>
void moe_unpermute_backward(TensorView<const T, S> dy, TensorView<const T, S> o, TensorView<const std::int32_t, S> slots,
                            TensorView<const T, S> gates, const TensorView<T, S>& d_o, const TensorView<T, S>& dgates) {
  check_view(o, o.shape(), "moe_unpermute_backward", "o");
  check_view(slots, slots.shape(), "moe_unpermute_backward", "slots");
  check_view(dy, Shape{slots.rows(), o.cols()}, "moe_unpermute_backward", "dy");
  check_view(gates, slots.shape(), "moe_unpermute_backward", "gates");
  check_view(d_o, o.shape(), "moe_unpermute_backward", "d_o");
  check_view(dgates, slots.shape(), "moe_unpermute_backward", "dgates");
}

template <class T, class S>
void moe_permute_backward(TensorView<const T, S> dxs, TensorView<const std::int32_t, S> slots, const TensorView<T, S>& dx) {
  check_view(dxs, dxs.shape(), "moe_permute_backward", "dxs");
  check_view(slots, slots.shape(), "moe_permute_backward", "slots");
  check_view(dx, Shape{slots.rows(), dxs.cols()}, "moe_permute_backward", "dx");
}

// ---- optimizer updates and reductions -----------------------------------------------------------

template <class T, class S>
void sum_of_squares(TensorView<const T, S> x) {
  check_view(x, x.shape(), "sum_of_squares", "x");
}

template <class T, class S>
void sgd_update(const TensorView<T, S>& param, TensorView<const T, S> grad, const TensorView<T, S>& velocity) {
  same_shape("sgd_update", {"param", "grad", "velocity"}, param, grad, velocity);
}

/// AdamW's bias corrections count steps from 1 (adamw_update and its bf16 master-weight variant).
inline void adamw_step(std::int64_t step) {
  CUPIPE_REQUIRE(step >= 1, "adamw_update: step counts from 1, got ", step);
}

template <class T, class S>
void adamw_update(const TensorView<T, S>& param, TensorView<const T, S> grad, const TensorView<T, S>& m,
                  const TensorView<T, S>& v, std::int64_t step) {
  same_shape("adamw_update", {"param", "grad", "m", "v"}, param, grad, m, v);
  adamw_step(step);
}

}  // namespace cupipe::ops::checks
