// SPDX-License-Identifier: Apache-2.0
// LayerNorm over the last axis, one warp per row: the row is read in 128-bit packs when its length
// allows (later passes over it hit L1/L2), reduced with warp shuffles, and the centred two-pass
// variance matches the host reference's arithmetic. The weight gradient is a deterministic column
// sum (kernels/reduce.cuh).
#pragma once

#include <cuda_runtime.h>

#include "cupipe/backend/cuda/check.cuh"
#include "cupipe/backend/cuda/context.cuh"
#include "cupipe/backend/cuda/kernels/common.cuh"
#include "cupipe/backend/cuda/kernels/reduce.cuh"

namespace cupipe::backend::cuda::kernels {

inline constexpr int layernorm_rows_per_block = 4;  // warps per block

// x, y (rows, cols); gamma, beta (cols); mean, rstd (rows)
template <int N, class T>
__global__ void __launch_bounds__(32 * layernorm_rows_per_block)
    layernorm_forward_kernel(const T* x, const T* gamma, const T* beta, T* y, acc_t<T>* mean, acc_t<T>* rstd, index_t rows,
                             index_t cols, acc_t<T> eps) {
  using A = acc_t<T>;
  const index_t row = index_t(blockIdx.x) * layernorm_rows_per_block + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (row >= rows) return;
  const T* xr = x + row * cols;
  A sum = 0;
  for (index_t c = index_t(lane) * N; c < cols; c += 32 * N) {
    const auto p = load_pack<N>(xr + c);
#pragma unroll
    for (int j = 0; j < N; ++j) sum += to_acc(p.v[j]);
  }
  const A mu = warp_sum(sum) / A(cols);
  A var = 0;
  for (index_t c = index_t(lane) * N; c < cols; c += 32 * N) {
    const auto p = load_pack<N>(xr + c);
#pragma unroll
    for (int j = 0; j < N; ++j) {
      const A d = to_acc(p.v[j]) - mu;
      var += d * d;
    }
  }
  const A rs = A(1) / dev_sqrt(warp_sum(var) / A(cols) + eps);
  T* yr = y + row * cols;
  for (index_t c = index_t(lane) * N; c < cols; c += 32 * N) {
    const auto p = load_pack<N>(xr + c);
    const auto g = load_pack<N>(gamma + c);
    const auto b = load_pack<N>(beta + c);
    Pack<T, N> out;
#pragma unroll
    for (int j = 0; j < N; ++j) out.v[j] = from_acc<T>((to_acc(p.v[j]) - mu) * rs * to_acc(g.v[j]) + to_acc(b.v[j]));
    store_pack<N>(yr + c, out);
  }
  if (lane == 0) {
    mean[row] = mu;
    rstd[row] = rs;
  }
}

// dx = rstd * (g - mean(g) - xhat * mean(g * xhat)), g = dy * gamma
template <int N, class T>
__global__ void __launch_bounds__(32 * layernorm_rows_per_block)
    layernorm_backward_input_kernel(const T* x, const T* gamma, const acc_t<T>* mean, const acc_t<T>* rstd, const T* dy, T* dx,
                                    index_t rows, index_t cols) {
  using A = acc_t<T>;
  const index_t row = index_t(blockIdx.x) * layernorm_rows_per_block + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (row >= rows) return;
  const T *xr = x + row * cols, *dyr = dy + row * cols;
  const A mu = mean[row], rs = rstd[row];
  A sum_g = 0, sum_gx = 0;
  for (index_t c = index_t(lane) * N; c < cols; c += 32 * N) {
    const auto xp = load_pack<N>(xr + c);
    const auto dp = load_pack<N>(dyr + c);
    const auto gp = load_pack<N>(gamma + c);
#pragma unroll
    for (int j = 0; j < N; ++j) {
      const A g = to_acc(dp.v[j]) * to_acc(gp.v[j]);
      sum_g += g;
      sum_gx += g * ((to_acc(xp.v[j]) - mu) * rs);
    }
  }
  const A mean_g = warp_sum(sum_g) / A(cols), mean_gx = warp_sum(sum_gx) / A(cols);
  T* dxr = dx + row * cols;
  for (index_t c = index_t(lane) * N; c < cols; c += 32 * N) {
    const auto xp = load_pack<N>(xr + c);
    const auto dp = load_pack<N>(dyr + c);
    const auto gp = load_pack<N>(gamma + c);
    Pack<T, N> out;
#pragma unroll
    for (int j = 0; j < N; ++j) {
      const A g = to_acc(dp.v[j]) * to_acc(gp.v[j]);
      const A xhat = (to_acc(xp.v[j]) - mu) * rs;
      out.v[j] = from_acc<T>(rs * (g - mean_g - xhat * mean_gx));
    }
    store_pack<N>(dxr + c, out);
  }
}

template <class T>
void layernorm_forward(Context& ctx, const T* x, const T* gamma, const T* beta, T* y, acc_t<T>* mean, acc_t<T>* rstd, index_t rows,
                       index_t cols, double eps) {
  if (rows == 0) return;
  const unsigned blocks = unsigned((rows + layernorm_rows_per_block - 1) / layernorm_rows_per_block);
  constexpr int threads = 32 * layernorm_rows_per_block;
  constexpr int width = pack_width<T>;
  if (cols % width == 0 && packs_aligned(width, x, gamma, beta, y))
    layernorm_forward_kernel<width><<<blocks, threads, 0, ctx.stream()>>>(x, gamma, beta, y, mean, rstd, rows, cols,
                                                                          acc_t<T>(eps));
  else
    layernorm_forward_kernel<1><<<blocks, threads, 0, ctx.stream()>>>(x, gamma, beta, y, mean, rstd, rows, cols,
                                                                      acc_t<T>(eps));
  CUPIPE_CHECK_LAUNCH();
}

template <class T>
void layernorm_backward_input(Context& ctx, const T* x, const T* gamma, const acc_t<T>* mean, const acc_t<T>* rstd, const T* dy,
                              T* dx, index_t rows, index_t cols) {
  if (rows == 0) return;
  const unsigned blocks = unsigned((rows + layernorm_rows_per_block - 1) / layernorm_rows_per_block);
  constexpr int threads = 32 * layernorm_rows_per_block;
  constexpr int width = pack_width<T>;
  if (cols % width == 0 && packs_aligned(width, x, gamma, dy, dx))
    layernorm_backward_input_kernel<width><<<blocks, threads, 0, ctx.stream()>>>(x, gamma, mean, rstd, dy, dx, rows, cols);
  else
    layernorm_backward_input_kernel<1><<<blocks, threads, 0, ctx.stream()>>>(x, gamma, mean, rstd, dy, dx, rows, cols);
  CUPIPE_CHECK_LAUNCH();
}

/// dgamma += sum over rows of dy * xhat; dbeta += sum over rows of dy.
template <class T>
struct LayerNormWeightValue {
  const T* x;
  const acc_t<T>*mean, *rstd;
  const T* dy;
  index_t cols;
  __device__ void operator()(index_t r, index_t c, acc_t<T> (&sums)[2]) const {
    const acc_t<T> d = to_acc(dy[r * cols + c]);
    sums[0] += d * (to_acc(x[r * cols + c]) - mean[r]) * rstd[r];
    sums[1] += d;
  }
};

/// G: the gradients' type (the accumulation type for bf16 storage).
template <class T, class G>
void layernorm_backward_weight(Context& ctx, const T* x, const acc_t<T>* mean, const acc_t<T>* rstd, const T* dy, G* dgamma,
                               G* dbeta, index_t rows, index_t cols) {
  column_sums<2, G>(ctx, rows, cols, LayerNormWeightValue<T>{x, mean, rstd, dy, cols}, dgamma, dbeta);
}

}  // namespace cupipe::backend::cuda::kernels
