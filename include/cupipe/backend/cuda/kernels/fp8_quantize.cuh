// SPDX-License-Identifier: Apache-2.0
// FP8 quantisation for the block recipe (fp8::Blockwise; the host's fp8::quantize is the oracle):
// each block's scale is its largest magnitude over the format's largest value, in fp32 (1 for a
// block of zeros), and each code is the value over that scale, rounded to nearest even and
// saturating (cuda_fp8.h's __nv_cvt_float_to_fp8 with __NV_SATFINITE: the host's from_float, bit
// for bit, for finite values). The scales are written where cuBLASLt's block-scaled FP8 GEMM reads
// them on Hopper (cuBLAS 12.9+, "128-element 1D and 128x128 2D block scaling"):
// - 1 x 128 tiles along k of an operand with `outer` rows (VEC128_32F): scale (row i, block b) at
//   b * outer + i, the rows contiguous;
// - 128 x 128 blocks (BLK128x128_32F): scale (row block p, k block b) at p * L4 + b, L4 the count
//   of k blocks rounded up to a multiple of 4.
// Every operand is written k-contiguous, as Hopper's FP8 GEMM takes them (cuBLASLt's "TN"): a tensor
// whose tiles run across its rows (the weight gradient's dy^T and x^T) is transposed on the way,
// through shared memory, and a weight is written both as it is and transposed (W for the forward,
// W^T for the input gradient) from one pass over its blocks.
//
// Roofline (H200, 4.8 TB/s): a pass reads 2 bytes and writes 1 (2 for a weight) per value. GPT-2
// 124M at 8 x 1024 tokens: x of a 768 -> 3072 layer is 6.3 M values, 19 MB, 4 us; the transposed
// kernel's shared tile keeps both sides coalesced. The weight's transposed codes are written
// 128 bytes apart per warp (a block reads rows, writes columns): 2.4 M values, about 10 us for
// the largest weight, once per GEMM that uses it. Predictions, not yet measured.
#pragma once

#include <cuda_fp8.h>
#include <cuda_runtime_api.h>

#include "cupipe/backend/cuda/check.cuh"
#include "cupipe/backend/cuda/context.cuh"
#include "cupipe/backend/cuda/kernels/common.cuh"
#include "cupipe/core/shape.hpp"

namespace cupipe::backend::cuda::kernels {

/// Largest finite magnitude of E4M3.
inline constexpr float e4m3_max = 448.0f;

__device__ __forceinline__ unsigned char e4m3_code(float v, float scale) {
  return __nv_cvt_float_to_fp8(v / scale, __NV_SATFINITE, __NV_E4M3);
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

__device__ __forceinline__ float block_scale(float amax) { return amax > 0.0f ? amax / e4m3_max : 1.0f; }

/// One warp per (row, 128-wide tile of the row): x (rows, cols) -> codes (rows, cols),
/// scales[tile * rows + row].
template <class In>
__global__ void quantize_tiles_kernel(const In* __restrict__ x, index_t rows, index_t cols, unsigned char* __restrict__ codes,
                                      float* __restrict__ scales) {
  const index_t tiles = (cols + 127) / 128;
  const index_t warp = (index_t(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
  const int lane = int(threadIdx.x % 32);
  if (warp >= rows * tiles) return;  // whole warps leave together
  const index_t row = warp / tiles, tile = warp % tiles, c0 = tile * 128;
  float v[4];
  float amax = 0.0f;
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const index_t c = c0 + lane + 32 * j;
    v[j] = c < cols ? static_cast<float>(x[row * cols + c]) : 0.0f;
    amax = fmaxf(amax, fabsf(v[j]));
  }
  const float scale = block_scale(warp_max(amax));
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const index_t c = c0 + lane + 32 * j;
    if (c < cols) codes[row * cols + c] = e4m3_code(v[j], scale);
  }
  if (lane == 0) scales[tile * rows + row] = scale;
}

/// x (rows, cols) in tiles of 128 down each column -> codes of x^T (cols, rows), scales[tile * cols +
/// col]. A block takes 128 rows x 32 columns through shared memory; each warp then a column at a time.
template <class In>
__global__ void quantize_tiles_transposed_kernel(const In* __restrict__ x, index_t rows, index_t cols,
                                                 unsigned char* __restrict__ codes, float* __restrict__ scales) {
  __shared__ float tile[128][33];
  const index_t r0 = index_t(blockIdx.y) * 128, c0 = index_t(blockIdx.x) * 32;
  for (int i = int(threadIdx.x); i < 128 * 32; i += int(blockDim.x)) {
    const int r = i / 32, c = i % 32;
    tile[r][c] = r0 + r < rows && c0 + c < cols ? static_cast<float>(x[(r0 + r) * cols + c0 + c]) : 0.0f;
  }
  __syncthreads();
  const int warp = int(threadIdx.x / 32), lane = int(threadIdx.x % 32), warps = int(blockDim.x / 32);
  for (int c = warp; c < 32 && c0 + c < cols; c += warps) {
    float amax = 0.0f;
#pragma unroll
    for (int j = 0; j < 4; ++j) amax = fmaxf(amax, fabsf(tile[lane + 32 * j][c]));
    const float scale = block_scale(warp_max(amax));
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const index_t r = r0 + lane + 32 * j;
      if (r < rows) codes[(c0 + c) * rows + r] = e4m3_code(tile[lane + 32 * j][c], scale);
    }
    if (lane == 0) scales[index_t(blockIdx.y) * cols + c0 + c] = scale;
  }
}

/// One block per 128 x 128 block of w (rows, cols): codes (rows, cols) and scales[rb * l4 + cb],
/// codes_t (cols, rows) and scales_t[cb * l4_t + rb]; either pair may be null.
template <class In>
__global__ void quantize_blocks_kernel(const In* __restrict__ w, index_t rows, index_t cols, unsigned char* __restrict__ codes,
                                       float* __restrict__ scales, index_t l4, unsigned char* __restrict__ codes_t,
                                       float* __restrict__ scales_t, index_t l4_t) {
  __shared__ float partial[32];
  __shared__ float shared_scale;
  const index_t rb = blockIdx.y, cb = blockIdx.x, r0 = rb * 128, c0 = cb * 128;
  float amax = 0.0f;
  for (int i = int(threadIdx.x); i < 128 * 128; i += int(blockDim.x)) {
    const index_t r = r0 + i / 128, c = c0 + i % 128;
    if (r < rows && c < cols) amax = fmaxf(amax, fabsf(static_cast<float>(w[r * cols + c])));
  }
  amax = warp_max(amax);
  if (threadIdx.x % 32 == 0) partial[threadIdx.x / 32] = amax;
  __syncthreads();
  if (threadIdx.x < 32) {
    float v = threadIdx.x < blockDim.x / 32 ? partial[threadIdx.x] : 0.0f;
    v = warp_max(v);
    if (threadIdx.x == 0) {
      shared_scale = block_scale(v);
      if (scales) scales[rb * l4 + cb] = shared_scale;
      if (scales_t) scales_t[cb * l4_t + rb] = shared_scale;
    }
  }
  __syncthreads();
  const float scale = shared_scale;
  if (codes)
    for (int i = int(threadIdx.x); i < 128 * 128; i += int(blockDim.x)) {
      const index_t r = r0 + i / 128, c = c0 + i % 128;  // along the row: coalesced
      if (r < rows && c < cols) codes[r * cols + c] = e4m3_code(static_cast<float>(w[r * cols + c]), scale);
    }
  if (codes_t)
    for (int i = int(threadIdx.x); i < 128 * 128; i += int(blockDim.x)) {
      const index_t r = r0 + i % 128, c = c0 + i / 128;  // down the column: the transposed row is coalesced
      if (r < rows && c < cols) codes_t[c * rows + r] = e4m3_code(static_cast<float>(w[r * cols + c]), scale);
    }
}

/// Launches quantize_tiles_kernel: x (rows, cols), tiles along cols.
template <class In>
void quantize_tiles(Context& ctx, const In* x, index_t rows, index_t cols, unsigned char* codes, float* scales) {
  const index_t warps = rows * ((cols + 127) / 128);
  if (warps == 0) return;
  constexpr int threads = 256;
  quantize_tiles_kernel<<<unsigned((warps * 32 + threads - 1) / threads), threads, 0, ctx.stream()>>>(x, rows, cols, codes,
                                                                                                       scales);
  CUPIPE_CHECK_LAUNCH();
}

/// Launches quantize_tiles_transposed_kernel: x (rows, cols), tiles along rows, codes of x^T.
template <class In>
void quantize_tiles_transposed(Context& ctx, const In* x, index_t rows, index_t cols, unsigned char* codes, float* scales) {
  if (rows == 0 || cols == 0) return;
  const dim3 grid(unsigned((cols + 31) / 32), unsigned((rows + 127) / 128));
  CUPIPE_REQUIRE(grid.y <= unsigned(max_grid_yz), "fp8 quantize: ", rows, " rows is more than one launch takes");
  quantize_tiles_transposed_kernel<<<grid, 256, 0, ctx.stream()>>>(x, rows, cols, codes, scales);
  CUPIPE_CHECK_LAUNCH();
}

/// Launches quantize_blocks_kernel: w (rows, cols) in 128 x 128 blocks; either the codes and scales
/// or the transposed ones may be null.
template <class In>
void quantize_blocks(Context& ctx, const In* w, index_t rows, index_t cols, unsigned char* codes, float* scales, index_t l4,
                     unsigned char* codes_t, float* scales_t, index_t l4_t) {
  if (rows == 0 || cols == 0) return;
  const dim3 grid(unsigned((cols + 127) / 128), unsigned((rows + 127) / 128));
  CUPIPE_REQUIRE(grid.y <= unsigned(max_grid_yz), "fp8 quantize: ", rows, " rows is more than one launch takes");
  quantize_blocks_kernel<<<grid, 256, 0, ctx.stream()>>>(w, rows, cols, codes, scales, l4, codes_t, scales_t, l4_t);
  CUPIPE_CHECK_LAUNCH();
}

// Per-tensor scaling (fp8::PerTensorDelayed; the host's DelayedScaling::quantize is the oracle): one
// scale for the whole tensor, the history's (`scale`, known on the host before the step) or, on an
// operand's first use, its own amax over the format's largest value (`own`: amax_kernel's state, on
// the device). Each kernel writes the scale it used to *scale_out (cuBLASLt's scale pointer for that
// operand) and adds the tensor's amax to *step (float bits as a signed int: atomicMax orders
// non-negative floats, and the -1.0f that marks "unused this step" below every one of them).
// One pass reads 2 bytes and writes 1 per value: GPT-2 124M's largest activation (8 x 1024 x 3072
// values, 25 M) is 75 MB, 16 us at the H200's 4.8 TB/s; a first use adds amax_kernel's read.

/// Largest finite magnitude of the FP8 format.
template <__nv_fp8_interpretation_t Format>
inline constexpr float fp8_max = Format == __NV_E4M3 ? 448.0f : 57344.0f;

template <__nv_fp8_interpretation_t Format>
__device__ __forceinline__ float tensor_scale(float scale, const unsigned* own) {
  if (own == nullptr) return scale;
  const float amax = __uint_as_float(own[0]);
  return amax > 0.0f ? amax / fp8_max<Format> : 1.0f;
}

/// Adds a warp's largest magnitude to *step (lane 0 of each warp).
__device__ __forceinline__ void add_step_amax(float amax, int* step) {
  amax = warp_max(amax);
  if (threadIdx.x % 32 == 0 && step != nullptr) atomicMax(step, __float_as_int(amax));
}

/// v / s in Format, saturating; a value that is not finite becomes NaN (0x7F in both formats), not
/// the largest code SATFINITE would give an infinity, so the product and the loss check see it. The
/// host refuses such a value (DelayedScaling::quantize).
template <__nv_fp8_interpretation_t Format>
__device__ __forceinline__ unsigned char tensor_code(float v, float s) {
  return isfinite(v) ? __nv_cvt_float_to_fp8(v / s, __NV_SATFINITE, Format) : static_cast<unsigned char>(0x7F);
}
/// The amax so far with |v| added, leaving out what is not finite (its code is NaN).
__device__ __forceinline__ float finite_amax(float amax, float v) { return isfinite(v) ? fmaxf(amax, fabsf(v)) : amax; }

/// x (n values) -> codes (n), in order: a grid-stride pass.
template <__nv_fp8_interpretation_t Format, class In>
__global__ void quantize_tensor_kernel(const In* __restrict__ x, index_t n, float scale, const unsigned* own,
                                       unsigned char* __restrict__ codes, float* scale_out, int* step) {
  const float s = tensor_scale<Format>(scale, own);
  if (blockIdx.x == 0 && threadIdx.x == 0) *scale_out = s;
  float amax = 0.0f;
  for (index_t i = index_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += index_t(gridDim.x) * blockDim.x) {
    const float v = static_cast<float>(x[i]);
    amax = finite_amax(amax, v);
    codes[i] = tensor_code<Format>(v, s);
  }
  add_step_amax(amax, step);
}

/// x (rows, cols) -> codes of x^T (cols, rows): 32 x 32 tiles through shared memory, blocks of 32 x 8
/// threads, both the read and the write along rows.
template <__nv_fp8_interpretation_t Format, class In>
__global__ void quantize_tensor_transposed_kernel(const In* __restrict__ x, index_t rows, index_t cols, float scale,
                                                  const unsigned* own, unsigned char* __restrict__ codes, float* scale_out,
                                                  int* step) {
  __shared__ float tile[32][33];
  const float s = tensor_scale<Format>(scale, own);
  if (blockIdx.x == 0 && blockIdx.y == 0 && threadIdx.x == 0 && threadIdx.y == 0) *scale_out = s;
  const index_t r0 = index_t(blockIdx.y) * 32, c0 = index_t(blockIdx.x) * 32;
  float amax = 0.0f;
  for (int j = int(threadIdx.y); j < 32; j += int(blockDim.y)) {
    const index_t r = r0 + j, c = c0 + threadIdx.x;
    const float v = r < rows && c < cols ? static_cast<float>(x[r * cols + c]) : 0.0f;
    tile[j][threadIdx.x] = v;
    amax = finite_amax(amax, v);
  }
  __syncthreads();
  for (int j = int(threadIdx.y); j < 32; j += int(blockDim.y)) {
    const index_t c = c0 + j, r = r0 + threadIdx.x;  // row c of x^T, column r
    if (c < cols && r < rows) codes[c * rows + r] = tensor_code<Format>(tile[threadIdx.x][j], s);
  }
  add_step_amax(amax, step);
}

/// slots[0, n) = -1.0f's bits: no amax yet this step (CudaFp8<fp8::PerTensorDelayed>'s step slots).
template <class Int = int>
__global__ void reset_step_amax_kernel(Int* slots, index_t n) {
  for (index_t i = index_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += index_t(gridDim.x) * blockDim.x)
    slots[i] = __float_as_int(-1.0f);
}
inline void reset_step_amax(Context& ctx, int* slots, index_t n) {
  if (n <= 0) return;
  reset_step_amax_kernel<<<grid_for(n, 256, ctx), 256, 0, ctx.stream()>>>(slots, n);
  CUPIPE_CHECK_LAUNCH();
}

/// The operands of an empty GEMM (m or n of 0) were used with amax 0 (the host records that too).
template <class Int = int>
__global__ void mark_used_kernel(Int* a, Int* b) {
  if (a) atomicMax(a, __float_as_int(0.0f));
  if (b) atomicMax(b, __float_as_int(0.0f));
}
inline void mark_used(Context& ctx, int* a, int* b) {
  mark_used_kernel<<<1, 1, 0, ctx.stream()>>>(a, b);
  CUPIPE_CHECK_LAUNCH();
}

/// Launches quantize_tensor_kernel (`transposed` false) or quantize_tensor_transposed_kernel: x
/// (rows, cols) in Format at one scale; `own` null to use `scale`.
template <__nv_fp8_interpretation_t Format, class In>
void quantize_tensor(Context& ctx, const In* x, index_t rows, index_t cols, bool transposed, float scale, const unsigned* own,
                     unsigned char* codes, float* scale_out, int* step) {
  if (rows == 0 || cols == 0) return;
  if (!transposed) {
    constexpr int threads = 256;
    quantize_tensor_kernel<Format><<<grid_for(rows * cols, threads, ctx), threads, 0, ctx.stream()>>>(x, rows * cols, scale, own,
                                                                                                      codes, scale_out, step);
  } else {
    const dim3 grid(unsigned((cols + 31) / 32), unsigned((rows + 31) / 32));
    CUPIPE_REQUIRE(grid.y <= unsigned(max_grid_yz), "fp8 quantize: ", rows, " rows is more than one launch takes");
    quantize_tensor_transposed_kernel<Format><<<grid, dim3(32, 8), 0, ctx.stream()>>>(x, rows, cols, scale, own, codes,
                                                                                       scale_out, step);
  }
  CUPIPE_CHECK_LAUNCH();
}

}  // namespace cupipe::backend::cuda::kernels
