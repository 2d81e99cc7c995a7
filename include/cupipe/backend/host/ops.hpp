// SPDX-License-Identifier: Apache-2.0
// Host ops: the reference implementation of every op cupipe's layers call. The CUDA backend provides
// the same functions, with the same signatures, overloaded on backend::Cuda<T>.
//
// Conventions, for every backend:
// - tensors are row-major; an op sees them as 2-D (rows, cols) through TensorView::rows()/cols();
// - ops named *_backward_weight and bias_backward ACCUMULATE into gradients (+=), so gradients of
//   several microbatches sum without extra passes; everything else overwrites its output;
// - every op validates shapes and null pointers first, through the backend-neutral checks of
//   backend/op_checks.hpp, and throws cupipe::error naming the op and both shapes before touching memory.
#pragma once

#include <cblas.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <numbers>
#include <type_traits>
#include <utility>
#include <vector>

#include "cupipe/backend/host/host.hpp"
#include "cupipe/backend/host/vector_math.hpp"
#include "cupipe/backend/op_checks.hpp"
#include "cupipe/backend/op_types.hpp"
#include "cupipe/backend/host/wire.hpp"
#include "cupipe/core/error.hpp"
#include "cupipe/core/tensor.hpp"

namespace cupipe::ops {

// GEMM: c = alpha * op(a) * op(b) + beta * c, with op(a) (m, k), op(b) (k, n), c (m, n).
namespace detail {

/// c (m, n; rows ldc apart) = alpha op(a) op(b) + beta c over strided rows: gemm's
/// views, and the attention's products on one head's columns of qkv.
template <class T>
void gemm_rows(Transpose ta, Transpose tb, index_t m, index_t n, index_t k, T alpha, const T* a, index_t lda, const T* b,
               index_t ldb, T beta, T* c, index_t ldc) {
  const auto cta = ta == Transpose::yes ? CblasTrans : CblasNoTrans;
  const auto ctb = tb == Transpose::yes ? CblasTrans : CblasNoTrans;
  if constexpr (std::is_same_v<T, float>)
    cblas_sgemm(CblasRowMajor, cta, ctb, int(m), int(n), int(k), alpha, a, int(lda), b, int(ldb), beta, c, int(ldc));
  else
    cblas_dgemm(CblasRowMajor, cta, ctb, int(m), int(n), int(k), alpha, a, int(lda), b, int(ldb), beta, c, int(ldc));
}

}  // namespace detail

template <class T>
void gemm(backend::Host<T>&, Transpose ta, Transpose tb, Scalar<T> alpha, ConstView<T> a, ConstView<T> b, Scalar<T> beta,
          TensorView<T> c) {
  static_assert(std::is_same_v<T, float> || std::is_same_v<T, double>, "host gemm supports float and double");
  const auto [m, n, k] = checks::gemm<T, T>("gemm", ta, tb, a, b, c);
  if (m == 0 || n == 0) return;
  detail::gemm_rows<T>(ta, tb, m, n, k, alpha, a.data(), std::max<index_t>(a.cols(), 1), b.data(),
                       std::max<index_t>(b.cols(), 1), beta, c.data(), n);
}

// Elementwise and broadcast ops.

/// y (rows, n) += bias (n) on every row.
template <class T>
void bias_add(backend::Host<T>&, TensorView<T> y, ConstView<T> bias) {
  checks::bias_add(y, bias);
  const index_t cols = y.cols();
  const T* __restrict b = bias.data();
  backend::host::vectorised<T>([=]() CUPIPE_VECTOR_BODY {
    for (index_t r = 0; r < y.rows(); ++r) {
      T* __restrict row = y.data() + r * cols;
      for (index_t c = 0; c < cols; ++c) row[c] += b[c];
    }
  });
}

/// dbias (n) += column sums of dy (rows, n).
template <class T>
void bias_backward(backend::Host<T>&, ConstView<T> dy, TensorView<T> dbias) {
  checks::bias_backward(dy, dbias);
  const index_t cols = dy.cols();
  T* __restrict sums = dbias.data();
  backend::host::vectorised<T>([=]() CUPIPE_VECTOR_BODY {
    for (index_t r = 0; r < dy.rows(); ++r) {
      const T* __restrict row = dy.data() + r * cols;
      for (index_t c = 0; c < cols; ++c) sums[c] += row[c];
    }
  });
}

namespace detail {
/// out[i] = f(a[i], ...) for every i < n: an elementwise op's loop, in vector code for float. `f` is
/// a lambda marked CUPIPE_VECTOR_BODY, so that it inlines into each clone; out may alias an input
/// (element i reads only elements i).
template <class T, class F, class... In>
void elementwise(index_t n, T* out, F f, const In*... in) {
  backend::host::vectorised<T>([=]() CUPIPE_VECTOR_BODY {
    for (index_t i = 0; i < n; ++i) out[i] = f(in[i]...);
  });
}
}  // namespace detail

template <class T>
void relu_forward(backend::Host<T>&, ConstView<T> x, TensorView<T> y) {
  checks::relu_forward(x, y);
  // NaN propagates, as in torch.relu: mapping it to 0 would hide a diverged model from the loss check.
  // !(v <= 0) holds for v > 0 and for NaN (an unordered compare is false): one compare, so the
  // loop vectorises.
  detail::elementwise(x.numel(), y.data(), [](T v) CUPIPE_VECTOR_BODY { return !(v <= T(0)) ? v : T(0); }, x.data());
}

/// dx = dy where x > 0, else 0 (x is the forward input).
template <class T>
void relu_backward(backend::Host<T>&, ConstView<T> x, ConstView<T> dy, TensorView<T> dx) {
  checks::relu_backward(x, dy, dx);
  // dy is loaded unconditionally (an argument), so the loop vectorises into a blend.
  detail::elementwise(x.numel(), dx.data(), [](T v, T g) CUPIPE_VECTOR_BODY { return v > T(0) ? g : T(0); }, x.data(),
                      dy.data());
}

/// GELU, tanh form: y = 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))). For float, tanh is
/// backend::host's (vector_math.hpp), so the loop is vector code (libm's tanhf was a call per element). In place is fine.
template <class T>
void gelu_forward(backend::Host<T>&, ConstView<T> x, TensorView<T> y) {
  checks::gelu_forward(x, y);
  detail::elementwise(x.numel(), y.data(), [](T v) CUPIPE_VECTOR_BODY {
    const T inner = T(gelu_k) * (v + T(gelu_c) * v * v * v);
    return T(0.5) * v * (T(1) + backend::host::tanh_of(inner));
  }, x.data());
}

template <class T>
void gelu_backward(backend::Host<T>&, ConstView<T> x, ConstView<T> dy, TensorView<T> dx) {
  checks::gelu_backward(x, dy, dx);
  detail::elementwise(x.numel(), dx.data(), [](T v, T g) CUPIPE_VECTOR_BODY {
    const T inner = T(gelu_k) * (v + T(gelu_c) * v * v * v);
    const T t = backend::host::tanh_of(inner);
    const T dinner = T(gelu_k) * (T(1) + T(3 * gelu_c) * v * v);
    return g * (T(0.5) * (T(1) + t) + T(0.5) * v * (T(1) - t * t) * dinner);
  }, x.data(), dy.data());
}

/// y = a + b (the residual connection); y may alias a or b.
template <class T>
void residual_add(backend::Host<T>&, ConstView<T> a, ConstView<T> b, TensorView<T> y) {
  checks::residual_add(a, b, y);
  backend::host::vectorised<T>([=]() CUPIPE_VECTOR_BODY {
    for (index_t i = 0; i < a.numel(); ++i) y[i] = a[i] + b[i];
  });
}

/// y += alpha * x.
template <class T>
void axpy(backend::Host<T>&, Scalar<T> alpha, ConstView<T> x, TensorView<T> y) {
  checks::axpy(x, y);
  backend::host::vectorised<T>([=]() CUPIPE_VECTOR_BODY {
    for (index_t i = 0; i < x.numel(); ++i) y[i] += alpha * x[i];
  });
}

template <class T>
void copy(backend::Host<T>&, ConstView<T> from, TensorView<T> to) {
  checks::copy(from, to);
  std::copy_n(from.data(), from.numel(), to.data());
}

template <class T>
void fill(backend::Host<T>&, TensorView<T> y, Scalar<T> value) {
  checks::fill(y);
  std::fill_n(y.data(), y.numel(), value);
}

// LayerNorm over the last axis: y = (x - mean) * rstd * gamma + beta, rstd = 1 / sqrt(var + eps),
// with the biased variance (as PyTorch). mean and rstd (rows) are saved for backward.

template <class T>
void layernorm_forward(backend::Host<T>&, ConstView<T> x, ConstView<T> gamma, ConstView<T> beta, TensorView<T> y,
                       TensorView<T> mean, TensorView<T> rstd, double eps) {
  const index_t rows = x.rows(), n = x.cols();
  checks::layernorm_forward(x, gamma, beta, y, mean, rstd);
  backend::host::vectorised<T>([=]() CUPIPE_VECTOR_BODY {
    for (index_t r = 0; r < rows; ++r) {
      const T* xr = x.data() + r * n;
      T sum = 0;
      for (index_t c = 0; c < n; ++c) sum += xr[c];
      const T mu = sum / T(n);
      T var = 0;
      for (index_t c = 0; c < n; ++c) var += (xr[c] - mu) * (xr[c] - mu);
      const T rs = T(1) / std::sqrt(var / T(n) + T(eps));
      mean[r] = mu;
      rstd[r] = rs;
      for (index_t c = 0; c < n; ++c) y.at(r, c) = (xr[c] - mu) * rs * gamma[c] + beta[c];
    }
  });
}

/// dx = rstd * (g - mean(g) - xhat * mean(g * xhat)), g = dy * gamma, xhat = (x - mean) * rstd.
template <class T>
void layernorm_backward_input(backend::Host<T>&, ConstView<T> x, ConstView<T> gamma, ConstView<T> mean,
                              ConstView<T> rstd, ConstView<T> dy, TensorView<T> dx) {
  const index_t rows = x.rows(), n = x.cols();
  checks::layernorm_backward_input(x, gamma, mean, rstd, dy, dx);
  backend::host::vectorised<T>([=]() CUPIPE_VECTOR_BODY {
    for (index_t r = 0; r < rows; ++r) {
      T mean_g = 0, mean_gx = 0;
      for (index_t c = 0; c < n; ++c) {
        const T g = dy.at(r, c) * gamma[c];
        const T xhat = (x.at(r, c) - mean[r]) * rstd[r];
        mean_g += g;
        mean_gx += g * xhat;
      }
      mean_g /= T(n);
      mean_gx /= T(n);
      const T mu = mean[r], rs = rstd[r];  // locals: dx's stores cannot change them
      for (index_t c = 0; c < n; ++c) {
        const T g = dy.at(r, c) * gamma[c];
        const T xhat = (x.at(r, c) - mu) * rs;
        dx.at(r, c) = rs * (g - mean_g - xhat * mean_gx);
      }
    }
  });
}

/// dgamma += sum over rows of dy * xhat; dbeta += sum over rows of dy.
template <class T>
void layernorm_backward_weight(backend::Host<T>&, ConstView<T> x, ConstView<T> mean, ConstView<T> rstd,
                               ConstView<T> dy, TensorView<T> dgamma, TensorView<T> dbeta) {
  const index_t rows = x.rows(), n = x.cols();
  checks::layernorm_backward_weight(x, mean, rstd, dy, dgamma, dbeta);
  backend::host::vectorised<T>([=]() CUPIPE_VECTOR_BODY {
    for (index_t r = 0; r < rows; ++r) {
      const T mu = mean[r], rs = rstd[r];
      for (index_t c = 0; c < n; ++c) {
        dgamma[c] += dy.at(r, c) * (x.at(r, c) - mu) * rs;
        dbeta[c] += dy.at(r, c);
      }
    }
  });
}

// Fused softmax cross-entropy. loss (1,) = sum over rows of (logsumexp(z_r) - z_r[label_r]) / normalizer.
// The caller passes the normalizer (the whole batch's sample count), so that microbatches of a
// split batch, ragged ones included, sum to the mean over the batch.

namespace detail {
/// A row's max and its sum of exp(z - max).
template <class T>
std::pair<T, T> row_max_sum(const T* z, index_t n) {
  T max = z[0];
  for (index_t c = 1; c < n; ++c) max = std::max(max, z[c]);
  T sum = 0;
  for (index_t c = 0; c < n; ++c) sum += std::exp(z[c] - max);
  return {max, sum};
}
template <class T>
T row_logsumexp(const T* z, index_t n) {
  const auto [max, sum] = row_max_sum(z, n);
  return max + std::log(sum);
}
/// Label ranges, which only the host can read before the kernel runs (the views are checked already).
template <class T>
void check_label_values(std::string_view op, ConstView<T> logits, ConstView<std::int32_t> labels) {
  for (index_t r = 0; r < logits.rows(); ++r)
    if (labels[r] < 0 || labels[r] >= logits.cols()) checks::label_out_of_range(op, labels[r], r, logits.shape());
}
}  // namespace detail

template <class T>
void softmax_cross_entropy_forward(backend::Host<T>&, ConstView<T> logits, ConstView<std::int32_t> labels,
                                   TensorView<T> loss, index_t normalizer) {
  checks::softmax_cross_entropy_forward(logits, labels, loss, normalizer);
  detail::check_label_values<T>("softmax_cross_entropy_forward", logits, labels);
  T total = 0;
  for (index_t r = 0; r < logits.rows(); ++r) {
    const T* z = logits.data() + r * logits.cols();
    total += detail::row_logsumexp(z, logits.cols()) - z[labels[r]];
  }
  loss[0] = total / T(normalizer);
}

/// dlogits = (softmax(z) - onehot(label)) * dloss / normalizer.
template <class T>
void softmax_cross_entropy_backward(backend::Host<T>&, ConstView<T> logits, ConstView<std::int32_t> labels,
                                    TensorView<T> dlogits, index_t normalizer, Scalar<T> dloss = T(1)) {
  checks::softmax_cross_entropy_backward(logits, labels, dlogits, normalizer);
  detail::check_label_values<T>("softmax_cross_entropy_backward", logits, labels);
  const T scale = dloss / T(normalizer);
  for (index_t r = 0; r < logits.rows(); ++r) {
    const T* z = logits.data() + r * logits.cols();
    const T lse = detail::row_logsumexp(z, logits.cols());
    for (index_t c = 0; c < logits.cols(); ++c)
      dlogits.at(r, c) = (std::exp(z[c] - lse) - (c == labels[r] ? T(1) : T(0))) * scale;
  }
}

// Vocabulary-parallel cross-entropy (layers/tensor_parallel.hpp): each rank's logits are columns
// [first, first + count) of the whole vocabulary's. The ranks exchange per-row statistics and each
// computes the whole row's log-sum-exp from them; the logits are never gathered.

/// stats (rows, 3): each row's max m over the part, sum of exp(z - m) over the part, and the label's
/// logit where the label falls in the part (0 where it falls in another).
template <class T>
void softmax_cross_entropy_part_stats(backend::Host<T>&, ConstView<T> logits, ConstView<std::int32_t> labels,
                                      TensorView<T> stats, VocabPart part) {
  checks::softmax_cross_entropy_part_stats(logits, labels, stats, part);
  for (index_t r = 0; r < logits.rows(); ++r) {
    if (labels[r] < 0 || labels[r] >= part.whole)
      checks::label_out_of_range("softmax_cross_entropy_part_stats", labels[r], r, logits.shape(), part.whole);
    const T* z = logits.data() + r * logits.cols();
    const auto [max, sum] = detail::row_max_sum(z, logits.cols());
    const index_t local = labels[r] - part.first;
    stats.at(r, 0) = max;
    stats.at(r, 1) = sum;
    stats.at(r, 2) = local >= 0 && local < logits.cols() ? z[local] : T(0);
  }
}

/// dlogits = (exp(z - lse) - onehot(label)) * dloss / normalizer, with each row's whole-vocabulary
/// log-sum-exp `lse` (rows,) given.
template <class T>
void softmax_cross_entropy_part_backward(backend::Host<T>&, ConstView<T> logits, ConstView<std::int32_t> labels,
                                         ConstView<T> lse, TensorView<T> dlogits, index_t normalizer, VocabPart part,
                                         Scalar<T> dloss = T(1)) {
  checks::softmax_cross_entropy_part_backward(logits, labels, lse, dlogits, normalizer, part);
  const T scale = dloss / T(normalizer);
  for (index_t r = 0; r < logits.rows(); ++r) {
    if (labels[r] < 0 || labels[r] >= part.whole)
      checks::label_out_of_range("softmax_cross_entropy_part_backward", labels[r], r, logits.shape(), part.whole);
    const T* z = logits.data() + r * logits.cols();
    const index_t local = labels[r] - part.first;
    for (index_t c = 0; c < logits.cols(); ++c)
      dlogits.at(r, c) = (std::exp(z[c] - lse[r]) - (c == local ? T(1) : T(0))) * scale;
  }
}

// Embedding: y (rows, dim) = table[ids] with table (vocab, dim). Backward accumulates rows of dy into
// dtable in row order, so it is deterministic. With a VocabPart the table holds rows [first, first +
// rows) of a whole vocabulary: ids outside the part give zero rows and add no gradient.

namespace detail {
/// Token id ranges, read on the host (the views are checked already).
inline void check_id_values(std::string_view op, ConstView<std::int32_t> ids, index_t vocab) {
  for (index_t r = 0; r < ids.numel(); ++r)
    if (ids[r] < 0 || ids[r] >= vocab) checks::token_id_out_of_range(op, ids[r], r, vocab);
}
}  // namespace detail

template <class T>
void embedding_forward(backend::Host<T>&, ConstView<std::int32_t> ids, ConstView<T> table, TensorView<T> y, VocabPart part) {
  checks::embedding_forward(ids, table, y, part);
  detail::check_id_values("embedding_forward", ids, part.whole);
  for (index_t r = 0; r < ids.numel(); ++r) {
    const index_t local = ids[r] - part.first;
    if (local >= 0 && local < table.rows())
      std::copy_n(table.data() + local * table.cols(), table.cols(), y.data() + r * table.cols());
    else
      std::fill_n(y.data() + r * table.cols(), table.cols(), T(0));
  }
}

template <class T>
void embedding_forward(backend::Host<T>& be, ConstView<std::int32_t> ids, ConstView<T> table, TensorView<T> y) {
  embedding_forward(be, ids, table, y, VocabPart{0, table.rows()});
}

template <class T>
void embedding_backward(backend::Host<T>&, ConstView<std::int32_t> ids, ConstView<T> dy, TensorView<T> dtable, VocabPart part) {
  checks::embedding_backward(ids, dy, dtable, part);
  detail::check_id_values("embedding_backward", ids, part.whole);
  for (index_t r = 0; r < ids.numel(); ++r) {
    const index_t local = ids[r] - part.first;
    if (local < 0 || local >= dtable.rows()) continue;
    for (index_t c = 0; c < dtable.cols(); ++c) dtable.at(local, c) += dy.at(r, c);
  }
}

template <class T>
void embedding_backward(backend::Host<T>& be, ConstView<std::int32_t> ids, ConstView<T> dy, TensorView<T> dtable) {
  embedding_backward(be, ids, dy, dtable, VocabPart{0, dtable.rows()});
}

// Causal multi-head self-attention (layout in op_checks.hpp): for query t of a sequence and head h,
// out_t = sum_{u <= t} softmax_u(q_t . k_u / sqrt(head_dim)) v_u. The log-sum-exp of each query row is
// kept, as the flash kernels keep it, and the backward recomputes the probabilities from it.
//
// The products run in BLAS, a block of attention_query_block queries of one head at a time against
// the keys up to the block's last query: scores S = scale Q K^T, then P V; in the backward also
// dO V^T, dS K and dS^T Q. So the scratch is two blocks of scores, never a (T, T) matrix, and the
// keys after a block are never touched. Written as dot products per (query, key) pair instead, these
// loops were 30% of a gpt::tiny step on the CPU (perf, 2-core VM), one multiply-add at a time.
// Within a block's diagonal the probabilities of later keys are set to exactly 0, so a finite value
// there changes nothing. A NaN or infinity does reach the block's earlier rows through those zeros
// (0 times NaN): in the forward a later key's v; in the backward a later key's k or query's q or dout.

/// Queries per block of the host attention.
inline constexpr index_t attention_query_block = 64;

namespace detail {

/// One head's view of a sequence in qkv (W columns a row): q, k and v start h * D into each third.
template <class T>
struct HeadRows {
  const T* q;
  const T* k;
  const T* v;
};

template <class T>
HeadRows<T> head_rows(const T* qkv, index_t first_row, index_t W, index_t C, index_t h, index_t D) {
  const T* row = qkv + first_row * W + h * D;
  return {row, row + C, row + 2 * C};
}

}  // namespace detail

/// With document borders (packed sequences), each document on its own: a causal sequence of its length.
template <class T>
void causal_attention_forward(backend::Host<T>& be, ConstView<T> qkv, TensorView<T> out, TensorView<T> lse,
                              index_t heads, index_t seq_len, const DocumentStarts& documents = {}) {
  checks::causal_attention_forward(qkv, out, lse, heads, seq_len, documents);
  if (!documents.empty())
    return each_document_in(documents, qkv.rows(), seq_len, "causal_attention_forward", [&](index_t first, index_t length) {
      causal_attention_forward(be, qkv.row_slice(first, length), out.row_slice(first, length), lse.row_slice(first, length),
                               heads, length);
    });
  const index_t C = qkv.cols() / 3, D = C / heads, W = qkv.cols();
  const T scale = T(1) / std::sqrt(T(D));
  const index_t block = std::min(attention_query_block, seq_len);
  std::vector<T> scores(static_cast<std::size_t>(block * seq_len));  // then the probabilities
  std::vector<T> exps(static_cast<std::size_t>(seq_len));
  T* e = exps.data();
  for (index_t s0 = 0; s0 < qkv.rows(); s0 += seq_len)
    for (index_t h = 0; h < heads; ++h) {
      const detail::HeadRows<T> head = detail::head_rows(qkv.data(), s0, W, C, h, D);
      for (index_t t0 = 0; t0 < seq_len; t0 += block) {
        const index_t rows = std::min(block, seq_len - t0), keys = t0 + rows;
        T* S = scores.data();  // (rows, keys), rows `keys` apart
        // (rows, D) x (keys, D)^T -> (rows, keys)
        detail::gemm_rows(Transpose::no, Transpose::yes, rows, keys, D, scale, head.q + t0 * W, W, head.k, W, T(0), S, keys);
        backend::host::vectorised<T>([=]() CUPIPE_VECTOR_BODY {
          for (index_t i = 0; i < rows; ++i) {
            T* s = S + i * keys;
            const index_t t = t0 + i;
            T max = -std::numeric_limits<T>::infinity();
            for (index_t u = 0; u <= t; ++u) max = std::max(max, s[u]);
            // The exponentials in a loop of their own, which vectorises; the sum in order after it.
            for (index_t u = 0; u <= t; ++u) e[u] = backend::host::exp_of(s[u] - max);
            T sum = 0;
            for (index_t u = 0; u <= t; ++u) sum += e[u];
            const T l = max + std::log(sum);
            lse.at(s0 + t, h) = l;
            // exp(s - l), not e / sum: bitwise the probabilities the backward recomputes.
            for (index_t u = 0; u <= t; ++u) s[u] = backend::host::exp_of(s[u] - l);
            std::fill(s + t + 1, s + keys, T(0));
          }
        });
        // (rows, keys) x (keys, D) -> (rows, D)
        detail::gemm_rows(Transpose::no, Transpose::no, rows, D, keys, T(1), S, keys, head.v, W, T(0),
                          out.data() + (s0 + t0) * C + h * D, C);
      }
    }
}

/// dqkv (overwritten) from dout, with P recomputed from q, k and the saved log-sum-exp:
/// dv_u = sum_t P_tu dout_t;  dS_tu = P_tu (dout_t . v_u - dout_t . out_t);
/// dq_t = scale sum_u dS_tu k_u;  dk_u = scale sum_t dS_tu q_t.
template <class T>
void causal_attention_backward(backend::Host<T>& be, ConstView<T> qkv, ConstView<T> out, ConstView<T> lse, ConstView<T> dout,
                               TensorView<T> dqkv, index_t heads, index_t seq_len, const DocumentStarts& documents = {}) {
  checks::causal_attention_backward(qkv, out, lse, dout, dqkv, heads, seq_len, documents);
  if (!documents.empty())
    return each_document_in(documents, qkv.rows(), seq_len, "causal_attention_backward", [&](index_t first, index_t length) {
      causal_attention_backward(be, qkv.row_slice(first, length), out.row_slice(first, length), lse.row_slice(first, length),
                                dout.row_slice(first, length), dqkv.row_slice(first, length), heads, length);
    });
  const index_t C = qkv.cols() / 3, D = C / heads, W = qkv.cols();
  const T scale = T(1) / std::sqrt(T(D));
  const index_t block = std::min(attention_query_block, seq_len);
  std::vector<T> probabilities(static_cast<std::size_t>(block * seq_len));
  std::vector<T> score_grads(static_cast<std::size_t>(block * seq_len));
  std::fill_n(dqkv.data(), dqkv.numel(), T(0));  // dk and dv add up over the query blocks
  for (index_t s0 = 0; s0 < qkv.rows(); s0 += seq_len)
    for (index_t h = 0; h < heads; ++h) {
      const detail::HeadRows<T> head = detail::head_rows(qkv.data(), s0, W, C, h, D);
      T* dq = dqkv.data() + s0 * W + h * D;
      T* dk = dq + C;
      T* dv = dq + 2 * C;
      const T* go = dout.data() + s0 * C + h * D;
      const T* o = out.data() + s0 * C + h * D;
      for (index_t t0 = 0; t0 < seq_len; t0 += block) {
        const index_t rows = std::min(block, seq_len - t0), keys = t0 + rows;
        T* P = probabilities.data();  // (rows, keys)
        T* dS = score_grads.data();   // (rows, keys): dout . v first, then the scores' gradient
        detail::gemm_rows(Transpose::no, Transpose::yes, rows, keys, D, scale, head.q + t0 * W, W, head.k, W, T(0), P, keys);
        // (rows, D) x (keys, D)^T -> (rows, keys)
        detail::gemm_rows(Transpose::no, Transpose::yes, rows, keys, D, T(1), go + t0 * C, C, head.v, W, T(0), dS, keys);
        backend::host::vectorised<T>([=]() CUPIPE_VECTOR_BODY {
          for (index_t i = 0; i < rows; ++i) {
            const index_t t = t0 + i;
            T* p = P + i * keys;
            T* ds = dS + i * keys;
            const T* go_t = go + t * C;
            const T* o_t = o + t * C;
            T delta = 0;
            for (index_t d = 0; d < D; ++d) delta += go_t[d] * o_t[d];
            const T l = lse.at(s0 + t, h);
            for (index_t u = 0; u <= t; ++u) {
              p[u] = backend::host::exp_of(p[u] - l);
              ds[u] = p[u] * (ds[u] - delta) * scale;
            }
            std::fill(p + t + 1, p + keys, T(0));
            std::fill(ds + t + 1, ds + keys, T(0));
          }
        });
        // dv (keys, D) += P^T (keys, rows) x dout (rows, D)
        detail::gemm_rows(Transpose::yes, Transpose::no, keys, D, rows, T(1), P, keys, go + t0 * C, C, T(1), dv, W);
        // dq (rows, D) = dS (rows, keys) x k (keys, D)
        detail::gemm_rows(Transpose::no, Transpose::no, rows, D, keys, T(1), dS, keys, head.k, W, T(0), dq + t0 * W, W);
        // dk (keys, D) += dS^T (keys, rows) x q (rows, D)
        detail::gemm_rows(Transpose::yes, Transpose::no, keys, D, rows, T(1), dS, keys, head.q + t0 * W, W, T(1), dk, W);
      }
    }
}

// Optimizer updates and reductions.

/// Sum of squares of all elements, accumulated in double: four interleaved partial sums (element i
/// goes to sum i % 4), so the additions do not wait on one another, added at the end.
template <class T>
double sum_of_squares(backend::Host<T>&, ConstView<T> x) {
  checks::sum_of_squares(x);
  const T* __restrict in = x.data();
  const index_t n = x.numel(), body = n - n % 4;
  double s0 = 0, s1 = 0, s2 = 0, s3 = 0;
  for (index_t i = 0; i < body; i += 4) {
    s0 += double(in[i]) * double(in[i]);
    s1 += double(in[i + 1]) * double(in[i + 1]);
    s2 += double(in[i + 2]) * double(in[i + 2]);
    s3 += double(in[i + 3]) * double(in[i + 3]);
  }
  for (index_t i = body; i < n; ++i) s0 += double(in[i]) * double(in[i]);
  return (s0 + s1) + (s2 + s3);
}

template <class T>
void sgd_update(backend::Host<T>&, TensorView<T> param, ConstView<T> grad, TensorView<T> velocity,
                const SgdHyper& h, Scalar<T> grad_scale) {
  checks::sgd_update(param, grad, velocity);
  backend::host::vectorised<T>([=]() CUPIPE_VECTOR_BODY {
    for (index_t i = 0; i < param.numel(); ++i) {
      const T g = grad[i] * grad_scale + T(h.weight_decay) * param[i];
      velocity[i] = T(h.momentum) * velocity[i] + g;
      param[i] -= T(h.lr) * (h.nesterov ? g + T(h.momentum) * velocity[i] : velocity[i]);
    }
  });
}

/// `step` counts from 1 (the first update uses step 1 for the bias corrections). One pass over the
/// four arrays, written so that it vectorises (no aliasing; sqrt vectorises where the build has
/// -fno-math-errno, which cupipe::host sets). (Split over two threads it measured no faster on 2
/// cores: the pass is memory-bound.)
template <class T>
void adamw_update(backend::Host<T>&, TensorView<T> param, ConstView<T> grad, TensorView<T> m, TensorView<T> v,
                  const AdamWHyper& h, std::int64_t step, Scalar<T> grad_scale) {
  checks::adamw_update(param, grad, m, v, step);
  const T bias1 = T(1) - T(std::pow(h.beta1, double(step)));
  const T bias2 = T(1) - T(std::pow(h.beta2, double(step)));
  const T decay = T(1) - T(h.lr * h.weight_decay);
  const T beta1 = T(h.beta1), beta2 = T(h.beta2), one_minus_beta1 = T(1 - h.beta1), one_minus_beta2 = T(1 - h.beta2);
  const T lr = T(h.lr), eps = T(h.eps), scale = grad_scale;
  T* __restrict p = param.data();
  const T* __restrict g = grad.data();
  T* __restrict m1 = m.data();
  T* __restrict m2 = v.data();
  const index_t n = param.numel();
  backend::host::vectorised<T>([=]() CUPIPE_VECTOR_BODY {
    for (index_t i = 0; i < n; ++i) {
      const T gi = g[i] * scale;
      const T mi = beta1 * m1[i] + one_minus_beta1 * gi;
      const T vi = beta2 * m2[i] + one_minus_beta2 * gi * gi;
      m1[i] = mi;
      m2[i] = vi;
      p[i] = p[i] * decay - lr * (mi / bias1) / (std::sqrt(vi / bias2) + eps);
    }
  });
}

}  // namespace cupipe::ops

// A mixture of experts' token movement (moe_permute, moe_unpermute and their backwards).
#include "cupipe/backend/host/ops_moe.hpp"  // IWYU pragma: export

// bf16 storage with float compute (backend::Host<bfloat16, float>).
#include "cupipe/backend/host/ops_bf16.hpp"
