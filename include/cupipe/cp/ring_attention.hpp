// SPDX-License-Identifier: Apache-2.0
// Context parallelism's attention on the host: the algebra a ring of ranks runs, and the oracle a
// distributed or GPU ring is checked against. A sequence of T tokens is cut into 2 cp chunks; under
// the zigzag split rank r holds chunks r and 2 cp - 1 - r (Megatron's CP, llama3), so that every
// rank has the same share of the causal work (causal_pairs measures it). Each rank's queries meet
// every rank's keys and values as they come round the ring, one block of attention per pair of
// chunks (block_forward), and the blocks' outputs merge by their log-sum-exp (merge_block):
//   lse = log sum_b exp(lse_b),  o = sum_b exp(lse_b - lse) o_b.
// The backward (block_backward) recomputes each block's probabilities from the merged log-sum-exp,
// as the flash kernels do, adds the queries' gradient in place and the keys' and values' gradient
// into a buffer that goes back to their owner. ring_forward and ring_backward run a whole ring in
// one process, rank after rank, exactly the blocks each rank would run.
//
// Layout, as the attention op's (backend/op_checks.hpp): qkv rows (3C wide) hold q, k and v, head h
// at columns h D .. h D + D - 1 of each third; outputs (C wide); log-sum-exps (heads wide).
#pragma once

#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <limits>
#include <vector>

#include "cupipe/backend/host/ops.hpp"
#include "cupipe/core/error.hpp"
#include "cupipe/core/shape.hpp"
#include "cupipe/cp/zigzag.hpp"

namespace cupipe::cp {

/// The (query, key) pairs rank `rank`'s causal attention covers in a sequence of `seq_len`: what its
/// blocks compute. Under the zigzag split every rank covers the same number.
inline double causal_pairs(int rank, int cp, index_t seq_len, Split split = Split::zigzag) {
  const double c = double(chunk_rows(seq_len, cp));
  double pairs = 0;
  for (const int q : chunks_of(rank, cp, split)) pairs += double(q) * c * c + c * (c + 1) / 2;  // earlier chunks, then its own
  return pairs;
}

/// One block of causal attention: the `nq` queries of `q_rows` (sequence positions q_first ...)
/// against the `nk` keys and values of `kv_rows` (positions k_first ...), a key seen only from its
/// position on. `kv_rows` points at a row's keys (C wide, its values right after them), rows
/// `kv_width` apart: within qkv rows (3C) or a ring's packed keys and values (2C). Writes each query's output over this block's keys, normalised within the block,
/// into `out` (nq rows, C wide) and its log-sum-exp into `lse` (nq rows, heads wide); a query that
/// sees none of them gets 0 and -infinity.
template <class T>
void block_forward(const T* q_rows, index_t q_first, index_t nq, const T* kv_rows, index_t kv_width, index_t k_first,
                   index_t nk, index_t C, index_t heads, T* out, T* lse) {
  const index_t D = C / heads, W = 3 * C;
  const T scale = T(1) / std::sqrt(T(D));
  std::vector<T> scores(std::size_t(nq * nk));
  for (index_t h = 0; h < heads; ++h) {
    T* S = scores.data();
    ops::detail::gemm_rows(ops::Transpose::no, ops::Transpose::yes, nq, nk, D, scale, q_rows + h * D, W, kv_rows + h * D,
                           kv_width, T(0), S, nk);
    for (index_t i = 0; i < nq; ++i) {
      T* s = S + i * nk;
      const index_t seen = std::clamp<index_t>(q_first + i - k_first + 1, 0, nk);  // keys [0, seen) are visible
      if (seen == 0) {
        lse[i * heads + h] = -std::numeric_limits<T>::infinity();
        std::fill(s, s + nk, T(0));
        continue;
      }
      const T max = *std::max_element(s, s + seen);
      T sum = 0;
      for (index_t u = 0; u < seen; ++u) sum += std::exp(s[u] - max);
      const T l = max + std::log(sum);
      lse[i * heads + h] = l;
      for (index_t u = 0; u < seen; ++u) s[u] = std::exp(s[u] - l);
      std::fill(s + seen, s + nk, T(0));
    }
    ops::detail::gemm_rows(ops::Transpose::no, ops::Transpose::no, nq, D, nk, T(1), S, nk, kv_rows + C + h * D, kv_width,
                           T(0), out + h * D, C);
  }
}

/// Merges a block's output and log-sum-exp (`out_b`, `lse_b`, from block_forward) into the running
/// ones (`out`, `lse`), for `n` rows: each row and head becomes the softmax over both blocks' keys.
template <class T>
void merge_block(T* out, T* lse, const T* out_b, const T* lse_b, index_t n, index_t C, index_t heads) {
  const index_t D = C / heads;
  for (index_t i = 0; i < n; ++i)
    for (index_t h = 0; h < heads; ++h) {
      const T a = lse[i * heads + h], b = lse_b[i * heads + h];
      if (b == -std::numeric_limits<T>::infinity()) continue;
      T* o = out + i * C + h * D;
      const T* ob = out_b + i * C + h * D;
      if (a == -std::numeric_limits<T>::infinity()) {
        std::copy(ob, ob + D, o);
        lse[i * heads + h] = b;
        continue;
      }
      const T m = std::max(a, b), l = m + std::log(std::exp(a - m) + std::exp(b - m));
      const T wa = std::exp(a - l), wb = std::exp(b - l);
      for (index_t d = 0; d < D; ++d) o[d] = wa * o[d] + wb * ob[d];
      lse[i * heads + h] = l;
    }
}

/// The backward of one block, from the merged output `o` (nq rows, C wide) and log-sum-exp `lse` of
/// the queries and their output gradient `dout`: P = exp(scale q k^T - lse) on the visible pairs,
/// dS = P (dout v^T - rowsum(dout o)); adds scale dS k to the q columns of `dq_rows` (nq rows, 3C
/// wide), and scale dS^T q and P^T dout to the keys' and values' gradient at `dkv_rows` (laid out as
/// `kv_rows`: keys, values right after, rows `kv_width` apart).
template <class T>
void block_backward(const T* q_rows, index_t q_first, index_t nq, const T* kv_rows, index_t kv_width, index_t k_first,
                    index_t nk, index_t C, index_t heads, const T* o, const T* lse, const T* dout, T* dq_rows, T* dkv_rows) {
  const index_t D = C / heads, W = 3 * C;
  const T scale = T(1) / std::sqrt(T(D));
  std::vector<T> probabilities(std::size_t(nq * nk)), score_grads(std::size_t(nq * nk));
  for (index_t h = 0; h < heads; ++h) {
    T* P = probabilities.data();
    T* dS = score_grads.data();
    ops::detail::gemm_rows(ops::Transpose::no, ops::Transpose::yes, nq, nk, D, scale, q_rows + h * D, W, kv_rows + h * D,
                           kv_width, T(0), P, nk);
    ops::detail::gemm_rows(ops::Transpose::no, ops::Transpose::yes, nq, nk, D, T(1), dout + h * D, C, kv_rows + C + h * D,
                           kv_width, T(0), dS, nk);
    for (index_t i = 0; i < nq; ++i) {
      const index_t seen = std::clamp<index_t>(q_first + i - k_first + 1, 0, nk);
      T delta = 0;
      for (index_t d = 0; d < D; ++d) delta += dout[i * C + h * D + d] * o[i * C + h * D + d];
      const T l = lse[i * heads + h];
      T* p = P + i * nk;
      T* ds = dS + i * nk;
      for (index_t u = 0; u < seen; ++u) {
        p[u] = std::exp(p[u] - l);
        ds[u] = p[u] * (ds[u] - delta) * scale;
      }
      std::fill(p + seen, p + nk, T(0));
      std::fill(ds + seen, ds + nk, T(0));
    }
    // dv (nk, D) += P^T dout;  dq (nq, D) += dS k;  dk (nk, D) += dS^T q
    ops::detail::gemm_rows(ops::Transpose::yes, ops::Transpose::no, nk, D, nq, T(1), P, nk, dout + h * D, C, T(1),
                           dkv_rows + C + h * D, kv_width);
    ops::detail::gemm_rows(ops::Transpose::no, ops::Transpose::no, nq, D, nk, T(1), dS, nk, kv_rows + h * D, kv_width, T(1),
                           dq_rows + h * D, W);
    ops::detail::gemm_rows(ops::Transpose::yes, ops::Transpose::no, nk, D, nq, T(1), dS, nk, q_rows + h * D, W, T(1),
                           dkv_rows + h * D, kv_width);
  }
}

/// What each rank of a ring did (ring_forward, ring_backward): its (query, key) pairs and the
/// measured seconds of its blocks, per rank.
struct RingWork {
  std::vector<double> pairs, seconds;
};

namespace detail {
/// Every block a ring of `cp` ranks runs, in each rank's order: rank r, at each ring step, its two
/// query chunks against the two chunks of the rank whose keys and values it holds then, the blocks
/// wholly after their queries skipped; f(first query row, first key row) for each, chunks of `c`
/// rows. `work`, when given: each rank's (query, key) pairs and seconds.
template <class F>
void each_ring_block(int cp, Split split, index_t c, RingWork* work, F&& f) {
  if (work) *work = {std::vector<double>(std::size_t(cp), 0.0), std::vector<double>(std::size_t(cp), 0.0)};
  for (int r = 0; r < cp; ++r) {
    const auto start = std::chrono::steady_clock::now();
    for (int step = 0; step < cp; ++step)
      for (const int q : chunks_of(r, cp, split))
        for (const int k : chunks_of(ring_source(r, step, cp), cp, split)) {
          if (k > q) continue;  // every key after every query
          f(q * c, k * c);
          if (work) work->pairs[std::size_t(r)] += k < q ? double(c * c) : double(c * (c + 1) / 2);
        }
    if (work) work->seconds[std::size_t(r)] = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  }
}
}  // namespace detail

/// Causal attention over one sequence of `seq_len` rows of `qkv`, computed as `cp` ranks compute it
/// in a ring: each rank's two chunks of queries against every chunk of keys and values in ring
/// order, blocks merged. Writes `out` (seq_len rows, C wide) and `lse` (seq_len rows, heads wide) in
/// sequence order; `work`, when given, what each rank computed and how long it took.
template <class T>
void ring_forward(const T* qkv, index_t seq_len, index_t C, index_t heads, int cp, Split split, T* out, T* lse,
                  RingWork* work = nullptr) {
  const index_t c = chunk_rows(seq_len, cp), W = 3 * C;
  std::fill(out, out + seq_len * C, T(0));
  std::fill(lse, lse + seq_len * heads, -std::numeric_limits<T>::infinity());
  std::vector<T> block_out(std::size_t(c * C)), block_lse(std::size_t(c * heads));
  detail::each_ring_block(cp, split, c, work, [&](index_t q0, index_t k0) {
    block_forward(qkv + q0 * W, q0, c, qkv + k0 * W + C, W, k0, c, C, heads, block_out.data(), block_lse.data());
    merge_block(out + q0 * C, lse + q0 * heads, block_out.data(), block_lse.data(), c, C, heads);
  });
}

/// The backward of ring_forward: `dqkv` (seq_len rows, 3C wide) overwritten with the gradient of q, k
/// and v from `dout`, each rank running its blocks against the keys and values in ring order and
/// the keys' and values' gradients summed at their owner.
template <class T>
void ring_backward(const T* qkv, index_t seq_len, index_t C, index_t heads, int cp, Split split, const T* out, const T* lse,
                   const T* dout, T* dqkv, RingWork* work = nullptr) {
  const index_t c = chunk_rows(seq_len, cp), W = 3 * C;
  std::fill(dqkv, dqkv + seq_len * W, T(0));
  detail::each_ring_block(cp, split, c, work, [&](index_t q0, index_t k0) {
    block_backward(qkv + q0 * W, q0, c, qkv + k0 * W + C, W, k0, c, C, heads, out + q0 * C, lse + q0 * heads, dout + q0 * C,
                   dqkv + q0 * W, dqkv + k0 * W + C);
  });
}

}  // namespace cupipe::cp
