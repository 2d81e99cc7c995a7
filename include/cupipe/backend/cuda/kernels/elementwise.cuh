// SPDX-License-Identifier: Apache-2.0
// Elementwise kernels. One generic transform walks any number of same-length arrays in 128-bit packs
// (a scalar tail covers lengths not divisible by the pack width, and unaligned views take the scalar
// path throughout); the functors below say what each op does to one element. Read-only operands are
// passed as const pointers and never stored back.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include "cupipe/backend/cuda/check.cuh"
#include "cupipe/backend/cuda/context.cuh"
#include "cupipe/backend/cuda/kernels/common.cuh"
#include "cupipe/backend/op_types.hpp"

namespace cupipe::backend::cuda::kernels {

template <int N, class F, class... P>
__global__ void transform_kernel(index_t n, F f, P*... ptrs) {
  const index_t stride = index_t(gridDim.x) * blockDim.x;
  const index_t first = index_t(blockIdx.x) * blockDim.x + threadIdx.x;
  const index_t vectors = N > 1 ? n / N : 0;
  for (index_t v = first; v < vectors; v += stride) {
    const index_t base = v * N;
    [&](auto... packs) {
#pragma unroll
      for (int j = 0; j < N; ++j) f(packs.v[j]...);
      (store_pack<N>(ptrs + base, packs), ...);
    }(load_pack<N>(ptrs + base)...);
  }
  for (index_t i = vectors * N + first; i < n; i += stride) f(ptrs[i]...);
}

/// Applies `f` to element i of every array, for i in [0, n), on the context's stream.
template <class F, class... P>
void transform(Context& ctx, index_t n, F f, P*... ptrs) {
  if (n <= 0) return;
  constexpr int width = pack_width<P...>;
  constexpr int threads = 256;
  if (packs_aligned(width, ptrs...) && n >= width)
    transform_kernel<width><<<grid_for(n / width, threads, ctx), threads, 0, ctx.stream()>>>(n, f, ptrs...);
  else
    transform_kernel<1><<<grid_for(n, threads, ctx), threads, 0, ctx.stream()>>>(n, f, ptrs...);
  CUPIPE_CHECK_LAUNCH();
}

// --- functors: one element each --------------------------------------------------------------------

template <class T>
struct FillOp {
  T value;
  __device__ void operator()(T& y) const { y = value; }
};

/// y = beta * y, with beta == 0 writing zeros (BLAS semantics: c is not read, so NaN does not survive).
template <class T>
struct ScaleOp {
  acc_t<T> beta;
  __device__ void operator()(T& y) const { y = beta == acc_t<T>(0) ? from_acc<T>(0) : from_acc<T>(beta * to_acc(y)); }
};

template <class From, class To>
struct ConvertOp {
  __device__ void operator()(const From& x, To& y) const {
    if constexpr (std::is_same_v<To, __nv_bfloat16>) y = __float2bfloat16_rn(float(to_acc(x)));
    else y = To(to_acc(x));
  }
};

/// NaN propagates, as in torch.relu and the host op: `x <= 0` is false for NaN, so y = x.
template <class T>
struct ReluForwardOp {
  __device__ void operator()(const T& x, T& y) const { y = x <= T(0) ? T(0) : x; }
};

template <class T>
struct ReluBackwardOp {
  __device__ void operator()(const T& x, const T& dy, T& dx) const { dx = x > T(0) ? dy : T(0); }
};

/// tanh-form GELU with the host's constants (ops::gelu_k, ops::gelu_c in op_types.hpp).
template <class T>
struct GeluForwardOp {
  __device__ void operator()(const T& x, T& y) const {
    using A = acc_t<T>;
    const A v = to_acc(x);
    const A inner = A(ops::gelu_k) * (v + A(ops::gelu_c) * v * v * v);
    y = from_acc<T>(A(0.5) * v * (A(1) + dev_tanh(inner)));
  }
};

template <class T>
struct GeluBackwardOp {
  __device__ void operator()(const T& x, const T& dy, T& dx) const {
    using A = acc_t<T>;
    const A v = to_acc(x);
    const A inner = A(ops::gelu_k) * (v + A(ops::gelu_c) * v * v * v);
    const A t = dev_tanh(inner);
    const A dinner = A(ops::gelu_k) * (A(1) + A(3 * ops::gelu_c) * v * v);
    dx = from_acc<T>(to_acc(dy) * (A(0.5) * (A(1) + t) + A(0.5) * v * (A(1) - t * t) * dinner));
  }
};

/// y = x rounded to bfloat16 (nearest even) and back: a bf16 hand-over of float values.
template <class T>
struct RoundBf16Op {
  __device__ void operator()(const T& x, T& y) const { y = from_acc<T>(__bfloat162float(__float2bfloat16_rn(float(to_acc(x))))); }
};

/// An e4m3 hand-over's scale for a tensor of largest magnitude `amax`: 448 / amax, or 1 where that
/// would not be finite (the host's ops::detail::wire_scale, the same float operations).
__device__ __forceinline__ float wire_scale(float amax) { return amax > 448.0f / 3.40282347e38f ? 448.0f / amax : 1.0f; }

/// y = e4m3(x * s) / s with s = 448 / max|x| from `state` (kernels::amax): an FP8 E4M3 hand-over,
/// rounded to nearest even and saturating as the host's float8_e4m3. A tensor of zeros, or with a
/// non-finite value, passes unchanged.
template <class T>
struct E4m3RoundTripOp {
  const unsigned* state;
  __device__ void operator()(const T& x, T& y) const {
    const float amax = __uint_as_float(state[0]);
    if (state[1] != 0 || amax == 0.0f) {
      y = x;
      return;
    }
    const float scale = wire_scale(amax);
    const float q = float(__nv_fp8_e4m3(float(to_acc(x)) * scale));
    y = from_acc<T>(q / scale);
  }
};

/// A bf16 link's packed value (core/wire.hpp): x rounded to bfloat16, the bits RoundBf16Op keeps.
template <class T>
struct PackBf16Op {
  __device__ void operator()(const T& x, __nv_bfloat16& b) const { b = __float2bfloat16_rn(float(to_acc(x))); }
};
template <class T>
struct UnpackBf16Op {
  __device__ void operator()(const __nv_bfloat16& b, T& y) const { y = from_acc<T>(__bfloat162float(b)); }
};

/// An e4m3 link's code for x (core/wire.hpp): E4m3RoundTripOp's code, with `state` from
/// kernels::amax. Zeros keep their signed codes (scale 1); a tensor with a non-finite value sends
/// zero codes, and its header (kernels::wire_header) says NaN.
template <class T>
struct E4m3PackOp {
  const unsigned* state;
  __device__ void operator()(const T& x, unsigned char& code) const {
    if (state[1] != 0) {
      code = 0;
      return;
    }
    const float scale = wire_scale(__uint_as_float(state[0]));
    code = __nv_fp8_e4m3(float(to_acc(x)) * scale).__x;
  }
};
/// y = the code over the scale from the message's header: E4m3RoundTripOp's value; NaN where the
/// header is.
template <class T>
struct E4m3UnpackOp {
  const double* header;
  __device__ void operator()(const unsigned char& code, T& y) const {
    const double h = *header;
    if (isnan(h)) {
      y = from_acc<T>(acc_t<T>(__int_as_float(0x7fc00000)));
      return;
    }
    const float scale = wire_scale(float(h));
    __nv_fp8_e4m3 q;
    q.__x = code;
    y = from_acc<T>(float(q) / scale);
  }
};

template <class T>
struct AddOp {
  __device__ void operator()(const T& a, const T& b, T& y) const { y = from_acc<T>(to_acc(a) + to_acc(b)); }
};

/// y += alpha x in y's arithmetic; x may be narrower (a bf16 gradient into a float accumulator).
template <class X, class Y = X>
struct AxpyOp {
  acc_t<Y> alpha;
  __device__ void operator()(const X& x, Y& y) const { y = from_acc<Y>(to_acc(y) + alpha * acc_t<Y>(to_acc(x))); }
};

// --- bias add: a row-broadcast, so it has its own kernel ------------------------------------------

/// y (rows, cols) += bias (cols). With N > 1, cols is a multiple of N, so a pack never crosses a row.
template <int N, class T>
__global__ void bias_add_kernel(T* y, const T* bias, index_t n, index_t cols) {
  const index_t stride = index_t(gridDim.x) * blockDim.x;
  for (index_t v = index_t(blockIdx.x) * blockDim.x + threadIdx.x; v < n / N; v += stride) {
    const index_t base = v * N;
    Pack<T, N> out = load_pack<N>(y + base);
    const Pack<T, N> b = load_pack<N>(bias + base % cols);
#pragma unroll
    for (int j = 0; j < N; ++j) out.v[j] = from_acc<T>(to_acc(out.v[j]) + to_acc(b.v[j]));
    store_pack<N>(y + base, out);
  }
}

template <class T>
void bias_add(Context& ctx, T* y, const T* bias, index_t rows, index_t cols) {
  const index_t n = rows * cols;
  if (n == 0) return;
  constexpr int width = pack_width<T>;
  constexpr int threads = 256;
  if (cols % width == 0 && packs_aligned(width, y, bias))
    bias_add_kernel<width><<<grid_for(n / width, threads, ctx), threads, 0, ctx.stream()>>>(y, bias, n, cols);
  else
    bias_add_kernel<1><<<grid_for(n, threads, ctx), threads, 0, ctx.stream()>>>(y, bias, n, cols);
  CUPIPE_CHECK_LAUNCH();
}

}  // namespace cupipe::backend::cuda::kernels
