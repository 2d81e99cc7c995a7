// SPDX-License-Identifier: Apache-2.0
// Shared pieces of the hand-written kernels: device element types, 128-bit packs, accurate math in
// the accumulation type, deterministic warp and block reductions, launch sizing and the device
// error record. Every kernel in kernels/ is a template, so these headers stay ODR-safe.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "cupipe/backend/cuda/context.cuh"
#include "cupipe/core/dtype.hpp"
#include "cupipe/core/shape.hpp"

namespace cupipe::backend::cuda::kernels {

// --- element types -------------------------------------------------------------------------------

static_assert(sizeof(bfloat16) == sizeof(__nv_bfloat16), "cupipe::bfloat16 must have the layout of __nv_bfloat16");

/// The device type for a host element type: cupipe::bfloat16 becomes __nv_bfloat16 (same bits).
template <class T> struct device_type { using type = T; };
template <> struct device_type<bfloat16> { using type = __nv_bfloat16; };
template <> struct device_type<const bfloat16> { using type = const __nv_bfloat16; };
template <class T> using device_t = typename device_type<T>::type;

template <class T>
device_t<T>* device_ptr(T* ptr) noexcept {
  return reinterpret_cast<device_t<T>*>(ptr);
}

/// Arithmetic happens in float for float and bf16, in double for double.
template <class T> using acc_t = std::conditional_t<std::is_same_v<std::remove_const_t<T>, double>, double, float>;

template <class T>
__device__ __forceinline__ acc_t<T> to_acc(T v) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) return __bfloat162float(v);
  else return acc_t<T>(v);
}
template <class T>
__device__ __forceinline__ T from_acc(acc_t<T> v) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) return __float2bfloat16_rn(v);
  else return T(v);
}

// Accurate (not the fast intrinsic) math in float or double, matching the host reference closely.
__device__ __forceinline__ float dev_exp(float x) { return expf(x); }
__device__ __forceinline__ double dev_exp(double x) { return exp(x); }
__device__ __forceinline__ float dev_log(float x) { return logf(x); }
__device__ __forceinline__ double dev_log(double x) { return log(x); }
__device__ __forceinline__ float dev_tanh(float x) { return tanhf(x); }
__device__ __forceinline__ double dev_tanh(double x) { return tanh(x); }
__device__ __forceinline__ float dev_sqrt(float x) { return sqrtf(x); }
__device__ __forceinline__ double dev_sqrt(double x) { return sqrt(x); }

// --- 128-bit packs -------------------------------------------------------------------------------

/// N elements moved as one load or store (16 bytes for the widest element of a kernel).
template <class T, int N>
struct alignas(sizeof(T) * N) Pack {
  T v[N];
};

template <int N, class T>
__device__ __forceinline__ Pack<std::remove_const_t<T>, N> load_pack(T* ptr) {
  return *reinterpret_cast<const Pack<std::remove_const_t<T>, N>*>(ptr);
}
template <int N, class T>
__device__ __forceinline__ void store_pack(T* ptr, const Pack<T, N>& pack) {
  *reinterpret_cast<Pack<T, N>*>(ptr) = pack;
}
/// Read-only operands are never written back.
template <int N, class T>
__device__ __forceinline__ void store_pack(const T*, const Pack<T, N>&) {}

/// Elements per 16-byte access for the widest of the given types.
template <class... T>
inline constexpr int pack_width = int(16 / std::max({sizeof(T)...}));

/// True when every pointer allows `width`-element packs of its own type.
template <class... P>
bool packs_aligned(int width, P*... ptrs) noexcept {
  return ((reinterpret_cast<std::uintptr_t>(ptrs) % (std::uintptr_t(width) * sizeof(P)) == 0) && ...);
}

// --- reductions (fixed order, so results repeat bit for bit) -------------------------------------

template <class T>
__device__ __forceinline__ T warp_sum(T v) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}

/// Sum over a block of any multiple of 32 threads; every thread gets the total. `shared` holds 32.
template <class T>
__device__ __forceinline__ T block_sum(T v, T* shared) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = blockDim.x / 32;
  v = warp_sum(v);
  __syncthreads();  // `shared` may still be read from a previous call
  if (lane == 0) shared[warp] = v;
  __syncthreads();
  v = lane < warps ? shared[lane] : T(0);
  return warp_sum(v);
}

/// The largest gridDim.y or gridDim.z a launch takes; kernels that put a count there refuse more first.
inline constexpr index_t max_grid_yz = 65535;

/// A running softmax normaliser: max m and sum of exp(z - m).
template <class A>
struct MaxSum {
  A max;
  A sum;
};

/// Empty partials (max -inf, sum 0: no logit, or only masked ones) drop out. A partial whose logits
/// were NaN (and -inf) has max -inf but sum NaN: it is not empty, and its NaN reaches the result, as
/// the host's sum does (NaN * exp(-inf) = NaN).
template <class A>
__device__ __forceinline__ MaxSum<A> combine(MaxSum<A> a, MaxSum<A> b) {
  if (a.max == -INFINITY && a.sum == A(0)) return b;
  if (b.max == -INFINITY && b.sum == A(0)) return a;
  const A m = a.max > b.max ? a.max : b.max;
  return {m, a.sum * dev_exp(a.max - m) + b.sum * dev_exp(b.max - m)};
}

template <class A>
__device__ __forceinline__ MaxSum<A> block_max_sum(MaxSum<A> v, MaxSum<A>* shared) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = blockDim.x / 32;
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1)
    v = combine(v, MaxSum<A>{__shfl_xor_sync(0xffffffffu, v.max, offset), __shfl_xor_sync(0xffffffffu, v.sum, offset)});
  __syncthreads();
  if (lane == 0) shared[warp] = v;
  __syncthreads();
  v = lane < warps ? shared[lane] : MaxSum<A>{A(-INFINITY), A(0)};
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1)
    v = combine(v, MaxSum<A>{__shfl_xor_sync(0xffffffffu, v.max, offset), __shfl_xor_sync(0xffffffffu, v.sum, offset)});
  return v;
}

// --- bad input ------------------------------------------------------------------------------------

/// Records the first bad input a launch meets; the host reads it with Context::take_device_error.
__device__ __forceinline__ void record_error(DeviceError* error, std::int32_t code, index_t row, long long value) {
  if (atomicCAS(&error->code, 0, code) == 0) {
    error->row = std::int32_t(row);
    error->value = value;
  }
}

// --- launch sizing --------------------------------------------------------------------------------

/// Blocks for `items` work items at `threads` per block, capped at a few waves (loops stride the grid).
inline unsigned grid_for(index_t items, int threads, const Context& ctx, int blocks_per_sm = 16) {
  const index_t blocks = (items + threads - 1) / threads;
  return unsigned(std::clamp<index_t>(blocks, 1, index_t(ctx.sm_count()) * blocks_per_sm));
}

}  // namespace cupipe::backend::cuda::kernels
