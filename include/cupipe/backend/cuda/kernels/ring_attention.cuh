// SPDX-License-Identifier: Apache-2.0
// Context parallelism's attention on the device: the kernels of one ring step (ops::ring_attention_*
// on backend::Cuda, backend/cuda/ops_ring.cuh, which passes the keys and values round the ring). The
// algebra and the order are the host's (cp/ring_attention.hpp, cp/ring_layer.hpp, the oracle); the
// form is the simple kernels' of attention.cuh: one warp per query (forward, dq) or per key (dk, dv),
// its own row in shared memory, a lane per key (or query) of each group of 32 for the dot products,
// lane l accumulating columns l, l + 32, ... of the head (J of them).
//
// Layout. This rank's `rows` local rows are sequences' shares of 2c rows (cp/context_group.hpp): the
// queries of chunk `mine[0]` then `mine[1]` of each sequence. The keys and values in hand are the
// source rank's, packed 2C a row (keys, then values) in the same row order, its chunks `theirs[0]`,
// `theirs[1]`. A query at position P sees a key at position Q when Q <= P.
//
// Forward, per step: each warp runs an online softmax over the visible keys in hand (both of the
// source's chunks) and merges the result into the running output and log-sum-exp in place:
//   lse = log(exp(lse_old) + exp(lse_step)),  out = exp(lse_old - lse) out_old + exp(lse_step - lse) o_step.
// A query that sees no key in hand keeps its running values (on the first step, 0 and -infinity).
// Backward, per step: dq adds over the keys in hand (written on the first step); dk and dv add into
// the travelling gradient of the keys and values in hand, which goes home round the ring.
//
// Cost, the simple form: every warp reads its visible keys' rows from L2/global memory, once per query
// (per step, head and sequence: 2c queries x on average c visible keys x 2 D values x 4 bytes). At
// T = 1024, cp = 2 (c = 256), 12 heads of 64 and 8 sequences, a forward step reads about
// 8 x 12 x 512 x 256 x 512 B = 6.4 GB and does 2 x 2 x 64 x 8 x 12 x 512 x 256 = 3.2 GFLOP: about
// 1.3 ms at the H200's 4.8 TB/s (1,000 TFLOP/s would take 3 us), L2 hits making it less. Bandwidth-bound, as the simple kernels of attention.cuh; the tiled form
// (attention_tiled.cuh, a K/V tile in shared memory per 64 queries) would read 64 times less. Not yet
// run on a GPU (docs/gpu_notes.md): a first run checks this estimate.
#pragma once

#include <cuda_runtime.h>

#include <array>
#include <cmath>

#include "cupipe/backend/cuda/check.cuh"
#include "cupipe/backend/cuda/context.cuh"
#include "cupipe/backend/cuda/kernels/attention.cuh"
#include "cupipe/backend/cuda/kernels/common.cuh"
#include "cupipe/core/shape.hpp"

namespace cupipe::backend::cuda::kernels::ring_attention {

/// One step's shape: chunks of `c` rows, this rank's chunks and the source's (positions / c).
struct Step {
  index_t c = 0;
  int mine0 = 0, mine1 = 0, theirs0 = 0, theirs1 = 0;
  __host__ __device__ int mine(int i) const { return i == 0 ? mine0 : mine1; }
  __host__ __device__ int theirs(int i) const { return i == 0 ? theirs0 : theirs1; }
};

/// The grid of one step: a block of attention_warps queries (or keys) of a chunk, heads, and
/// 2 chunks per sequence.
inline dim3 step_grid(index_t c, int H, index_t sequences) {
  return dim3(unsigned((c + attention_warps - 1) / attention_warps), unsigned(H), unsigned(2 * sequences));
}

/// A warp's place in a step's grid: its row `item` (a query, or a key) in chunk `half` (of this rank,
/// or of the source) of the sequence whose local rows start at `base`, and its head `h`.
struct WarpSlot {
  int warp, lane, h, half;
  index_t item, D, c, base;
};
__device__ __forceinline__ WarpSlot warp_slot(index_t C, int H, index_t c) {
  const int warp = int(threadIdx.x / 32);
  return {warp, int(threadIdx.x % 32), int(blockIdx.y), int(blockIdx.z % 2), index_t(blockIdx.x) * attention_warps + warp,
          C / H, c, index_t(blockIdx.z / 2) * 2 * c};
}

/// Keys visible to position `p` in the source's chunk `k` (c rows): 0 .. c.
__device__ __forceinline__ index_t visible_keys(index_t p, int k, index_t c) {
  const index_t first = index_t(k) * c;
  if (p < first) return 0;
  return p - first + 1 < c ? p - first + 1 : c;
}

// kv (rows, 2C) = the keys and values of qkv (rows, 3C); grid-stride over rows * 2C.
template <class T>
__global__ void pack_kernel(const T* qkv, T* kv, index_t rows, index_t C) {
  const index_t total = rows * 2 * C;
  for (index_t i = index_t(blockIdx.x) * blockDim.x + threadIdx.x; i < total; i += index_t(gridDim.x) * blockDim.x)
    kv[i] = qkv[(i / (2 * C)) * 3 * C + C + i % (2 * C)];
}

// dqkv's key and value columns (rows, 3C) = dkv (rows, 2C).
template <class T>
__global__ void unpack_kernel(const T* dkv, T* dqkv, index_t rows, index_t C) {
  const index_t total = rows * 2 * C;
  for (index_t i = index_t(blockIdx.x) * blockDim.x + threadIdx.x; i < total; i += index_t(gridDim.x) * blockDim.x)
    dqkv[(i / (2 * C)) * 3 * C + C + i % (2 * C)] = dkv[i];
}

// One forward step; grid step_grid, z = 2 sequence + this rank's chunk.
template <int J, class T>
__global__ void __launch_bounds__(32 * attention_warps)
    forward_step_kernel(const T* qkv, const T* kv, T* out, T* lse, index_t C, int H, Step st, bool first, T scale) {
  __shared__ T q_rows[attention_warps][32 * J];
  const auto [warp, lane, h, qi, t, D, c, base] = warp_slot(C, H, st.c);
  if (t >= c) return;
  const index_t rq = base + qi * c + t, p = index_t(st.mine(qi)) * c + t;
  T* q = q_rows[warp];
  load_row(q, qkv + rq * 3 * C + h * D, D, lane);
  T m = -INFINITY, l = 0, o[J];
#pragma unroll
  for (int j = 0; j < J; ++j) o[j] = 0;
  for (int ki = 0; ki < 2; ++ki) {
    const index_t seen = visible_keys(p, st.theirs(ki), c), k0 = base + ki * c;
    for (index_t u0 = 0; u0 < seen; u0 += 32) {
      const index_t u = u0 + lane;
      const T s = u < seen ? dot_row(q, kv + (k0 + u) * 2 * C + h * D, D) * scale : T(-INFINITY);
      const T tile_max = warp_max(s);
      const T m_new = m > tile_max ? m : tile_max;  // finite: key u0 < seen is in the tile
      const T pu = u < seen ? dev_exp(s - m_new) : T(0);
      const T correction = dev_exp(m - m_new);
      l = l * correction + warp_sum(pu);
#pragma unroll
      for (int j = 0; j < J; ++j) o[j] *= correction;
      const index_t last = seen - 1 - u0 < 31 ? seen - 1 - u0 : 31;
      for (index_t k = 0; k <= last; ++k) {
        const T pk = __shfl_sync(0xffffffffu, pu, int(k));
        const T* v = kv + (k0 + u0 + k) * 2 * C + C + h * D;
#pragma unroll
        for (int j = 0; j < J; ++j)
          if (lane + 32 * j < D) o[j] += pk * v[lane + 32 * j];
      }
      m = m_new;
    }
  }
  T* o_row = out + rq * C + h * D;
  T* l_at = lse + rq * H + h;
  const T old = first ? T(-INFINITY) : *l_at;
  if (l == 0) {  // no key in hand is visible: keep the running values
    if (first) {
#pragma unroll
      for (int j = 0; j < J; ++j)
        if (lane + 32 * j < D) o_row[lane + 32 * j] = 0;
      if (lane == 0) *l_at = T(-INFINITY);
    }
    return;
  }
  const T step_lse = m + dev_log(l);
  const T top = old > step_lse ? old : step_lse;
  const T a = old == T(-INFINITY) ? T(0) : dev_exp(old - top), b = dev_exp(step_lse - top);
#pragma unroll
  for (int j = 0; j < J; ++j)
    if (lane + 32 * j < D) {
      const T previous = a == T(0) ? T(0) : a * o_row[lane + 32 * j];
      o_row[lane + 32 * j] = (previous + b * o[j] / l) / (a + b);
    }
  __syncwarp();
  if (lane == 0) *l_at = top + dev_log(a + b);
}

// dq over the keys in hand; grid as the forward's. Written on the first step, added after.
template <int J, class T>
__global__ void __launch_bounds__(32 * attention_warps)
    dq_step_kernel(const T* qkv, const T* kv, const T* lse, const T* dout, const T* delta, T* dqkv, index_t C, int H, Step st,
                   bool first, T scale) {
  __shared__ T rows_q[attention_warps][32 * J], rows_g[attention_warps][32 * J];
  const auto [warp, lane, h, qi, t, D, c, base] = warp_slot(C, H, st.c);
  if (t >= c) return;
  const index_t rq = base + qi * c + t, p = index_t(st.mine(qi)) * c + t;
  T *q = rows_q[warp], *g = rows_g[warp];
  load_row(q, qkv + rq * 3 * C + h * D, D, lane);
  load_row(g, dout + rq * C + h * D, D, lane);
  const T l = lse[rq * H + h], dl = delta[rq * H + h];
  T dq[J];
#pragma unroll
  for (int j = 0; j < J; ++j) dq[j] = 0;
  for (int ki = 0; ki < 2; ++ki) {
    const index_t seen = visible_keys(p, st.theirs(ki), c), k0 = base + ki * c;
    for (index_t u0 = 0; u0 < seen; u0 += 32) {
      const index_t u = u0 + lane;
      T ds = 0;
      if (u < seen) {
        const T* row = kv + (k0 + u) * 2 * C + h * D;
        const T pu = dev_exp(dot_row(q, row, D) * scale - l);
        ds = pu * (dot_row(g, row + C, D) - dl) * scale;
      }
      const index_t last = seen - 1 - u0 < 31 ? seen - 1 - u0 : 31;
      for (index_t k = 0; k <= last; ++k) {
        const T dsk = __shfl_sync(0xffffffffu, ds, int(k));
        const T* key = kv + (k0 + u0 + k) * 2 * C + h * D;
#pragma unroll
        for (int j = 0; j < J; ++j)
          if (lane + 32 * j < D) dq[j] += dsk * key[lane + 32 * j];
      }
    }
  }
  T* row = dqkv + rq * 3 * C + h * D;
#pragma unroll
  for (int j = 0; j < J; ++j)
    if (lane + 32 * j < D) row[lane + 32 * j] = first ? dq[j] : row[lane + 32 * j] + dq[j];
}

// dk, dv of the keys in hand, added into their travelling gradient dkv (rows, 2C); grid step_grid,
// z = 2 sequence + the source's chunk, x over its keys; each over this rank's queries that see it.
template <int J, class T>
__global__ void __launch_bounds__(32 * attention_warps)
    dkv_step_kernel(const T* qkv, const T* kv, const T* lse, const T* dout, const T* delta, T* dkv, index_t C, int H, Step st,
                    T scale) {
  __shared__ T rows_k[attention_warps][32 * J], rows_v[attention_warps][32 * J];
  const auto [warp, lane, h, ki, u, D, c, base] = warp_slot(C, H, st.c);
  if (u >= c) return;
  const index_t rk = base + ki * c + u, position = index_t(st.theirs(ki)) * c + u;
  T *k = rows_k[warp], *v = rows_v[warp];
  load_row(k, kv + rk * 2 * C + h * D, D, lane);
  load_row(v, kv + rk * 2 * C + C + h * D, D, lane);
  T dk[J], dv[J];
#pragma unroll
  for (int j = 0; j < J; ++j) dk[j] = dv[j] = 0;
  for (int qi = 0; qi < 2; ++qi) {
    // This chunk's queries at or after the key: t in [from, c).
    const index_t chunk_first = index_t(st.mine(qi)) * c;
    const index_t from = position <= chunk_first ? 0 : position - chunk_first;
    const index_t q0 = base + qi * c;
    for (index_t t0 = from; t0 < c; t0 += 32) {
      const index_t t = t0 + lane;
      T pt = 0, ds = 0;
      if (t < c) {
        const index_t rq = q0 + t;
        pt = dev_exp(dot_row(k, qkv + rq * 3 * C + h * D, D) * scale - lse[rq * H + h]);
        ds = pt * (dot_row(v, dout + rq * C + h * D, D) - delta[rq * H + h]) * scale;
      }
      const index_t last = c - 1 - t0 < 31 ? c - 1 - t0 : 31;
      for (index_t i = 0; i <= last; ++i) {
        const T pi = __shfl_sync(0xffffffffu, pt, int(i)), dsi = __shfl_sync(0xffffffffu, ds, int(i));
        const index_t rq = q0 + t0 + i;
        const T* g = dout + rq * C + h * D;
        const T* q = qkv + rq * 3 * C + h * D;
#pragma unroll
        for (int j = 0; j < J; ++j)
          if (lane + 32 * j < D) {
            dv[j] += pi * g[lane + 32 * j];
            dk[j] += dsi * q[lane + 32 * j];
          }
      }
    }
  }
  T* row = dkv + rk * 2 * C + h * D;
#pragma unroll
  for (int j = 0; j < J; ++j)
    if (lane + 32 * j < D) {
      row[lane + 32 * j] += dk[j];
      row[C + lane + 32 * j] += dv[j];
    }
}

/// The scale of every step, as the host op's: 1 / sqrt(D).
template <class T>
T scale_of(index_t C, int H) {
  return T(1) / std::sqrt(T(C / H));
}

template <class T>
void pack(Context& ctx, const T* qkv, T* kv, index_t rows, index_t C) {
  if (rows == 0) return;
  pack_kernel<<<grid_for(rows * 2 * C, 256, ctx), 256, 0, ctx.stream()>>>(qkv, kv, rows, C);
  CUPIPE_CHECK_LAUNCH();
}

template <class T>
void unpack(Context& ctx, const T* dkv, T* dqkv, index_t rows, index_t C) {
  if (rows == 0) return;
  unpack_kernel<<<grid_for(rows * 2 * C, 256, ctx), 256, 0, ctx.stream()>>>(dkv, dqkv, rows, C);
  CUPIPE_CHECK_LAUNCH();
}

/// One forward step over `rows` local rows against the keys and values in hand (`kv`).
template <class T>
void forward_step(Context& ctx, const T* qkv, const T* kv, T* out, T* lse, index_t rows, index_t C, int H, Step st, bool first) {
  if (rows == 0) return;
  const dim3 grid = step_grid(st.c, H, rows / (2 * st.c));
  with_head_columns(C / H, [&]<int J>() {
    forward_step_kernel<J><<<grid, 32 * attention_warps, 0, ctx.stream()>>>(qkv, kv, out, lse, C, H, st, first, scale_of<T>(C, H));
    CUPIPE_CHECK_LAUNCH();
  });
}

/// delta (rows, H) = rowsum(dout * out) per head, once per backward.
template <class T>
void delta(Context& ctx, const T* out, const T* dout, T* delta_out, index_t rows, index_t C, int H) {
  if (rows == 0) return;
  const unsigned blocks = unsigned((rows * H + attention_warps - 1) / attention_warps);
  attention_delta_kernel<<<blocks, 32 * attention_warps, 0, ctx.stream()>>>(out, dout, delta_out, rows, C, H);
  CUPIPE_CHECK_LAUNCH();
}

/// One backward step: dq (dqkv's query columns) and the keys' and values' gradient in hand (`dkv`).
template <class T>
void backward_step(Context& ctx, const T* qkv, const T* kv, const T* lse, const T* dout, const T* delta_in, T* dqkv, T* dkv,
                   index_t rows, index_t C, int H, Step st, bool first) {
  if (rows == 0) return;
  const dim3 grid = step_grid(st.c, H, rows / (2 * st.c));
  const T scale = scale_of<T>(C, H);
  with_head_columns(C / H, [&]<int J>() {
    dq_step_kernel<J><<<grid, 32 * attention_warps, 0, ctx.stream()>>>(qkv, kv, lse, dout, delta_in, dqkv, C, H, st, first, scale);
    CUPIPE_CHECK_LAUNCH();
    dkv_step_kernel<J><<<grid, 32 * attention_warps, 0, ctx.stream()>>>(qkv, kv, lse, dout, delta_in, dkv, C, H, st, scale);
    CUPIPE_CHECK_LAUNCH();
  });
}

}  // namespace cupipe::backend::cuda::kernels::ring_attention
