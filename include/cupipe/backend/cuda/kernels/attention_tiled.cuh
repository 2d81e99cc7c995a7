// SPDX-License-Identifier: Apache-2.0
// Causal self-attention in tiles (FlashAttention-2's blocking), head dimension up to 64, float or
// bf16 storage with float arithmetic (tiles, softmax statistics, lse and delta in float; each output
// rounded once on its store, as the host backend's bf16 op): the fast path that
// backend::Cuda::attention = backend::cuda::AttentionKernel::tiled selects.
//
// The simple kernels of attention.cuh give each query (or key) one warp and read every K and V row
// from global memory once per query: 25.8 GB per forward at GPT-2 small's shape, 13.9 ms on an H100
// (docs/gpu_notes.md). Here a block of 256 threads owns a tile of 64 queries (forward, dq) or 64
// keys (dk, dv) of one head. The block stages its own tile and, in turn, each 64-row tile of the
// other side in shared memory, so a K or V row is read from global memory once per query tile,
// which is 64 times less. Products of two tiles run from shared memory: thread (ty, tx) of the
// 16 x 16 grid owns rows ty + 16 i and columns tx + 16 j (i, j < 4). Rows are padded to 65 floats,
// so a walk down a column touches 32 different banks. The online softmax keeps a running max and
// sum per query row, reduced over the 16 threads of a half-warp.
//
// Backward: dk and dv in one kernel (a block per key tile, over the query tiles at or after it), and
// dq in another (a block per query tile, over the key tiles up to it). The second kernel recomputes
// the probabilities, but no atomics are needed and the result is deterministic, as with the
// simple kernels. delta (rowsum of dout * out) comes from attention.cuh's kernel.
//
// Status: compiled, and checked against the host op by tests/cuda/test_cuda_ops.cu for both kernel
// choices, which runs only where there is a GPU. It becomes the default once a GPU run has passed
// those tests and timed it (docs/gpu_notes.md).
#pragma once

#include <cuda_runtime.h>

#include <cmath>
#include <type_traits>

#include "cupipe/backend/cuda/check.cuh"
#include "cupipe/backend/cuda/context.cuh"
#include "cupipe/backend/cuda/kernels/attention.cuh"
#include "cupipe/core/error.hpp"

namespace cupipe::backend::cuda::kernels::attention_tiled {

inline constexpr int tile = 64;                  // queries or keys per tile
inline constexpr int max_head_dim = 64;          // columns a tile row holds
inline constexpr int stride = max_head_dim + 1;  // padded row: a column walk hits 32 banks
inline constexpr int threads = 256;              // 16 x 16
inline constexpr int tile_floats = tile * stride;

/// Stages `rows` rows (of `D` columns, `row_stride` apart) into a tile of floats (bf16 widened
/// exactly); the rest of the tile is zero, so padded rows and columns add nothing to a dot product.
template <class T>
__device__ __forceinline__ void load_tile(float* to, const T* from, index_t row_stride, index_t rows, index_t D) {
  for (int idx = int(threadIdx.x); idx < tile * max_head_dim; idx += threads) {
    const int r = idx / max_head_dim, d = idx % max_head_dim;
    to[r * stride + d] = r < rows && d < D ? to_acc(from[index_t(r) * row_stride + d]) : 0.0f;
  }
}

/// Over the 16 threads of a half-warp (one tile row's owners).
__device__ __forceinline__ float row_max(float v) {
#pragma unroll
  for (int offset = 8; offset > 0; offset >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, offset));
  return v;
}
__device__ __forceinline__ float row_sum(float v) {
#pragma unroll
  for (int offset = 8; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}

/// acc[i][j] += sum over d < D of a[row ty + 16 i][d] * b[row tx + 16 j][d]: the product of two
/// tiles, one row of each per thread pair (A B^T).
__device__ __forceinline__ void rows_times_rows(float (&acc)[4][4], const float* a, const float* b, index_t D, int ty, int tx) {
#pragma unroll 4
  for (int d = 0; d < int(D); ++d) {
    float x[4], y[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) x[i] = a[(ty + 16 * i) * stride + d];
#pragma unroll
    for (int j = 0; j < 4; ++j) y[j] = b[(tx + 16 * j) * stride + d];
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
      for (int j = 0; j < 4; ++j) acc[i][j] = fmaf(x[i], y[j], acc[i][j]);
  }
}

/// acc[i][j] += sum over k < tile of a[row ty + 16 i][k] * b[k][column tx + 16 j] (A B).
__device__ __forceinline__ void rows_times_tile(float (&acc)[4][4], const float* a, const float* b, int ty, int tx) {
#pragma unroll 4
  for (int k = 0; k < tile; ++k) {
    float x[4], y[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) x[i] = a[(ty + 16 * i) * stride + k];
#pragma unroll
    for (int j = 0; j < 4; ++j) y[j] = b[k * stride + tx + 16 * j];
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
      for (int j = 0; j < 4; ++j) acc[i][j] = fmaf(x[i], y[j], acc[i][j]);
  }
}

// grid (ceil(longest / tile), H, sequences), 256 threads, 3 tiles of dynamic shared memory: Q, K (then P), V.
// T: the storage type (float or __nv_bfloat16); arithmetic, tiles and lse in float.
template <class T>
__global__ void __launch_bounds__(threads)
    forward_kernel(const T* qkv, T* out, float* lse, index_t C, int H, Sequences seqs, float scale) {
  extern __shared__ float smem[];
  float* const qs = smem;
  float* const ks = qs + tile_floats;  // K, then P = softmax numerators of the tile
  float* const vs = ks + tile_floats;
  const int tx = int(threadIdx.x) % 16, ty = int(threadIdx.x) / 16, h = int(blockIdx.y);
  const index_t D = C / H, row3 = 3 * C, t0 = index_t(blockIdx.x) * tile;
  const index_t s0 = seqs.start(blockIdx.z), Tn = seqs.length(blockIdx.z);
  if (t0 >= Tn) return;  // past a shorter document's end (the whole block)
  const T* const head = qkv + s0 * row3 + index_t(h) * D;  // q of the sequence's first row
  load_tile(qs, head + t0 * row3, row3, Tn - t0 < tile ? Tn - t0 : tile, D);
  float m[4], l[4], o[4][4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    m[i] = -INFINITY, l[i] = 0;
#pragma unroll
    for (int j = 0; j < 4; ++j) o[i][j] = 0;
  }
  const index_t last_query = (Tn - t0 < tile ? Tn : t0 + tile) - 1;
  for (index_t k0 = 0; k0 <= last_query; k0 += tile) {
    const index_t keys = Tn - k0 < tile ? Tn - k0 : tile;
    __syncthreads();  // the last tile's P and V are read
    load_tile(ks, head + k0 * row3 + C, row3, keys, D);
    load_tile(vs, head + k0 * row3 + 2 * C, row3, keys, D);
    __syncthreads();
    float s[4][4] = {};
    rows_times_rows(s, qs, ks, D, ty, tx);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const index_t t = t0 + ty + 16 * i;
      float tile_max = -INFINITY;
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const index_t u = k0 + tx + 16 * j;
        s[i][j] = u <= t && u < Tn ? s[i][j] * scale : -INFINITY;
        tile_max = fmaxf(tile_max, s[i][j]);
      }
      // Finite: the first tile holds key 0 <= t, so m is finite from then on.
      const float m_new = fmaxf(m[i], row_max(tile_max));
      const float correction = dev_exp(m[i] - m_new);
      float sum = 0;
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        s[i][j] = dev_exp(s[i][j] - m_new);  // masked: exp(-inf) = 0
        sum += s[i][j];
      }
      l[i] = l[i] * correction + row_sum(sum);
#pragma unroll
      for (int j = 0; j < 4; ++j) o[i][j] *= correction;
      m[i] = m_new;
    }
    __syncthreads();  // every thread has read K
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
      for (int j = 0; j < 4; ++j) ks[(ty + 16 * i) * stride + tx + 16 * j] = s[i][j];
    __syncthreads();
    rows_times_tile(o, ks, vs, ty, tx);
  }
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const index_t t = t0 + ty + 16 * i;
    if (t >= Tn) continue;
    T* const row = out + (s0 + t) * C + index_t(h) * D;
#pragma unroll
    for (int j = 0; j < 4; ++j)
      if (tx + 16 * j < D) row[tx + 16 * j] = from_acc<T>(o[i][j] / l[i]);
    if (tx == 0) lse[(s0 + t) * H + h] = m[i] + dev_log(l[i]);
  }
}

// dk, dv: grid (ceil(longest / tile), H, sequences) over key tiles; 6 tiles of dynamic shared memory (K, V of the
// block's keys; Q, dout, P^T, dS^T of each query tile) and the query tile's lse and delta.
template <class T>
__global__ void __launch_bounds__(threads)
    dkv_kernel(const T* qkv, const float* lse, const T* dout, const float* delta, T* dqkv, index_t C, int H,
               Sequences seqs, float scale) {
  extern __shared__ float smem[];
  float* const ks = smem;
  float* const vs = ks + tile_floats;
  float* const qs = vs + tile_floats;
  float* const gs = qs + tile_floats;  // dout
  float* const ps = gs + tile_floats;  // P^T: [key][query]
  float* const dss = ps + tile_floats;  // dS^T
  float* const lse_s = dss + tile_floats;
  float* const delta_s = lse_s + tile;
  const int tx = int(threadIdx.x) % 16, ty = int(threadIdx.x) / 16, h = int(blockIdx.y);
  const index_t D = C / H, row3 = 3 * C, k0 = index_t(blockIdx.x) * tile;
  const index_t s0 = seqs.start(blockIdx.z), Tn = seqs.length(blockIdx.z);
  if (k0 >= Tn) return;
  const T* const head = qkv + s0 * row3 + index_t(h) * D;
  const index_t keys = Tn - k0 < tile ? Tn - k0 : tile;
  load_tile(ks, head + k0 * row3 + C, row3, keys, D);
  load_tile(vs, head + k0 * row3 + 2 * C, row3, keys, D);
  float dk[4][4] = {}, dv[4][4] = {};
  for (index_t t0 = k0; t0 < Tn; t0 += tile) {  // causal: queries at or after the block's first key
    const index_t queries = Tn - t0 < tile ? Tn - t0 : tile;
    __syncthreads();  // the last query tile is read
    load_tile(qs, head + t0 * row3, row3, queries, D);
    load_tile(gs, dout + (s0 + t0) * C + index_t(h) * D, C, queries, D);
    if (threadIdx.x < tile) {
      const index_t t = t0 + threadIdx.x;
      lse_s[threadIdx.x] = t < Tn ? lse[(s0 + t) * H + h] : 0.0f;
      delta_s[threadIdx.x] = t < Tn ? delta[(s0 + t) * H + h] : 0.0f;
    }
    __syncthreads();
    float st[4][4] = {}, dpt[4][4] = {};
    rows_times_rows(st, ks, qs, D, ty, tx);   // [key][query]
    rows_times_rows(dpt, vs, gs, D, ty, tx);  // dP^T = V dout^T
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const index_t u = k0 + ty + 16 * i;
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const int q = tx + 16 * j;
        const index_t t = t0 + q;
        const float p = u <= t && t < Tn && u < Tn ? dev_exp(st[i][j] * scale - lse_s[q]) : 0.0f;
        ps[(ty + 16 * i) * stride + q] = p;
        dss[(ty + 16 * i) * stride + q] = p * (dpt[i][j] - delta_s[q]) * scale;
      }
    }
    __syncthreads();
    rows_times_tile(dv, ps, gs, ty, tx);   // dV += P^T dout
    rows_times_tile(dk, dss, qs, ty, tx);  // dK += dS^T Q
  }
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const index_t u = k0 + ty + 16 * i;
    if (u >= Tn) continue;
    T* const row = dqkv + (s0 + u) * row3 + index_t(h) * D;
#pragma unroll
    for (int j = 0; j < 4; ++j)
      if (tx + 16 * j < D) {
        row[C + tx + 16 * j] = from_acc<T>(dk[i][j]);
        row[2 * C + tx + 16 * j] = from_acc<T>(dv[i][j]);
      }
  }
}

// dq: grid (ceil(longest / tile), H, sequences) over query tiles; 5 tiles of dynamic shared memory (Q, dout of the
// block's queries; K, V, dS of each key tile).
template <class T>
__global__ void __launch_bounds__(threads)
    dq_kernel(const T* qkv, const float* lse, const T* dout, const float* delta, T* dqkv, index_t C, int H,
              Sequences seqs, float scale) {
  extern __shared__ float smem[];
  float* const qs = smem;
  float* const gs = qs + tile_floats;
  float* const ks = gs + tile_floats;
  float* const vs = ks + tile_floats;
  float* const dss = vs + tile_floats;  // dS: [query][key]
  const int tx = int(threadIdx.x) % 16, ty = int(threadIdx.x) / 16, h = int(blockIdx.y);
  const index_t D = C / H, row3 = 3 * C, t0 = index_t(blockIdx.x) * tile;
  const index_t s0 = seqs.start(blockIdx.z), Tn = seqs.length(blockIdx.z);
  if (t0 >= Tn) return;
  const T* const head = qkv + s0 * row3 + index_t(h) * D;
  const index_t queries = Tn - t0 < tile ? Tn - t0 : tile;
  load_tile(qs, head + t0 * row3, row3, queries, D);
  load_tile(gs, dout + (s0 + t0) * C + index_t(h) * D, C, queries, D);
  float lse_r[4], delta_r[4], dq[4][4] = {};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const index_t t = t0 + ty + 16 * i;
    lse_r[i] = t < Tn ? lse[(s0 + t) * H + h] : 0.0f;
    delta_r[i] = t < Tn ? delta[(s0 + t) * H + h] : 0.0f;
  }
  const index_t last_query = t0 + queries - 1;
  for (index_t k0 = 0; k0 <= last_query; k0 += tile) {
    const index_t keys = Tn - k0 < tile ? Tn - k0 : tile;
    __syncthreads();  // the last key tile and dS are read
    load_tile(ks, head + k0 * row3 + C, row3, keys, D);
    load_tile(vs, head + k0 * row3 + 2 * C, row3, keys, D);
    __syncthreads();
    float s[4][4] = {}, dp[4][4] = {};
    rows_times_rows(s, qs, ks, D, ty, tx);
    rows_times_rows(dp, gs, vs, D, ty, tx);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const index_t t = t0 + ty + 16 * i;
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const index_t u = k0 + tx + 16 * j;
        const float p = u <= t && t < Tn && u < Tn ? dev_exp(s[i][j] * scale - lse_r[i]) : 0.0f;
        dss[(ty + 16 * i) * stride + tx + 16 * j] = p * (dp[i][j] - delta_r[i]) * scale;
      }
    }
    __syncthreads();
    rows_times_tile(dq, dss, ks, ty, tx);  // dQ += dS K
  }
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const index_t t = t0 + ty + 16 * i;
    if (t >= Tn) continue;
    T* const row = dqkv + (s0 + t) * row3 + index_t(h) * D;
#pragma unroll
    for (int j = 0; j < 4; ++j)
      if (tx + 16 * j < D) row[tx + 16 * j] = from_acc<T>(dq[i][j]);
  }
}

inline constexpr std::size_t forward_bytes = 3 * tile_floats * sizeof(float);
inline constexpr std::size_t dkv_bytes = (6 * tile_floats + 2 * tile) * sizeof(float);
inline constexpr std::size_t dq_bytes = 5 * tile_floats * sizeof(float);

/// Lets `kernel` take `bytes` of dynamic shared memory on the current device (over 48 KB needs it).
template <class Kernel>
void allow_shared(Kernel kernel, std::size_t bytes) {
  CUPIPE_CHECK_CUDA(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(bytes)));
}

/// The storage types the tiled kernels take: float and bf16 (host or device spelling). Double stays
/// on the simple kernels.
template <class T>
inline constexpr bool stores = std::is_same_v<std::remove_const_t<T>, float> ||
                               std::is_same_v<std::remove_const_t<T>, bfloat16> ||
                               std::is_same_v<std::remove_const_t<T>, __nv_bfloat16>;

/// Whether the tiled kernels take a head of D columns in element type T: a type they store, heads
/// of 1 to 64 columns.
template <class T>
constexpr bool takes(index_t D) {
  return stores<T> && D >= 1 && D <= max_head_dim;
}

/// T: float or __nv_bfloat16 (the device spelling; kernels::device_ptr converts).
template <class T>
void forward(Context& ctx, const T* qkv, T* out, float* lse, index_t rows, index_t C, int H, Sequences seqs) {
  static_assert(stores<T>, "tiled attention: float or bf16 storage");
  if (rows == 0) return;
  const dim3 grid(unsigned((seqs.longest + tile - 1) / tile), unsigned(H), unsigned(seqs.count));
  const float scale = 1.0f / std::sqrt(float(C / H));  // as the host op
  allow_shared(forward_kernel<T>, forward_bytes);
  forward_kernel<T><<<grid, threads, forward_bytes, ctx.stream()>>>(qkv, out, lse, C, H, seqs, scale);
  CUPIPE_CHECK_LAUNCH();
}

/// dqkv (overwritten) from dout; `delta` is a workspace of rows * H floats.
template <class T>
void backward(Context& ctx, const T* qkv, const T* out, const float* lse, const T* dout, T* dqkv, float* delta, index_t rows,
              index_t C, int H, Sequences seqs) {
  static_assert(stores<T>, "tiled attention: float or bf16 storage");
  if (rows == 0) return;
  const unsigned delta_blocks = unsigned((rows * H + attention_warps - 1) / attention_warps);
  attention_delta_kernel<<<delta_blocks, 32 * attention_warps, 0, ctx.stream()>>>(out, dout, delta, rows, C, H);
  CUPIPE_CHECK_LAUNCH();
  const dim3 grid(unsigned((seqs.longest + tile - 1) / tile), unsigned(H), unsigned(seqs.count));
  const float scale = 1.0f / std::sqrt(float(C / H));
  allow_shared(dkv_kernel<T>, dkv_bytes);
  dkv_kernel<T><<<grid, threads, dkv_bytes, ctx.stream()>>>(qkv, lse, dout, delta, dqkv, C, H, seqs, scale);
  CUPIPE_CHECK_LAUNCH();
  allow_shared(dq_kernel<T>, dq_bytes);
  dq_kernel<T><<<grid, threads, dq_bytes, ctx.stream()>>>(qkv, lse, dout, delta, dqkv, C, H, seqs, scale);
  CUPIPE_CHECK_LAUNCH();
}

}  // namespace cupipe::backend::cuda::kernels::attention_tiled
