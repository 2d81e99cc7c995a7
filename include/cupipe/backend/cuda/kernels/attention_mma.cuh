// SPDX-License-Identifier: Apache-2.0
// Causal self-attention on tensor cores, our own: FlashAttention-2's algorithm with bf16 mma.sync
// (m16n8k16, fp32 accumulation), ldmatrix and cp.async double buffering, for heads of 32, 64 or 128
// columns in bf16 storage. The hand-written path beside cuDNN's (backend/cuda/attention_path.cuh:
// `mma`); layouts as the op's (backend/op_checks.hpp): qkv (n, 3C) rows [q | k | v], out (n, C),
// lse (n, H) natural-log log-sum-exp of the scaled scores, fp32.
//
// The work (FlashAttention-2, Dao 2023): a block of 4 warps owns a tile of 64 queries (forward, dq)
// or 64 keys (dk, dv) of one head; each warp owns 16 of its rows, so the softmax statistics of a row
// live in the 4 lanes of one quad and need no shared memory. The other side streams through shared
// memory in tiles of 64 rows, the next tile loading (cp.async) while the current one is used. Rows
// are padded by 8 elements (16 bytes), so the 8 row addresses of an ldmatrix fall in 8 different
// 4-bank groups. Scores never leave registers: an mma's accumulator fragment for two neighbouring
// 8-column tiles is, packed to bf16, the A fragment of the next product (P V, dS K, ...).
//   forward: S = Q K^T, online softmax in base 2 (scale log2 e folded in), O += P V; key tiles past
//            the diagonal are never visited, and the diagonal tile is masked. Blocks start with the
//            last query tiles, which have the most key tiles (the heaviest first).
//   backward: delta = rowsum(dO * O) (attention.cuh's kernel); dk and dv per key tile over the query
//            tiles at or after it; dq per query tile over the key tiles up to it. Two kernels and no
//            atomics, so the result is deterministic, as with our other kernels.
//
// Status: compiled for sm_90 (2026-12-02), not yet run on a GPU; opt in with
// backend::Cuda::attention = backend::cuda::AttentionKernel::mma (CUPIPE_ATTENTION=mma) until a GPU has run
// tests/cuda/test_cuda_bf16.cu's [mma] cases. Prediction and roofline: docs/gpu_notes.md.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <type_traits>

#include "cupipe/backend/cuda/check.cuh"
#include "cupipe/backend/cuda/context.cuh"
#include "cupipe/backend/cuda/kernels/attention.cuh"
#include "cupipe/backend/cuda/kernels/common.cuh"
#include "cupipe/core/error.hpp"

namespace cupipe::backend::cuda::kernels::attention_mma {

inline constexpr int rows_per_tile = 64;  // queries or keys per block's tile, and per streamed tile
inline constexpr int warps = 4;           // 16 rows each
inline constexpr int threads = 32 * warps;
inline constexpr float log2e = 1.4426950408889634f;

/// Head sizes these kernels are instantiated for.
constexpr bool takes_head(index_t D) { return D == 32 || D == 64 || D == 128; }

/// Padded row of a shared tile, in bf16 elements.
template <int D>
inline constexpr int stride = D + 8;
/// One 64-row tile, in bytes.
template <int D>
inline constexpr int tile_bytes = rows_per_tile * stride<D> * 2;

// ---- PTX wrappers -------------------------------------------------------------------------------

__device__ __forceinline__ std::uint32_t smem_address(const void* p) {
  return static_cast<std::uint32_t>(__cvta_generic_to_shared(p));
}

/// 16 bytes global -> shared, asynchronously; `valid` false fills the 16 bytes with zeros.
__device__ __forceinline__ void copy_16(void* to, const void* from, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_address(to)), "l"(from), "r"(valid ? 16 : 0));
}
__device__ __forceinline__ void commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int pending>
__device__ __forceinline__ void wait_copies() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(pending));
}

/// Four 8x8 bf16 matrices from shared memory; lane l gives the address of one matrix row.
__device__ __forceinline__ void load_matrices(std::uint32_t (&r)[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_address(p)));
}
__device__ __forceinline__ void load_matrices_transposed(std::uint32_t (&r)[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_address(p)));
}

/// c (16x8, fp32) += a (16x16, bf16, row) * b (16x8, bf16, col).
__device__ __forceinline__ void mma(float (&c)[4], const std::uint32_t (&a)[4], std::uint32_t b0, std::uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ std::uint32_t pack_bf16(float lo, float hi) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const std::uint32_t*>(&v);
}

// ---- fragments ----------------------------------------------------------------------------------
// Lane l = 4 g + t. An accumulator c of a 16x8 tile holds (row g, cols 2t, 2t+1) in c[0], c[1] and
// (row g + 8, same cols) in c[2], c[3]. An A fragment of a 16x16 tile holds (row g, k 2t..2t+1),
// (row g+8, k 2t..2t+1), (row g, k 2t+8..2t+9), (row g+8, k 2t+8..2t+9).

/// The A fragment of rows [r0, r0 + 16) and columns [c0, c0 + 16) of a tile stored by rows.
template <int D>
__device__ __forceinline__ void load_a(std::uint32_t (&a)[4], const __nv_bfloat16* tile, int r0, int c0) {
  const int lane = int(threadIdx.x) % 32;
  load_matrices(a, tile + (r0 + lane % 16) * stride<D> + c0 + (lane / 16) * 8);
}

/// B fragments (k 16, n 8) of two n-tiles [n0, n0 + 8) and [n0 + 8, n0 + 16), k in [k0, k0 + 16), from
/// a tile stored with n as its rows (K for Q K^T): b[0], b[1] for the first n-tile, b[2], b[3] for the
/// second.
template <int D>
__device__ __forceinline__ void load_b_rows_n(std::uint32_t (&b)[4], const __nv_bfloat16* tile, int n0, int k0) {
  const int lane = int(threadIdx.x) % 32, m = lane / 8;
  load_matrices(b, tile + (n0 + lane % 8 + (m / 2) * 8) * stride<D> + k0 + (m % 2) * 8);
}

/// The same from a tile stored with k as its rows (V for P V): transposed on the way.
template <int D>
__device__ __forceinline__ void load_b_rows_k(std::uint32_t (&b)[4], const __nv_bfloat16* tile, int k0, int n0) {
  const int lane = int(threadIdx.x) % 32, m = lane / 8;
  load_matrices_transposed(b, tile + (k0 + lane % 8 + (m % 2) * 8) * stride<D> + n0 + (m / 2) * 8);
}

/// acc (16 x 64: 8 n-tiles) += rows [r0, r0 + 16) of `a_tile` times the 64 rows of `b_tile`,
/// transposed (both stored by rows, D columns): S = Q K^T and its relatives.
template <int D>
__device__ __forceinline__ void rows_times_rows(float (&acc)[8][4], const __nv_bfloat16* a_tile, int r0, const __nv_bfloat16* b_tile) {
#pragma unroll
  for (int kk = 0; kk < D / 16; ++kk) {
    std::uint32_t a[4];
    load_a<D>(a, a_tile, r0, 16 * kk);
#pragma unroll
    for (int np = 0; np < 4; ++np) {
      std::uint32_t b[4];
      load_b_rows_n<D>(b, b_tile, 16 * np, 16 * kk);
      mma(acc[2 * np], a, b[0], b[1]);
      mma(acc[2 * np + 1], a, b[2], b[3]);
    }
  }
}

/// acc (16 x D: D/8 n-tiles) += p (16 x 64, accumulator fragments, rounded to bf16) times the 64 rows
/// of `b_tile` (stored by rows, D columns): O += P V and its relatives.
template <int D>
__device__ __forceinline__ void scores_times_rows(float (&acc)[D / 8][4], const float (&p)[8][4], const __nv_bfloat16* b_tile) {
#pragma unroll
  for (int kk = 0; kk < 4; ++kk) {
    const std::uint32_t a[4] = {pack_bf16(p[2 * kk][0], p[2 * kk][1]), pack_bf16(p[2 * kk][2], p[2 * kk][3]),
                                pack_bf16(p[2 * kk + 1][0], p[2 * kk + 1][1]), pack_bf16(p[2 * kk + 1][2], p[2 * kk + 1][3])};
#pragma unroll
    for (int dp = 0; dp < D / 16; ++dp) {
      std::uint32_t b[4];
      load_b_rows_k<D>(b, b_tile, 16 * kk, 16 * dp);
      mma(acc[2 * dp], a, b[0], b[1]);
      mma(acc[2 * dp + 1], a, b[2], b[3]);
    }
  }
}

/// Starts copying rows [row0, row0 + 64) of one part of qkv-like rows (`row_stride` apart, D columns
/// from `from`) into a padded tile; rows at or past `rows` become zeros.
template <int D>
__device__ __forceinline__ void copy_tile(__nv_bfloat16* to, const __nv_bfloat16* from, index_t row_stride, index_t row0, index_t rows) {
  constexpr int chunks_per_row = D / 8;  // 16 bytes each
  for (int c = int(threadIdx.x); c < rows_per_tile * chunks_per_row; c += threads) {
    const int r = c / chunks_per_row, col = (c % chunks_per_row) * 8;
    const bool valid = row0 + r < rows;
    copy_16(to + r * stride<D> + col, from + (valid ? (row0 + r) * row_stride + col : 0), valid);
  }
}

/// Sum over the 4 lanes of a quad (one row's owners).
__device__ __forceinline__ float quad_sum(float v) {
  v += __shfl_xor_sync(0xffffffffu, v, 1);
  return v + __shfl_xor_sync(0xffffffffu, v, 2);
}
__device__ __forceinline__ float quad_max(float v) {
  v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 1));
  return fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 2));
}

/// The double-buffered walk's step: starts the next tile's copies (`issue`, when there is a next tile)
/// while waiting for the current tile's, then lets the whole block see it.
template <class Issue>
__device__ __forceinline__ void next_tile(bool more, Issue&& issue) {
  if (more) {
    issue();
    commit();
    wait_copies<1>();
  } else {
    wait_copies<0>();
  }
  __syncthreads();
}

// ---- forward ------------------------------------------------------------------------------------

/// The online softmax's step over one key tile: each row's running max m takes in the tile's
/// (row_max, then the quad's), the scores become exp2(s - m) (row_max is left holding the m they
/// were taken against), their sum joins the running sum l, and the output accumulator o is
/// rescaled to the new max.
template <int D>
__device__ __forceinline__ void online_softmax(float (&s)[8][4], float (&row_max)[2], float (&m)[2], float (&l)[2],
                                               float (&o)[D / 8][4]) {
  float alpha[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const float m_new = fmaxf(m[r], quad_max(row_max[r]));
    // A row with every key so far masked keeps m = -inf; its terms are exp2(-inf) = 0.
    const float base = m_new == -INFINITY ? 0.0f : m_new;
    alpha[r] = exp2f(m[r] - base);
    m[r] = m_new;
    row_max[r] = base;
  }
#pragma unroll
  for (int nt = 0; nt < 8; ++nt)
#pragma unroll
    for (int e = 0; e < 4; ++e) s[nt][e] = exp2f(s[nt][e] - row_max[e / 2]);
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    float sum = 0;
#pragma unroll
    for (int nt = 0; nt < 8; ++nt) sum += s[nt][2 * r] + s[nt][2 * r + 1];
    l[r] = l[r] * alpha[r] + sum;  // this lane's share of the row; the quad's shares are added at the end
  }
#pragma unroll
  for (int dt = 0; dt < D / 8; ++dt) {
    o[dt][0] *= alpha[0], o[dt][1] *= alpha[0];
    o[dt][2] *= alpha[1], o[dt][3] *= alpha[1];
  }
}

template <int D>
inline constexpr std::size_t forward_bytes = std::size_t(5) * tile_bytes<D>;  // Q, 2 x K, 2 x V

// grid (tiles of the longest sequence, H, sequences), 128 threads.
template <int D>
__global__ void __launch_bounds__(threads)
    forward_kernel(const __nv_bfloat16* qkv, __nv_bfloat16* out, float* lse, index_t C, int H, Sequences seqs, float scale_log2) {
  extern __shared__ __align__(16) unsigned char smem_bytes[];
  constexpr int tile = rows_per_tile * stride<D>;  // elements
  auto* const qs = reinterpret_cast<__nv_bfloat16*>(smem_bytes);
  // Buffer b of K and of V (offsets, not an array of pointers: a run-time index would put it on the stack).
  const auto ks = [qs](int b) { return qs + (1 + b) * tile; };
  const auto vs = [qs](int b) { return qs + (3 + b) * tile; };
  const index_t s0 = seqs.start(blockIdx.z), Tn = seqs.length(blockIdx.z);
  const index_t tiles = (Tn + rows_per_tile - 1) / rows_per_tile;
  if (index_t(blockIdx.x) >= tiles) return;  // past a shorter document's end (the whole block)
  const index_t i = tiles - 1 - index_t(blockIdx.x);  // the heaviest query tiles first
  const int h = int(blockIdx.y), warp = int(threadIdx.x) / 32, lane = int(threadIdx.x) % 32, g = lane / 4, t = lane % 4;
  const index_t row3 = 3 * C, q0 = i * rows_per_tile;
  const __nv_bfloat16* const q_base = qkv + s0 * row3 + index_t(h) * D;
  const __nv_bfloat16* const k_base = q_base + C;
  const __nv_bfloat16* const v_base = q_base + 2 * C;

  copy_tile<D>(qs, q_base, row3, q0, Tn);
  copy_tile<D>(ks(0), k_base, row3, 0, Tn);
  copy_tile<D>(vs(0), v_base, row3, 0, Tn);
  commit();

  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0, 0}, o[D / 8][4] = {};
  const index_t query[2] = {q0 + 16 * warp + g, q0 + 16 * warp + g + 8};
  for (index_t j = 0; j <= i; ++j) {
    const int buffer = int(j % 2);
    next_tile(j < i, [&] {  // the next key tile streams in while this one is used
      copy_tile<D>(ks(1 - buffer), k_base, row3, (j + 1) * rows_per_tile, Tn);
      copy_tile<D>(vs(1 - buffer), v_base, row3, (j + 1) * rows_per_tile, Tn);
    });
    float s[8][4] = {};
    rows_times_rows<D>(s, qs, 16 * warp, ks(buffer));
    const bool edge = j == i || (j + 1) * rows_per_tile > Tn;  // the diagonal, or keys past T
    float row_max[2] = {-INFINITY, -INFINITY};
#pragma unroll
    for (int nt = 0; nt < 8; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const index_t key = j * rows_per_tile + 8 * nt + 2 * t + (e % 2);
        float x = s[nt][e] * scale_log2;
        if (edge && (key > query[e / 2] || key >= Tn)) x = -INFINITY;
        s[nt][e] = x;
        row_max[e / 2] = fmaxf(row_max[e / 2], x);
      }
    online_softmax<D>(s, row_max, m, l, o);
    scores_times_rows<D>(o, s, vs(buffer));
    __syncthreads();  // the tile just used is the one the next iteration loads into
  }

#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const float total = quad_sum(l[r]);
    const float inverse = total > 0 ? 1.0f / total : 0.0f;
    if (query[r] >= Tn) continue;
    __nv_bfloat16* const row = out + (s0 + query[r]) * C + index_t(h) * D;
#pragma unroll
    for (int dt = 0; dt < D / 8; ++dt)
      *reinterpret_cast<__nv_bfloat162*>(row + 8 * dt + 2 * t) =
          __floats2bfloat162_rn(o[dt][2 * r] * inverse, o[dt][2 * r + 1] * inverse);
    if (t == 0) lse[(s0 + query[r]) * H + h] = (m[r] + log2f(total)) / log2e;
  }
}

// ---- backward -----------------------------------------------------------------------------------

template <int D>
inline constexpr std::size_t backward_bytes = std::size_t(6) * tile_bytes<D> + 4 * rows_per_tile * sizeof(float);

/// P and dS of one 16 x 64 piece, from scores s (raw q.k), dp (dO.v), the rows' or columns' lse and
/// delta: p = exp(scale s - lse) (0 where masked), ds = p (dp - delta). `transposed`: rows are keys and
/// columns queries (the dk/dv kernel); otherwise rows are queries.
template <bool transposed>
__device__ __forceinline__ void probabilities(float (&s)[8][4], float (&dp)[8][4], const float* lse_log2, const float* delta,
                                              index_t row0, index_t col0, index_t Tn, float scale_log2) {
  const int lane = int(threadIdx.x) % 32, g = lane / 4, t = lane % 4;
#pragma unroll
  for (int nt = 0; nt < 8; ++nt)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int r = g + 8 * (e / 2), c = 8 * nt + 2 * t + (e % 2);
      const index_t query = transposed ? col0 + c : row0 + r, key = transposed ? row0 + r : col0 + c;
      const int q_local = transposed ? c : r;
      const bool live = key <= query && query < Tn && key < Tn;
      const float p = live ? exp2f(s[nt][e] * scale_log2 - lse_log2[q_local]) : 0.0f;
      s[nt][e] = p;
      dp[nt][e] = p * (dp[nt][e] - delta[q_local]);
    }
}

/// Stages 64 queries' lse (in base 2) and delta into shared memory (0 past T).
__device__ __forceinline__ void stage_row_stats(float* lse_log2, float* delta_s, const float* lse, const float* delta, index_t s0,
                                                index_t q0, index_t Tn, int H, int h) {
  for (int r = int(threadIdx.x); r < rows_per_tile; r += threads) {
    const bool valid = q0 + r < Tn;
    lse_log2[r] = valid ? lse[(s0 + q0 + r) * H + h] * log2e : 0.0f;
    delta_s[r] = valid ? delta[(s0 + q0 + r) * H + h] : 0.0f;
  }
}

/// Stores a 16 x D accumulator (rows [row0 + 16 warp, ...)) times `factor` into rows of `to`.
template <int D>
__device__ __forceinline__ void store_rows(__nv_bfloat16* to, index_t row_stride, const float (&acc)[D / 8][4], index_t row0, index_t Tn,
                                           float factor) {
  const int lane = int(threadIdx.x) % 32, g = lane / 4, t = lane % 4, warp = int(threadIdx.x) / 32;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const index_t row = row0 + 16 * warp + g + 8 * r;
    if (row >= Tn) continue;
#pragma unroll
    for (int dt = 0; dt < D / 8; ++dt)
      *reinterpret_cast<__nv_bfloat162*>(to + row * row_stride + 8 * dt + 2 * t) =
          __floats2bfloat162_rn(acc[dt][2 * r] * factor, acc[dt][2 * r + 1] * factor);
  }
}

// dk, dv: grid (tiles, H, sequences); block j owns keys [64 j, 64 j + 64) and walks the query tiles
// i >= j (the first key tiles have the most: block x is key tile x, the heaviest first).
template <int D>
__global__ void __launch_bounds__(threads)
    dkv_kernel(const __nv_bfloat16* qkv, const float* lse, const __nv_bfloat16* dout, const float* delta, __nv_bfloat16* dqkv,
               index_t C, int H, Sequences seqs, float scale_log2, float scale) {
  extern __shared__ __align__(16) unsigned char smem_bytes[];
  constexpr int tile = rows_per_tile * stride<D>;
  auto* const ks = reinterpret_cast<__nv_bfloat16*>(smem_bytes);
  __nv_bfloat16* const vs = ks + tile;
  const auto qs = [ks](int b) { return ks + (2 + b) * tile; };
  const auto dos = [ks](int b) { return ks + (4 + b) * tile; };
  float* const stats = reinterpret_cast<float*>(ks + 6 * tile);  // lse_log2[2][64], delta[2][64]
  const index_t s0 = seqs.start(blockIdx.z), Tn = seqs.length(blockIdx.z);
  const index_t tiles = (Tn + rows_per_tile - 1) / rows_per_tile, j = index_t(blockIdx.x);
  if (j >= tiles) return;
  const int h = int(blockIdx.y), warp = int(threadIdx.x) / 32;
  const index_t row3 = 3 * C, k0 = j * rows_per_tile;
  const __nv_bfloat16* const q_base = qkv + s0 * row3 + index_t(h) * D;
  const __nv_bfloat16* const do_base = dout + s0 * C + index_t(h) * D;

  copy_tile<D>(ks, q_base + C, row3, k0, Tn);
  copy_tile<D>(vs, q_base + 2 * C, row3, k0, Tn);
  copy_tile<D>(qs(0), q_base, row3, k0, Tn);
  copy_tile<D>(dos(0), do_base, C, k0, Tn);
  commit();
  stage_row_stats(stats, stats + 2 * rows_per_tile, lse, delta, s0, k0, Tn, H, h);

  float dk[D / 8][4] = {}, dv[D / 8][4] = {};
  for (index_t i = j; i < tiles; ++i) {
    const int buffer = int((i - j) % 2);
    next_tile(i + 1 < tiles, [&] {
      copy_tile<D>(qs(1 - buffer), q_base, row3, (i + 1) * rows_per_tile, Tn);
      copy_tile<D>(dos(1 - buffer), do_base, C, (i + 1) * rows_per_tile, Tn);
    });
    if (i + 1 < tiles)  // the stats of the next query tile into the other half; read after the next sync
      stage_row_stats(stats + (1 - buffer) * rows_per_tile, stats + (2 + 1 - buffer) * rows_per_tile, lse, delta, s0,
                      (i + 1) * rows_per_tile, Tn, H, h);
    float s[8][4] = {}, dp[8][4] = {};
    rows_times_rows<D>(s, ks, 16 * warp, qs(buffer));    // S^T = K Q^T (16 keys x 64 queries)
    rows_times_rows<D>(dp, vs, 16 * warp, dos(buffer));  // dP^T = V dO^T
    probabilities<true>(s, dp, stats + buffer * rows_per_tile, stats + (2 + buffer) * rows_per_tile, k0 + 16 * warp,
                        i * rows_per_tile, Tn, scale_log2);
    scores_times_rows<D>(dv, s, dos(buffer));  // dV += P^T dO
    scores_times_rows<D>(dk, dp, qs(buffer));  // dK += dS^T Q (times scale on the store)
    __syncthreads();
  }
  store_rows<D>(dqkv + s0 * row3 + index_t(h) * D + C, row3, dk, k0, Tn, scale);
  store_rows<D>(dqkv + s0 * row3 + index_t(h) * D + 2 * C, row3, dv, k0, Tn, 1.0f);
}

// dq: grid (tiles, H, sequences); block x owns query tile tiles - 1 - x (the heaviest first) and walks
// the key tiles up to it.
template <int D>
__global__ void __launch_bounds__(threads)
    dq_kernel(const __nv_bfloat16* qkv, const float* lse, const __nv_bfloat16* dout, const float* delta, __nv_bfloat16* dqkv,
              index_t C, int H, Sequences seqs, float scale_log2, float scale) {
  extern __shared__ __align__(16) unsigned char smem_bytes[];
  constexpr int tile = rows_per_tile * stride<D>;
  auto* const qs = reinterpret_cast<__nv_bfloat16*>(smem_bytes);
  __nv_bfloat16* const dos = qs + tile;
  const auto ks = [qs](int b) { return qs + (2 + b) * tile; };
  const auto vs = [qs](int b) { return qs + (4 + b) * tile; };
  float* const stats = reinterpret_cast<float*>(qs + 6 * tile);  // lse_log2[64], delta[64]
  const index_t s0 = seqs.start(blockIdx.z), Tn = seqs.length(blockIdx.z);
  const index_t tiles = (Tn + rows_per_tile - 1) / rows_per_tile;
  if (index_t(blockIdx.x) >= tiles) return;
  const index_t i = tiles - 1 - index_t(blockIdx.x);
  const int h = int(blockIdx.y), warp = int(threadIdx.x) / 32;
  const index_t row3 = 3 * C, q0 = i * rows_per_tile;
  const __nv_bfloat16* const q_base = qkv + s0 * row3 + index_t(h) * D;

  copy_tile<D>(qs, q_base, row3, q0, Tn);
  copy_tile<D>(dos, dout + s0 * C + index_t(h) * D, C, q0, Tn);
  copy_tile<D>(ks(0), q_base + C, row3, 0, Tn);
  copy_tile<D>(vs(0), q_base + 2 * C, row3, 0, Tn);
  commit();
  stage_row_stats(stats, stats + rows_per_tile, lse, delta, s0, q0, Tn, H, h);

  float dq[D / 8][4] = {};
  for (index_t j = 0; j <= i; ++j) {
    const int buffer = int(j % 2);
    next_tile(j < i, [&] {
      copy_tile<D>(ks(1 - buffer), q_base + C, row3, (j + 1) * rows_per_tile, Tn);
      copy_tile<D>(vs(1 - buffer), q_base + 2 * C, row3, (j + 1) * rows_per_tile, Tn);
    });
    float s[8][4] = {}, dp[8][4] = {};
    rows_times_rows<D>(s, qs, 16 * warp, ks(buffer));    // S = Q K^T
    rows_times_rows<D>(dp, dos, 16 * warp, vs(buffer));  // dP = dO V^T
    // This warp's rows are queries [q0 + 16 warp, ...): their stats start 16 warp into the tile's.
    probabilities<false>(s, dp, stats + 16 * warp, stats + rows_per_tile + 16 * warp, q0 + 16 * warp, j * rows_per_tile, Tn,
                         scale_log2);
    scores_times_rows<D>(dq, dp, ks(buffer));  // dQ += dS K (times scale on the store)
    __syncthreads();
  }
  store_rows<D>(dqkv + s0 * row3 + index_t(h) * D, row3, dq, q0, Tn, scale);
}

// ---- launchers ----------------------------------------------------------------------------------

/// Calls f.template operator()<D>() for a head size these kernels take.
template <class F>
void with_head(index_t D, F&& f) {
  if (D == 32) f.template operator()<32>();
  else if (D == 64) f.template operator()<64>();
  else if (D == 128) f.template operator()<128>();
  else CUPIPE_THROW("mma attention: heads of 32, 64 or 128 columns, not ", D);
}

template <class Kernel>
void allow_shared(Kernel kernel, std::size_t bytes) {
  CUPIPE_CHECK_CUDA(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(bytes)));
}

/// Shared memory the kernels for a head of D columns take (the backward's, the larger).
inline std::size_t shared_bytes(index_t D) {
  return D == 32 ? backward_bytes<32> : D == 64 ? backward_bytes<64> : backward_bytes<128>;
}

/// Whether these kernels run a call on ctx's device: a head of 32, 64 or 128 columns, 16-byte aligned
/// rows (cp.async), and the shared memory a block may opt into (heads of 128 need 103 KB: an A100 or
/// H100 has it, GPUs of compute capability 8.6 and 8.9 have 99 KB).
inline bool takes(const Context& ctx, index_t D, const void* qkv, const void* out) {
  if (!takes_head(D) || reinterpret_cast<std::uintptr_t>(qkv) % 16 != 0 || reinterpret_cast<std::uintptr_t>(out) % 16 != 0)
    return false;
  int optin = 0;
  CUPIPE_CHECK_CUDA(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, ctx.device()));
  return shared_bytes(D) <= std::size_t(optin);
}

// The launchers are templates (T is always __nv_bfloat16) so that only the translation units that call
// them compile the kernels' device code: an inline function would put all nine kernels in every
// translation unit that includes ops.cuh.
template <class T>
void forward(Context& ctx, const T* qkv, T* out, float* lse, index_t rows, index_t C, int H, Sequences seqs) {
  static_assert(std::is_same_v<T, __nv_bfloat16>, "mma attention: bf16 storage");
  if (rows == 0) return;
  const index_t D = C / H;
  const dim3 grid(unsigned((seqs.longest + rows_per_tile - 1) / rows_per_tile), unsigned(H), unsigned(seqs.count));
  const float scale_log2 = log2e / std::sqrt(float(D));
  with_head(D, [&]<int HD>() {
    allow_shared(forward_kernel<HD>, forward_bytes<HD>);
    forward_kernel<HD><<<grid, threads, forward_bytes<HD>, ctx.stream()>>>(qkv, out, lse, C, H, seqs, scale_log2);
    CUPIPE_CHECK_LAUNCH();
  });
}

/// dqkv (overwritten) from dout; `delta` is a workspace of rows * H floats.
template <class T>
void backward(Context& ctx, const T* qkv, const T* out, const float* lse, const T* dout, T* dqkv, float* delta, index_t rows,
              index_t C, int H, Sequences seqs) {
  static_assert(std::is_same_v<T, __nv_bfloat16>, "mma attention: bf16 storage");
  if (rows == 0) return;
  const index_t D = C / H;
  const unsigned delta_blocks = unsigned((rows * H + attention_warps - 1) / attention_warps);
  attention_delta_kernel<<<delta_blocks, 32 * attention_warps, 0, ctx.stream()>>>(out, dout, delta, rows, C, H);
  CUPIPE_CHECK_LAUNCH();
  const dim3 grid(unsigned((seqs.longest + rows_per_tile - 1) / rows_per_tile), unsigned(H), unsigned(seqs.count));
  const float scale = 1.0f / std::sqrt(float(D)), scale_log2 = scale * log2e;
  with_head(D, [&]<int HD>() {
    allow_shared(dkv_kernel<HD>, backward_bytes<HD>);
    dkv_kernel<HD><<<grid, threads, backward_bytes<HD>, ctx.stream()>>>(qkv, lse, dout, delta, dqkv, C, H, seqs, scale_log2, scale);
    CUPIPE_CHECK_LAUNCH();
    allow_shared(dq_kernel<HD>, backward_bytes<HD>);
    dq_kernel<HD><<<grid, threads, backward_bytes<HD>, ctx.stream()>>>(qkv, lse, dout, delta, dqkv, C, H, seqs, scale_log2, scale);
    CUPIPE_CHECK_LAUNCH();
  });
}

}  // namespace cupipe::backend::cuda::kernels::attention_mma
