// SPDX-License-Identifier: Apache-2.0
// Fused softmax cross-entropy, one block per row. An online (max, sum) pass gives the row's
// logsumexp without storing probabilities; the forward writes one loss per row and a single block
// sums those in a fixed order (deterministic), the backward writes (softmax - onehot) * scale in a
// second pass over the row. A label outside [0, cols) is reported through the device error record.
// Masked logits (-inf) contribute nothing, wherever they fall in a thread's share of the row; a NaN
// logit makes the row's loss NaN, as on the host.
//
// Vocabulary-parallel (a rank's logits are columns [first, first + cols) of a whole vocabulary of
// `whole` classes): a stats kernel gives each row's (max, sum of exp(z - max), label's logit or 0),
// which the ranks exchange; the backward kernel then takes each row's whole log-sum-exp.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "cupipe/backend/cuda/check.cuh"
#include "cupipe/backend/cuda/context.cuh"
#include "cupipe/backend/cuda/kernels/common.cuh"

namespace cupipe::backend::cuda::kernels {

/// Threads for a row of `cols` logits read `width` at a time: enough to cover it, 32 to 512.
inline int xent_threads(index_t cols, int width) {
  const index_t packs = (cols + width - 1) / width;
  const index_t warps = std::clamp<index_t>((packs + 31) / 32, 1, 16);
  return int(warps * 32);
}

template <int N, class T>
__device__ MaxSum<acc_t<T>> row_max_sum(const T* z, index_t cols) {
  __shared__ MaxSum<acc_t<T>> shared[32];
  using A = acc_t<T>;
  MaxSum<A> local{A(-INFINITY), A(0)};
  for (index_t c = index_t(threadIdx.x) * N; c < cols; c += index_t(blockDim.x) * N) {
    const auto p = load_pack<N>(z + c);
#pragma unroll
    for (int j = 0; j < N; ++j) {
      const A v = to_acc(p.v[j]);
      if (v > local.max) {
        local.sum = local.sum * dev_exp(local.max - v) + A(1);
        local.max = v;
      } else if (v != A(-INFINITY)) {  // a masked logit adds exp(-inf) = 0; exp(-inf - -inf) would be NaN
        local.sum += dev_exp(v - local.max);
      }
    }
  }
  return block_max_sum(local, shared);
}

/// The block's row of logits (row blockIdx.x of a (rows, cols) array) and its (max, sum of
/// exp(z - max)), which every thread of the block gets.
template <class T>
struct LogitsRow {
  index_t row;
  const T* z;
  MaxSum<acc_t<T>> ms;
};
template <int N, class T>
__device__ LogitsRow<T> logits_row(const T* logits, index_t cols) {
  const index_t row = blockIdx.x;
  const T* z = logits + row * cols;
  return {row, z, row_max_sum<N>(z, cols)};
}

// logits (rows, cols), labels (rows) -> row_loss (rows) = logsumexp(z) - z[label]
template <int N, class T>
__global__ void xent_forward_kernel(const T* logits, const std::int32_t* labels, index_t cols, acc_t<T>* row_loss,
                                    DeviceError* error) {
  using A = acc_t<T>;
  const auto [row, z, ms] = logits_row<N>(logits, cols);
  if (threadIdx.x == 0) {
    const std::int32_t label = labels[row];
    if (label < 0 || label >= cols) {
      record_error(error, label_out_of_range, row, label);
      row_loss[row] = A(NAN);
    } else {
      row_loss[row] = ms.max + dev_log(ms.sum) - to_acc(z[label]);
    }
  }
}

/// loss[0] = sum of row_loss / normalizer, summed by one block in a fixed order.
template <class T>
__global__ void __launch_bounds__(256) xent_sum_kernel(const acc_t<T>* row_loss, index_t rows, acc_t<T> normalizer,
                                                       acc_t<T>* loss) {
  using A = acc_t<T>;
  __shared__ A shared[32];
  A sum = 0;
  for (index_t r = threadIdx.x; r < rows; r += blockDim.x) sum += row_loss[r];
  sum = block_sum(sum, shared);
  if (threadIdx.x == 0) *loss = sum / normalizer;
}

// stats (rows, 3) = (max, sum of exp(z - max), z[label - first] or 0 for another part's label)
template <int N, class T>
__global__ void xent_part_stats_kernel(const T* logits, const std::int32_t* labels, index_t cols, index_t first,
                                       index_t whole, acc_t<T>* stats, DeviceError* error) {
  using A = acc_t<T>;
  const auto [row, z, ms] = logits_row<N>(logits, cols);
  if (threadIdx.x == 0) {
    const std::int32_t label = labels[row];
    const index_t local = index_t(label) - first;
    if (label < 0 || label >= whole) record_error(error, label_out_of_range, row, label);
    stats[row * 3] = ms.max;
    stats[row * 3 + 1] = ms.sum;
    stats[row * 3 + 2] = local >= 0 && local < cols ? to_acc(z[local]) : A(0);
  }
}

// dlogits = (softmax(z) - onehot(label)) * scale. The whole row: lse from the row itself (lse null,
// first 0, whole = cols); a vocabulary part: each row's whole log-sum-exp given.
template <int N, class T>
__global__ void xent_backward_kernel(const T* logits, const std::int32_t* labels, const acc_t<T>* given_lse, T* dlogits,
                                     index_t cols, index_t first, index_t whole, acc_t<T> scale, DeviceError* error) {
  using A = acc_t<T>;
  const index_t row = blockIdx.x;
  const T* z = logits + row * cols;
  A lse;
  if (given_lse != nullptr) {
    lse = given_lse[row];
  } else {
    const MaxSum<A> ms = row_max_sum<N>(z, cols);
    lse = ms.max + dev_log(ms.sum);
  }
  const std::int32_t label = labels[row];
  const bool bad = label < 0 || label >= whole;
  if (bad && threadIdx.x == 0) record_error(error, label_out_of_range, row, label);
  const index_t local = index_t(label) - first;
  T* out = dlogits + row * cols;
  for (index_t c = index_t(threadIdx.x) * N; c < cols; c += index_t(blockDim.x) * N) {
    const auto p = load_pack<N>(z + c);
    Pack<T, N> d;
#pragma unroll
    for (int j = 0; j < N; ++j) {
      const A onehot = c + j == local ? A(1) : A(0);
      d.v[j] = from_acc<T>(bad ? A(NAN) : (dev_exp(to_acc(p.v[j]) - lse) - onehot) * scale);
    }
    store_pack<N>(out + c, d);
  }
}

/// Needs scratch for `rows` accumulators. The loss is in the accumulation type (float for bf16 logits).
template <class T>
void softmax_cross_entropy_forward(Context& ctx, const T* logits, const std::int32_t* labels, acc_t<T>* loss, index_t rows,
                                   index_t cols, index_t normalizer) {
  using A = acc_t<T>;
  if (rows == 0) {
    CUPIPE_CHECK_CUDA(cudaMemsetAsync(loss, 0, sizeof(A), ctx.stream()));
    return;
  }
  CUPIPE_REQUIRE(rows <= 0x7fffffff, "softmax_cross_entropy_forward: too many rows (", rows, ")");
  auto* row_loss = static_cast<A*>(ctx.scratch(std::size_t(rows) * sizeof(A)));
  constexpr int width = pack_width<T>;
  if (cols % width == 0 && packs_aligned(width, logits)) {
    xent_forward_kernel<width><<<unsigned(rows), xent_threads(cols, width), 0, ctx.stream()>>>(
        logits, labels, cols, row_loss, ctx.device_error());
  } else {
    xent_forward_kernel<1><<<unsigned(rows), xent_threads(cols, 1), 0, ctx.stream()>>>(logits, labels, cols, row_loss,
                                                                                      ctx.device_error());
  }
  CUPIPE_CHECK_LAUNCH();
  xent_sum_kernel<T><<<1, 256, 0, ctx.stream()>>>(row_loss, rows, A(normalizer), loss);
  CUPIPE_CHECK_LAUNCH();
}

/// The backward of the whole row (lse null, first 0, whole = cols) or of a vocabulary part, each
/// row's whole log-sum-exp in `lse`.
template <class T>
void softmax_cross_entropy_backward(Context& ctx, const T* logits, const std::int32_t* labels, T* dlogits, index_t rows,
                                    index_t cols, acc_t<T> scale, const acc_t<T>* lse = nullptr, index_t first = 0,
                                    index_t whole = -1) {
  if (rows == 0) return;
  CUPIPE_REQUIRE(rows <= 0x7fffffff, "softmax_cross_entropy_backward: too many rows (", rows, ")");
  if (whole < 0) whole = cols;
  constexpr int width = pack_width<T>;
  if (cols % width == 0 && packs_aligned(width, logits, dlogits)) {
    xent_backward_kernel<width><<<unsigned(rows), xent_threads(cols, width), 0, ctx.stream()>>>(
        logits, labels, lse, dlogits, cols, first, whole, acc_t<T>(scale), ctx.device_error());
  } else {
    xent_backward_kernel<1><<<unsigned(rows), xent_threads(cols, 1), 0, ctx.stream()>>>(
        logits, labels, lse, dlogits, cols, first, whole, acc_t<T>(scale), ctx.device_error());
  }
  CUPIPE_CHECK_LAUNCH();
}

template <class T>
void softmax_cross_entropy_part_stats(Context& ctx, const T* logits, const std::int32_t* labels, acc_t<T>* stats, index_t rows,
                                      index_t cols, index_t first, index_t whole) {
  if (rows == 0) return;
  CUPIPE_REQUIRE(rows <= 0x7fffffff, "softmax_cross_entropy_part_stats: too many rows (", rows, ")");
  constexpr int width = pack_width<T>;
  if (cols % width == 0 && packs_aligned(width, logits)) {
    xent_part_stats_kernel<width><<<unsigned(rows), xent_threads(cols, width), 0, ctx.stream()>>>(
        logits, labels, cols, first, whole, stats, ctx.device_error());
  } else {
    xent_part_stats_kernel<1><<<unsigned(rows), xent_threads(cols, 1), 0, ctx.stream()>>>(
        logits, labels, cols, first, whole, stats, ctx.device_error());
  }
  CUPIPE_CHECK_LAUNCH();
}

}  // namespace cupipe::backend::cuda::kernels
