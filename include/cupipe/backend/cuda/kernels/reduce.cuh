// SPDX-License-Identifier: Apache-2.0
// Deterministic reductions: column sums (bias and LayerNorm weight gradients) and the sum of squares.
// Each is two phases with a fixed split that depends only on the shape (never on the device or on
// timing), and without atomics, so a result repeats bit for bit.
#pragma once

#include <cub/block/block_reduce.cuh>
#include <cuda_runtime.h>

#include <cstddef>

#include "cupipe/backend/cuda/check.cuh"
#include "cupipe/backend/cuda/context.cuh"
#include "cupipe/backend/cuda/kernels/common.cuh"

namespace cupipe::backend::cuda::kernels {

// --- column sums -----------------------------------------------------------------------------------

/// Rows per partial sum: fixed, so that the summation order is a function of the shape only.
inline constexpr index_t column_chunk_rows = 256;
inline constexpr int column_tile = 32;     // columns per block (one per lane)
inline constexpr int column_row_lanes = 8;  // rows a block walks at once

/// partial[(chunk * K + k) * cols + c] = sum over the chunk's rows r of the k-th value f(r, c, sums).
template <int K, class A, class F>
__global__ void column_partials_kernel(index_t rows, index_t cols, F f, A* partial) {
  __shared__ A shared[K][column_row_lanes][column_tile + 1];
  const index_t c = index_t(blockIdx.x) * column_tile + threadIdx.x;
  const index_t r0 = index_t(blockIdx.y) * column_chunk_rows;
  const index_t r1 = r0 + column_chunk_rows < rows ? r0 + column_chunk_rows : rows;
  A sums[K];
#pragma unroll
  for (int k = 0; k < K; ++k) sums[k] = A(0);
  if (c < cols)
    for (index_t r = r0 + threadIdx.y; r < r1; r += column_row_lanes) f(r, c, sums);
#pragma unroll
  for (int k = 0; k < K; ++k) shared[k][threadIdx.y][threadIdx.x] = sums[k];
  __syncthreads();
  if (threadIdx.y == 0 && c < cols) {
#pragma unroll
    for (int k = 0; k < K; ++k) {
      A total = A(0);
      for (int y = 0; y < column_row_lanes; ++y) total += shared[k][y][threadIdx.x];
      partial[(index_t(blockIdx.y) * K + k) * cols + c] = total;
    }
  }
}

/// out_k[c] += sum over chunks of the partials, in chunk order.
template <int K, class A, class T>
__global__ void column_finish_kernel(index_t chunks, index_t cols, const A* partial, T* out0, T* out1) {
  const index_t c = index_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (c >= cols) return;
#pragma unroll
  for (int k = 0; k < K; ++k) {
    A total = A(0);
    for (index_t chunk = 0; chunk < chunks; ++chunk) total += partial[(chunk * K + k) * cols + c];
    T* out = k == 0 ? out0 : out1;
    out[c] = from_acc<T>(to_acc(out[c]) + total);
  }
}

/// out_k (cols) += column sums over `rows` of K values per element, f(r, c, A (&sums)[K]) adding them.
template <int K, class T, class F>
void column_sums(Context& ctx, index_t rows, index_t cols, F f, T* out0, T* out1 = nullptr) {
  using A = acc_t<T>;
  if (rows == 0 || cols == 0) return;
  const index_t chunks = (rows + column_chunk_rows - 1) / column_chunk_rows;
  // Refused before the scratch is sized for it: a too-large input must not grow the scratch first.
  CUPIPE_REQUIRE(chunks <= max_grid_yz, "column sums: ", rows, " rows is more than this kernel's grid allows (at most ",
                 max_grid_yz * column_chunk_rows, ")");
  auto* partial = static_cast<A*>(ctx.scratch(std::size_t(chunks * K * cols) * sizeof(A)));
  const dim3 block(column_tile, column_row_lanes);
  const dim3 grid(unsigned((cols + column_tile - 1) / column_tile), unsigned(chunks));
  column_partials_kernel<K><<<grid, block, 0, ctx.stream()>>>(rows, cols, f, partial);
  CUPIPE_CHECK_LAUNCH();
  column_finish_kernel<K><<<unsigned((cols + 255) / 256), 256, 0, ctx.stream()>>>(chunks, cols, partial, out0, out1);
  CUPIPE_CHECK_LAUNCH();
}

/// dy (rows, cols) -> column sums.
template <class T>
struct ColumnValue {
  const T* dy;
  index_t cols;
  __device__ void operator()(index_t r, index_t c, acc_t<T> (&sums)[1]) const { sums[0] += to_acc(dy[r * cols + c]); }
};

// --- sum of squares --------------------------------------------------------------------------------

inline constexpr int squares_threads = 256;
inline constexpr index_t squares_max_blocks = 1024;

template <class T>
__global__ void __launch_bounds__(squares_threads) sum_of_squares_partial_kernel(const T* x, index_t n, double* partial) {
  using Reduce = cub::BlockReduce<double, squares_threads>;
  __shared__ typename Reduce::TempStorage temp;
  double sum = 0;
  const index_t stride = index_t(gridDim.x) * squares_threads;
  for (index_t i = index_t(blockIdx.x) * squares_threads + threadIdx.x; i < n; i += stride) {
    const double v = double(to_acc(x[i]));
    sum += v * v;
  }
  sum = Reduce(temp).Sum(sum);
  if (threadIdx.x == 0) partial[blockIdx.x] = sum;
}

template <class Unused = void>
__global__ void __launch_bounds__(squares_threads) sum_partials_kernel(const double* partial, index_t count, double* out) {
  using Reduce = cub::BlockReduce<double, squares_threads>;
  __shared__ typename Reduce::TempStorage temp;
  double sum = 0;
  for (index_t i = threadIdx.x; i < count; i += squares_threads) sum += partial[i];
  sum = Reduce(temp).Sum(sum);
  if (threadIdx.x == 0) *out = sum;
}

/// Enqueues the sum of squares of x (n) into *out (device memory), through `partial`
/// (squares_max_blocks doubles of device memory); blocks depend on n only.
template <class T>
void sum_of_squares(Context& ctx, const T* x, index_t n, double* partial, double* out) {
  const index_t per_block = index_t(squares_threads) * 8;
  const index_t blocks = std::clamp<index_t>((n + per_block - 1) / per_block, 1, squares_max_blocks);
  sum_of_squares_partial_kernel<<<unsigned(blocks), squares_threads, 0, ctx.stream()>>>(x, n, partial);
  CUPIPE_CHECK_LAUNCH();
  sum_partials_kernel<<<1, squares_threads, 0, ctx.stream()>>>(partial, blocks, out);
  CUPIPE_CHECK_LAUNCH();
}

/// state[0] |= max |x| as float bits (atomicMax on the bits: a non-negative float's bits order as its
/// value), state[1] |= 1 where some x is not finite. The caller zeroes state first.
template <class T>
__global__ void __launch_bounds__(256) amax_kernel(const T* x, index_t n, unsigned* state) {
  float local = 0;
  bool bad = false;
  for (index_t i = index_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += index_t(gridDim.x) * blockDim.x) {
    const float v = float(to_acc(x[i]));
    bad = bad || !isfinite(v);
    local = fmaxf(local, fabsf(v));  // fmaxf drops a NaN; `bad` has it
  }
  for (int offset = 16; offset > 0; offset >>= 1) local = fmaxf(local, __shfl_xor_sync(0xffffffffu, local, offset));
  bad = __any_sync(0xffffffffu, bad);
  if ((threadIdx.x & 31) == 0) {
    if (local > 0) atomicMax(state, __float_as_uint(local));
    if (bad) atomicOr(state + 1, 1u);
  }
}

/// Enqueues x's largest magnitude and whether it holds a non-finite value into state[0..1] (two
/// unsigned of device memory; see amax_kernel).
template <class T>
void amax(Context& ctx, const T* x, index_t n, unsigned* state) {
  CUPIPE_CHECK_CUDA(cudaMemsetAsync(state, 0, 2 * sizeof(unsigned), ctx.stream()));
  if (n <= 0) return;
  constexpr int threads = 256;
  amax_kernel<<<grid_for(n, threads, ctx), threads, 0, ctx.stream()>>>(x, n, state);
  CUPIPE_CHECK_LAUNCH();
}

/// An e4m3 message's header (core/wire.hpp) from amax's state: the largest magnitude as a double,
/// NaN where a value was not finite. A template, as every kernel here (one definition per program).
template <class Header = double>
__global__ void wire_header_kernel(const unsigned* state, Header* header) {
  *header = state[1] != 0 ? __longlong_as_double(0x7ff8000000000000LL) : double(__uint_as_float(state[0]));
}

inline void wire_header(Context& ctx, const unsigned* state, double* header) {
  wire_header_kernel<<<1, 1, 0, ctx.stream()>>>(state, header);
  CUPIPE_CHECK_LAUNCH();
}

}  // namespace cupipe::backend::cuda::kernels
