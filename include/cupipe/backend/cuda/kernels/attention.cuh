// SPDX-License-Identifier: Apache-2.0
// Causal multi-head self-attention, flash-style: each query's scores are computed over tiles of 32
// keys with an online softmax (running max and sum), so no (T, T) matrix ever exists in global
// memory; forward saves the log-sum-exp per query and head, backward recomputes the probabilities
// from it (FlashAttention-2's scheme). Layout as the host op (backend/op_checks.hpp): qkv (n, 3C) with
// each row [q | k | v], heads of D = C / H columns, n / T whole sequences.
//
// One warp per query (forward, dq) or per key (dk, dv); its row and the gradient row it needs sit in
// shared memory, each lane takes one key (or query) of the current tile of 32 for the dot products,
// and the warp accumulates the D outputs with lane l holding columns l, l + 32, ... (D <= 32 * J).
// K and V tiles are read through L1/L2, not staged in shared memory across warps: the simple form,
// kept for correctness first (issue #11 records what a tuned kernel would add).
//
// Every hand-written attention kernel (these, attention_tiled.cuh, attention_mma.cuh) takes its
// sequences as a Sequences: whole sequences of one length, or packed documents given by
// FlashAttention's cu_seqlens, so that a packed batch runs in one launch (gridDim.z = documents,
// gridDim.x over the longest; a block past its document's end returns at once).
#pragma once

#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

#include "cupipe/backend/cuda/check.cuh"
#include "cupipe/backend/cuda/context.cuh"
#include "cupipe/backend/cuda/kernels/common.cuh"
#include "cupipe/core/error.hpp"

namespace cupipe::backend::cuda::kernels {

inline constexpr int attention_warps = 4;  // warps (queries or keys) per block
inline constexpr int attention_max_head_dim = 256;

/// The sequences of one attention call, as the kernels see them: `count` sequences of `longest` rows
/// each, one after another (`cu` null), or packed documents (`cu`: FlashAttention's cu_seqlens in
/// device memory, count + 1 entries; sequence z is rows [cu[z], cu[z + 1]) and `longest` the longest).
struct Sequences {
  const std::int32_t* cu = nullptr;
  index_t longest = 0;
  index_t count = 0;

  /// `rows` rows of whole sequences of `Tn`.
  static Sequences uniform(index_t rows, index_t Tn) { return {nullptr, Tn, Tn > 0 ? rows / Tn : 0}; }
  __device__ __forceinline__ index_t start(index_t z) const { return cu ? index_t(cu[z]) : z * longest; }
  __device__ __forceinline__ index_t length(index_t z) const { return cu ? index_t(cu[z + 1] - cu[z]) : longest; }
};

template <class T>
__device__ __forceinline__ T warp_max(T v) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) {
    const T other = __shfl_xor_sync(0xffffffffu, v, offset);
    v = v > other ? v : other;
  }
  return v;
}

/// Where head h of row r's q, k or v (part 0, 1, 2) starts.
template <class T>
__device__ __forceinline__ const T* qkv_at(const T* qkv, index_t row, int part, int h, index_t C, index_t D) {
  return qkv + row * 3 * C + part * C + h * D;
}

/// Copies D values of `from` into the warp's shared row.
template <class T, class A>
__device__ __forceinline__ void load_row(A* to, const T* from, index_t D, int lane) {
  for (index_t d = lane; d < D; d += 32) to[d] = to_acc(from[d]);
  __syncwarp();
}

template <class A, class T>
__device__ __forceinline__ A dot_row(const A* shared_row, const T* row, index_t D) {
  A s = 0;
  for (index_t d = 0; d < D; ++d) s += shared_row[d] * to_acc(row[d]);
  return s;
}

// grid (ceil(longest / warps), H, sequences); out (n, C), lse (n, H)
template <int J, class T>
__global__ void __launch_bounds__(32 * attention_warps)
    causal_attention_forward_kernel(const T* qkv, T* out, acc_t<T>* lse, index_t C, int H, Sequences seqs, acc_t<T> scale) {
  using A = acc_t<T>;
  __shared__ A q_rows[attention_warps][32 * J];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, h = blockIdx.y;
  const index_t t = index_t(blockIdx.x) * attention_warps + warp, D = C / H;
  const index_t s0 = seqs.start(blockIdx.z), Tn = seqs.length(blockIdx.z);
  if (t >= Tn) return;
  A* q = q_rows[warp];
  load_row(q, qkv_at(qkv, s0 + t, 0, h, C, D), D, lane);
  A m = -INFINITY, l = 0, o[J];
#pragma unroll
  for (int j = 0; j < J; ++j) o[j] = 0;
  for (index_t u0 = 0; u0 <= t; u0 += 32) {
    const index_t u = u0 + lane;
    const A s = u <= t ? dot_row(q, qkv_at(qkv, s0 + u, 1, h, C, D), D) * scale : A(-INFINITY);
    const A tile_max = warp_max(s);
    const A m_new = m > tile_max ? m : tile_max;  // finite: key u0 <= t is always in the tile
    const A p = u <= t ? dev_exp(s - m_new) : A(0);
    const A correction = dev_exp(m - m_new);
    l = l * correction + warp_sum(p);
#pragma unroll
    for (int j = 0; j < J; ++j) o[j] *= correction;
    const index_t last = t - u0 < 31 ? t - u0 : 31;
    for (index_t k = 0; k <= last; ++k) {
      const A pk = __shfl_sync(0xffffffffu, p, int(k));
      const T* v = qkv_at(qkv, s0 + u0 + k, 2, h, C, D);
#pragma unroll
      for (int j = 0; j < J; ++j)
        if (lane + 32 * j < D) o[j] += pk * to_acc(v[lane + 32 * j]);
    }
    m = m_new;
  }
  T* o_row = out + (s0 + t) * C + h * D;
#pragma unroll
  for (int j = 0; j < J; ++j)
    if (lane + 32 * j < D) o_row[lane + 32 * j] = from_acc<T>(o[j] / l);
  if (lane == 0) lse[(s0 + t) * H + h] = m + dev_log(l);
}

// delta (n, H) = sum over the head's columns of dout * out; one warp per (row, head)
template <class T>
__global__ void __launch_bounds__(32 * attention_warps)
    attention_delta_kernel(const T* out, const T* dout, acc_t<T>* delta, index_t rows, index_t C, int H) {
  using A = acc_t<T>;
  const index_t item = index_t(blockIdx.x) * attention_warps + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (item >= rows * H) return;
  const index_t row = item / H, D = C / H;
  const int h = int(item % H);
  A s = 0;
  for (index_t d = lane; d < D; d += 32) s += to_acc(out[row * C + h * D + d]) * to_acc(dout[row * C + h * D + d]);
  s = warp_sum(s);
  if (lane == 0) delta[item] = s;
}

// dq: one warp per query t, over its keys u <= t. grid as forward.
template <int J, class T>
__global__ void __launch_bounds__(32 * attention_warps)
    attention_dq_kernel(const T* qkv, const acc_t<T>* lse, const T* dout, const acc_t<T>* delta, T* dqkv, index_t C, int H,
                        Sequences seqs, acc_t<T> scale) {
  using A = acc_t<T>;
  __shared__ A rows_q[attention_warps][32 * J], rows_g[attention_warps][32 * J];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, h = blockIdx.y;
  const index_t t = index_t(blockIdx.x) * attention_warps + warp, D = C / H;
  const index_t s0 = seqs.start(blockIdx.z), Tn = seqs.length(blockIdx.z);
  if (t >= Tn) return;
  const index_t rt = s0 + t;
  A *q = rows_q[warp], *g = rows_g[warp];
  load_row(q, qkv_at(qkv, rt, 0, h, C, D), D, lane);
  load_row(g, dout + rt * C + h * D, D, lane);
  const A l = lse[rt * H + h], dl = delta[rt * H + h];
  A dq[J];
#pragma unroll
  for (int j = 0; j < J; ++j) dq[j] = 0;
  for (index_t u0 = 0; u0 <= t; u0 += 32) {
    const index_t u = u0 + lane;
    A ds = 0;
    if (u <= t) {
      const A p = dev_exp(dot_row(q, qkv_at(qkv, s0 + u, 1, h, C, D), D) * scale - l);
      ds = p * (dot_row(g, qkv_at(qkv, s0 + u, 2, h, C, D), D) - dl) * scale;
    }
    const index_t last = t - u0 < 31 ? t - u0 : 31;
    for (index_t k = 0; k <= last; ++k) {
      const A dsk = __shfl_sync(0xffffffffu, ds, int(k));
      const T* key = qkv_at(qkv, s0 + u0 + k, 1, h, C, D);
#pragma unroll
      for (int j = 0; j < J; ++j)
        if (lane + 32 * j < D) dq[j] += dsk * to_acc(key[lane + 32 * j]);
    }
  }
  T* row = dqkv + rt * 3 * C + h * D;
#pragma unroll
  for (int j = 0; j < J; ++j)
    if (lane + 32 * j < D) row[lane + 32 * j] = from_acc<T>(dq[j]);
}

// dk, dv: one warp per key u, over the queries t >= u. grid as forward (x over keys).
template <int J, class T>
__global__ void __launch_bounds__(32 * attention_warps)
    attention_dkv_kernel(const T* qkv, const acc_t<T>* lse, const T* dout, const acc_t<T>* delta, T* dqkv, index_t C, int H,
                         Sequences seqs, acc_t<T> scale) {
  using A = acc_t<T>;
  __shared__ A rows_k[attention_warps][32 * J], rows_v[attention_warps][32 * J];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, h = blockIdx.y;
  const index_t u = index_t(blockIdx.x) * attention_warps + warp, D = C / H;
  const index_t s0 = seqs.start(blockIdx.z), Tn = seqs.length(blockIdx.z);
  if (u >= Tn) return;
  A *k = rows_k[warp], *v = rows_v[warp];
  load_row(k, qkv_at(qkv, s0 + u, 1, h, C, D), D, lane);
  load_row(v, qkv_at(qkv, s0 + u, 2, h, C, D), D, lane);
  A dk[J], dv[J];
#pragma unroll
  for (int j = 0; j < J; ++j) dk[j] = dv[j] = 0;
  for (index_t t0 = u; t0 < Tn; t0 += 32) {
    const index_t t = t0 + lane;
    A p = 0, ds = 0;
    if (t < Tn) {
      const index_t rt = s0 + t;
      p = dev_exp(dot_row(k, qkv_at(qkv, rt, 0, h, C, D), D) * scale - lse[rt * H + h]);
      ds = p * (dot_row(v, dout + rt * C + h * D, D) - delta[rt * H + h]) * scale;
    }
    const index_t last = Tn - 1 - t0 < 31 ? Tn - 1 - t0 : 31;
    for (index_t i = 0; i <= last; ++i) {
      const A pi = __shfl_sync(0xffffffffu, p, int(i)), dsi = __shfl_sync(0xffffffffu, ds, int(i));
      const index_t rt = s0 + t0 + i;
      const T* g = dout + rt * C + h * D;
      const T* q = qkv_at(qkv, rt, 0, h, C, D);
#pragma unroll
      for (int j = 0; j < J; ++j)
        if (lane + 32 * j < D) {
          dv[j] += pi * to_acc(g[lane + 32 * j]);
          dk[j] += dsi * to_acc(q[lane + 32 * j]);
        }
    }
  }
  T* row = dqkv + (s0 + u) * 3 * C + h * D;
#pragma unroll
  for (int j = 0; j < J; ++j)
    if (lane + 32 * j < D) {
      row[C + lane + 32 * j] = from_acc<T>(dk[j]);
      row[2 * C + lane + 32 * j] = from_acc<T>(dv[j]);
    }
}

/// Calls f.template operator()<J>() with J = ceil(D / 32) rounded up to 1, 2, 4 or 8.
template <class F>
void with_head_columns(index_t D, F&& f) {
  if (D > attention_max_head_dim)
    CUPIPE_THROW("causal attention (CUDA): head dimension ", D, " is above the kernels' limit of ", attention_max_head_dim);
  if (D <= 32) f.template operator()<1>();
  else if (D <= 64) f.template operator()<2>();
  else if (D <= 128) f.template operator()<4>();
  else f.template operator()<8>();
}

/// The grid of the simple kernels: a block of attention_warps queries (or keys), heads, sequences.
inline dim3 simple_attention_grid(Sequences seqs, int H) {
  return dim3(unsigned((seqs.longest + attention_warps - 1) / attention_warps), unsigned(H), unsigned(seqs.count));
}

template <class T>
void causal_attention_forward(Context& ctx, const T* qkv, T* out, acc_t<T>* lse, index_t rows, index_t C, int H, Sequences seqs) {
  if (rows == 0) return;
  const dim3 grid = simple_attention_grid(seqs, H);
  const acc_t<T> scale = acc_t<T>(1) / std::sqrt(acc_t<T>(C / H));  // as the host op
  with_head_columns(C / H, [&]<int J>() {
    causal_attention_forward_kernel<J><<<grid, 32 * attention_warps, 0, ctx.stream()>>>(qkv, out, lse, C, H, seqs, scale);
    CUPIPE_CHECK_LAUNCH();
  });
}

/// dqkv (overwritten) from dout; `delta` is a workspace of rows * H accumulation values.
template <class T>
void causal_attention_backward(Context& ctx, const T* qkv, const T* out, const acc_t<T>* lse, const T* dout, T* dqkv,
                               acc_t<T>* delta, index_t rows, index_t C, int H, Sequences seqs) {
  if (rows == 0) return;
  const unsigned delta_blocks = unsigned((rows * H + attention_warps - 1) / attention_warps);
  attention_delta_kernel<<<delta_blocks, 32 * attention_warps, 0, ctx.stream()>>>(out, dout, delta, rows, C, H);
  CUPIPE_CHECK_LAUNCH();
  const dim3 grid = simple_attention_grid(seqs, H);
  const acc_t<T> scale = acc_t<T>(1) / std::sqrt(acc_t<T>(C / H));
  with_head_columns(C / H, [&]<int J>() {
    attention_dq_kernel<J><<<grid, 32 * attention_warps, 0, ctx.stream()>>>(qkv, lse, dout, delta, dqkv, C, H, seqs, scale);
    CUPIPE_CHECK_LAUNCH();
    attention_dkv_kernel<J><<<grid, 32 * attention_warps, 0, ctx.stream()>>>(qkv, lse, dout, delta, dqkv, C, H, seqs, scale);
    CUPIPE_CHECK_LAUNCH();
  });
}

// The op's log-sum-exp layout (n, H) = (S, T, H) against cuDNN's statistics (S, H, T): one pass each
// way, S * T * H floats (393 KB at GPT-2 small's batch 8: well under a microsecond of copying).
template <bool to_head_major>
__global__ void lse_layout_kernel(const float* from, float* to, index_t sequences, index_t Tn, int H) {
  const index_t total = sequences * Tn * H;
  for (index_t i = index_t(blockIdx.x) * blockDim.x + threadIdx.x; i < total; i += index_t(gridDim.x) * blockDim.x) {
    // i walks the destination, so the stores coalesce.
    if constexpr (to_head_major) {  // i = (s H + h) T + t
      const index_t t = i % Tn, h = i / Tn % H, s = i / (Tn * H);
      to[i] = from[(s * Tn + t) * H + h];
    } else {  // i = (s T + t) H + h
      const index_t h = i % H, t = i / H % Tn, s = i / (H * Tn);
      to[i] = from[(s * H + h) * Tn + t];
    }
  }
}

/// (S, T, H) -> (S, H, T) when to_head_major, else back.
template <bool to_head_major>
void lse_layout(Context& ctx, const float* from, float* to, index_t rows, index_t Tn, int H) {
  if (rows == 0) return;
  lse_layout_kernel<to_head_major><<<grid_for(rows * H, 256, ctx), 256, 0, ctx.stream()>>>(from, to, rows / Tn, Tn, H);
  CUPIPE_CHECK_LAUNCH();
}

}  // namespace cupipe::backend::cuda::kernels
