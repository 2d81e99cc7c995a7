// SPDX-License-Identifier: Apache-2.0
// Ring attention across processes, on the host: what the host op ring_attention_forward/backward
// (backend/host/ops_ring.hpp) runs for CausalSelfAttention when its backend context has a
// context-parallel ring (Host::context_group); the CUDA op (backend/cuda/ops_ring.cuh) does the same
// on the device. Each rank holds its two chunks of
// every sequence (cp/context_group.hpp); the keys and values travel round the ring, packed (2C a
// row), and each rank runs cp/ring_attention.hpp's blocks against what it holds, so its result is
// the rows of ring_forward and ring_backward, the oracle, that it owns.
//
// Forward: cp - 1 passes of the keys and values, each started before the blocks of the pair in
// hand and finished after them, so the hand-over runs while the rank computes (the overlap).
// Backward: the keys and values go round again the same way; their gradients travel with them,
// each rank adding its blocks' share, and one last pass brings every rank's home. A gradient pass
// waits for the blocks that add to it, so it does not overlap; a device ring that keeps a second
// pass in flight can hide it too.
#pragma once

#include <algorithm>
#include <array>
#include <limits>
#include <vector>

#include "cupipe/core/error.hpp"
#include "cupipe/core/shape.hpp"
#include "cupipe/cp/context_group.hpp"
#include "cupipe/cp/ring_attention.hpp"

namespace cupipe::cp {

namespace detail {
/// The keys and values of `rows` qkv rows (3C wide), packed 2C a row.
template <class T>
std::vector<T> packed_keys_values(const T* qkv, index_t rows, index_t C) {
  std::vector<T> kv(std::size_t(rows * 2 * C));
  for (index_t i = 0; i < rows; ++i) std::copy(qkv + i * 3 * C + C, qkv + i * 3 * C + 3 * C, kv.begin() + i * 2 * C);
  return kv;
}

/// f(query row, query position, key row, key position) for every block this rank runs against the
/// chunks of ring rank `source`, chunks of `c` rows, in `rows` local rows; blocks wholly after
/// their queries skipped.
template <class F>
void each_local_block(int rank, int source, int cp, index_t c, index_t rows, F&& f) {
  const std::array<int, 2> mine = chunks_of(rank, cp), theirs = chunks_of(source, cp);
  for (index_t s = 0; s < rows; s += 2 * c)
    for (int qi = 0; qi < 2; ++qi)
      for (int ki = 0; ki < 2; ++ki) {
        const index_t q = mine[std::size_t(qi)], k = theirs[std::size_t(ki)];
        if (k <= q) f(s + qi * c, q * c, s + ki * c, k * c);
      }
}

inline void check_rows(const ContextGroup& ring, index_t rows, index_t seq_len, const char* who) {
  check_ring_rows(rows, seq_len, ring.size(), who);
  CUPIPE_REQUIRE(!ring.device_memory(), who, ": this ring passes device memory (NCCL's); the host's ring attention ",
                 "runs on host memory (a device backend's op, backend/cuda/ops_ring.cuh, runs on a device ring)");
}
}  // namespace detail

/// Causal attention over the ring: `qkv` (`rows` local rows, 3C wide, sequences of `seq_len` tokens
/// split as chunks_of(ring.rank())) -> `out` (rows, C) and the merged log-sum-exp `lse` (rows,
/// heads), which the backward reads.
template <class T>
void ring_attention_forward(ContextGroup& ring, const T* qkv, index_t rows, index_t seq_len, index_t C, index_t heads,
                            T* out, T* lse) {
  detail::check_rows(ring, rows, seq_len, "ring attention");
  const int cp = ring.size(), rank = ring.rank();
  const index_t c = chunk_rows(seq_len, cp), W = 3 * C;
  std::vector<T> kv = detail::packed_keys_values(qkv, rows, C), next(kv.size());
  std::fill(out, out + rows * C, T(0));
  std::fill(lse, lse + rows * heads, -std::numeric_limits<T>::infinity());
  std::vector<T> block_out(std::size_t(c * C)), block_lse(std::size_t(c * heads));
  for (int step = 0; step < cp; ++step) {
    const bool more = step + 1 < cp;
    if (more) ring.start_pass(kv.data(), next.data(), kv.size() * sizeof(T), nullptr);
    detail::each_local_block(rank, ring_source(rank, step, cp), cp, c, rows, [&](index_t qr, index_t qp, index_t kr, index_t kp) {
      block_forward(qkv + qr * W, qp, c, kv.data() + kr * 2 * C, 2 * C, kp, c, C, heads, block_out.data(), block_lse.data());
      merge_block(out + qr * C, lse + qr * heads, block_out.data(), block_lse.data(), c, C, heads);
    });
    if (more) {
      ring.finish_pass();
      kv.swap(next);
    }
  }
}

/// The backward of ring_attention_forward: `dqkv` (rows, 3C) overwritten with the gradient of this
/// rank's q, k and v from `dout` (rows, C), given its forward's `out` and `lse`.
template <class T>
void ring_attention_backward(ContextGroup& ring, const T* qkv, index_t rows, index_t seq_len, index_t C, index_t heads,
                             const T* out, const T* lse, const T* dout, T* dqkv) {
  detail::check_rows(ring, rows, seq_len, "ring attention (backward)");
  const int cp = ring.size(), rank = ring.rank();
  const index_t c = chunk_rows(seq_len, cp), W = 3 * C;
  std::vector<T> kv = detail::packed_keys_values(qkv, rows, C), next(kv.size());
  std::vector<T> dkv(kv.size(), T(0)), next_dkv(kv.size());
  std::fill(dqkv, dqkv + rows * W, T(0));
  for (int step = 0; step < cp; ++step) {
    const bool more = step + 1 < cp;
    if (more) ring.start_pass(kv.data(), next.data(), kv.size() * sizeof(T), nullptr);
    detail::each_local_block(rank, ring_source(rank, step, cp), cp, c, rows, [&](index_t qr, index_t qp, index_t kr, index_t kp) {
      block_backward(qkv + qr * W, qp, c, kv.data() + kr * 2 * C, 2 * C, kp, c, C, heads, out + qr * C, lse + qr * heads,
                     dout + qr * C, dqkv + qr * W, dkv.data() + kr * 2 * C);
    });
    if (more) {
      ring.finish_pass();
      kv.swap(next);
    }
    // The gradient of the keys and values in hand goes on with them; after the last step, home.
    ring.start_pass(dkv.data(), next_dkv.data(), dkv.size() * sizeof(T), nullptr);
    ring.finish_pass();
    dkv.swap(next_dkv);
  }
  for (index_t i = 0; i < rows; ++i) std::copy(dkv.begin() + i * 2 * C, dkv.begin() + (i + 1) * 2 * C, dqkv + i * W + C);
}

}  // namespace cupipe::cp
