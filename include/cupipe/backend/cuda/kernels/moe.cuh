// SPDX-License-Identifier: Apache-2.0
// A mixture of experts' token movement on the GPU: each token's kept choices to their expert-sorted
// rows and back. The host references and the slot convention are in backend/host/ops_moe.hpp:
// slots (n, k) name a row of the S expert-sorted rows, or -1 for a dropped choice.
//
// Every kernel is a gather or a scatter of whole rows with no atomics, so each output element is
// written by one thread, in the host's order of choices:
// - moe_permute: one thread per 16-byte pack of a kept choice's row (xs[slot] = x[t]).
// - moe_unpermute: one thread per pack of a token's output row, summing its k choices in order.
// - moe_unpermute_backward: one warp per choice: d_o[slot] = gate dy_t, and dgate = dy_t . o[slot]
//   by a fixed warp reduction (lane-strided partial sums, then the shuffle tree).
// - moe_permute_backward: one thread per pack of a token's row, adding its k choices' rows in order.
// Megatron's and llm.c's MoE permutations are built the same way; TransformerEngine fuses the
// permutation with the router's sort, which cupipe's host dispatch does instead (moe/routing.hpp).
//
// Roofline (H200, 4.8 TB/s of HBM3e; GPT-2 124M's width C = 768, 8 sequences of 1,024 tokens,
// n = 8192, top-2, bf16; docs/gpu_notes.md lists them for the next lease):
//   moe_permute             reads n k C x 2 B (each token once per choice), writes as much: 50 MB, ~12 us
//   moe_unpermute           reads n k C x 2 B, writes n C x 2 B: 38 MB, ~9 us
//   moe_unpermute_backward  reads dy twice and o once, writes d_o: 88 MB, ~21 us (~18 us when dy's rows hit L2)
//   moe_permute_backward    reads n k C and n C, writes n C (x 2 B): 50 MB, ~12 us
// against ~220 us for the experts' four GEMMs of the forward alone (155 GFLOP at ~700 TFLOP/s), so
// the movement is a few per cent of an MoE layer's time when the kernels reach the bandwidth.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "cupipe/backend/cuda/check.cuh"
#include "cupipe/backend/cuda/context.cuh"
#include "cupipe/backend/cuda/kernels/common.cuh"

namespace cupipe::backend::cuda::kernels {

/// acc + a b, rounded twice as the host reference rounds it (no fused multiply-add), so that
/// moe_unpermute gives the host's bits in float and double.
__device__ __forceinline__ float add_product(float acc, float a, float b) { return __fadd_rn(acc, __fmul_rn(a, b)); }
__device__ __forceinline__ double add_product(double acc, double a, double b) { return __dadd_rn(acc, __dmul_rn(a, b)); }

/// The slot of choice i, or -2 (after reporting it) when it is outside [-1, rows).
__device__ __forceinline__ std::int32_t moe_slot(const std::int32_t* slots, index_t i, index_t rows, bool report,
                                                 DeviceError* error) {
  const std::int32_t at = slots[i];
  if (at < -1 || index_t(at) >= rows) {
    if (report) record_error(error, moe_slot_out_of_range, i, at);
    return -2;
  }
  return at;
}

// xs[slot_tj] = x_t: a pack of N elements per thread.
template <int N, class T>
__global__ void moe_permute_kernel(const T* x, const std::int32_t* slots, T* xs, index_t n, index_t k, index_t cols,
                                   index_t rows, DeviceError* error) {
  const index_t packs = cols / N;
  const index_t stride = index_t(gridDim.x) * blockDim.x;
  for (index_t i = index_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n * k * packs; i += stride) {
    const index_t choice = i / packs, c = (i - choice * packs) * N;
    const std::int32_t at = moe_slot(slots, choice, rows, c == 0, error);
    if (at < 0) continue;
    store_pack<N>(xs + index_t(at) * cols + c, load_pack<N>(x + (choice / k) * cols + c));
  }
}

template <class T>
void moe_permute(Context& ctx, const T* x, const std::int32_t* slots, T* xs, index_t n, index_t k, index_t cols,
                 index_t rows) {
  if (n == 0 || k == 0 || cols == 0) return;
  constexpr int width = pack_width<T>;
  constexpr int threads = 256;
  if (cols % width == 0 && packs_aligned(width, x, xs))
    moe_permute_kernel<width><<<grid_for(n * k * cols / width, threads, ctx), threads, 0, ctx.stream()>>>(
        x, slots, xs, n, k, cols, rows, ctx.device_error());
  else
    moe_permute_kernel<1><<<grid_for(n * k * cols, threads, ctx), threads, 0, ctx.stream()>>>(x, slots, xs, n, k, cols, rows,
                                                                                              ctx.device_error());
  CUPIPE_CHECK_LAUNCH();
}

// y_t = sum_j gate_tj o[slot_tj], choices in order, in the compute type; a bad slot gives NaN.
template <int N, class T>
__global__ void moe_unpermute_kernel(const T* o, const std::int32_t* slots, const T* gates, T* y, index_t n, index_t k,
                                     index_t cols, index_t rows, DeviceError* error) {
  const index_t packs = cols / N;
  const index_t stride = index_t(gridDim.x) * blockDim.x;
  for (index_t i = index_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n * packs; i += stride) {
    const index_t t = i / packs, c = (i - t * packs) * N;
    acc_t<T> acc[N];
#pragma unroll
    for (int e = 0; e < N; ++e) acc[e] = 0;
    for (index_t j = 0; j < k; ++j) {
      const std::int32_t at = moe_slot(slots, t * k + j, rows, c == 0, error);
      if (at == -1) continue;
      if (at < 0) {
#pragma unroll
        for (int e = 0; e < N; ++e) acc[e] = acc_t<T>(NAN);
        continue;
      }
      const acc_t<T> g = to_acc(gates[t * k + j]);
      const Pack<T, N> in = load_pack<N>(o + index_t(at) * cols + c);
#pragma unroll
      for (int e = 0; e < N; ++e) acc[e] = add_product(acc[e], g, to_acc(in.v[e]));
    }
    Pack<T, N> out;
#pragma unroll
    for (int e = 0; e < N; ++e) out.v[e] = from_acc<T>(acc[e]);
    store_pack<N>(y + t * cols + c, out);
  }
}

template <class T>
void moe_unpermute(Context& ctx, const T* o, const std::int32_t* slots, const T* gates, T* y, index_t n, index_t k,
                   index_t cols, index_t rows) {
  if (n == 0 || cols == 0) return;
  constexpr int width = pack_width<T>;
  constexpr int threads = 256;
  if (cols % width == 0 && packs_aligned(width, o, y))
    moe_unpermute_kernel<width><<<grid_for(n * cols / width, threads, ctx), threads, 0, ctx.stream()>>>(
        o, slots, gates, y, n, k, cols, rows, ctx.device_error());
  else
    moe_unpermute_kernel<1><<<grid_for(n * cols, threads, ctx), threads, 0, ctx.stream()>>>(o, slots, gates, y, n, k, cols,
                                                                                            rows, ctx.device_error());
  CUPIPE_CHECK_LAUNCH();
}

// One warp per choice: d_o[slot] = gate dy_t; dgate = dy_t . o[slot] (0 for a dropped choice, NaN
// for a bad slot).
template <class T>
__global__ void moe_unpermute_backward_kernel(const T* dy, const T* o, const std::int32_t* slots, const T* gates, T* d_o,
                                              T* dgates, index_t n, index_t k, index_t cols, index_t rows,
                                              DeviceError* error) {
  const int lane = int(threadIdx.x) % 32;
  const index_t warps = index_t(gridDim.x) * (blockDim.x / 32);
  for (index_t choice = index_t(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32; choice < n * k; choice += warps) {
    const std::int32_t at = moe_slot(slots, choice, rows, lane == 0, error);
    if (at < 0) {
      if (lane == 0) dgates[choice] = from_acc<T>(at == -1 ? acc_t<T>(0) : acc_t<T>(NAN));
      continue;
    }
    const T* dyt = dy + (choice / k) * cols;
    const T* ot = o + index_t(at) * cols;
    T* d_ot = d_o + index_t(at) * cols;
    const acc_t<T> g = to_acc(gates[choice]);
    acc_t<T> partial = 0;
    for (index_t c = lane; c < cols; c += 32) {
      const acc_t<T> d = to_acc(dyt[c]);
      partial = add_product(partial, d, to_acc(ot[c]));
      d_ot[c] = from_acc<T>(g * d);
    }
    const acc_t<T> dot = warp_sum(partial);
    if (lane == 0) dgates[choice] = from_acc<T>(dot);
  }
}

template <class T>
void moe_unpermute_backward(Context& ctx, const T* dy, const T* o, const std::int32_t* slots, const T* gates, T* d_o,
                            T* dgates, index_t n, index_t k, index_t cols, index_t rows) {
  if (n == 0 || k == 0) return;
  constexpr int threads = 256;  // 8 warps, a choice each
  moe_unpermute_backward_kernel<<<grid_for(n * k * 32, threads, ctx), threads, 0, ctx.stream()>>>(
      dy, o, slots, gates, d_o, dgates, n, k, cols, rows, ctx.device_error());
  CUPIPE_CHECK_LAUNCH();
}

// dx_t += sum_j dxs[slot_tj], choices in order, in the compute type.
template <int N, class T>
__global__ void moe_permute_backward_kernel(const T* dxs, const std::int32_t* slots, T* dx, index_t n, index_t k,
                                            index_t cols, index_t rows, DeviceError* error) {
  const index_t packs = cols / N;
  const index_t stride = index_t(gridDim.x) * blockDim.x;
  for (index_t i = index_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n * packs; i += stride) {
    const index_t t = i / packs, c = (i - t * packs) * N;
    const Pack<T, N> old = load_pack<N>(dx + t * cols + c);
    acc_t<T> acc[N];
#pragma unroll
    for (int e = 0; e < N; ++e) acc[e] = to_acc(old.v[e]);
    for (index_t j = 0; j < k; ++j) {
      const std::int32_t at = moe_slot(slots, t * k + j, rows, c == 0, error);
      if (at < 0) continue;
      const Pack<T, N> in = load_pack<N>(dxs + index_t(at) * cols + c);
#pragma unroll
      for (int e = 0; e < N; ++e) acc[e] += to_acc(in.v[e]);
    }
    Pack<T, N> out;
#pragma unroll
    for (int e = 0; e < N; ++e) out.v[e] = from_acc<T>(acc[e]);
    store_pack<N>(dx + t * cols + c, out);
  }
}

template <class T>
void moe_permute_backward(Context& ctx, const T* dxs, const std::int32_t* slots, T* dx, index_t n, index_t k, index_t cols,
                          index_t rows) {
  if (n == 0 || k == 0 || cols == 0) return;
  constexpr int width = pack_width<T>;
  constexpr int threads = 256;
  if (cols % width == 0 && packs_aligned(width, dxs, dx))
    moe_permute_backward_kernel<width><<<grid_for(n * cols / width, threads, ctx), threads, 0, ctx.stream()>>>(
        dxs, slots, dx, n, k, cols, rows, ctx.device_error());
  else
    moe_permute_backward_kernel<1><<<grid_for(n * cols, threads, ctx), threads, 0, ctx.stream()>>>(
        dxs, slots, dx, n, k, cols, rows, ctx.device_error());
  CUPIPE_CHECK_LAUNCH();
}

}  // namespace cupipe::backend::cuda::kernels
