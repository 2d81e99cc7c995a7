// SPDX-License-Identifier: Apache-2.0
// Embedding lookup and its deterministic backward.
//
// Backward without float atomics: the row indices are sorted by token id with CUB's radix sort
// (stable, so rows of one id keep their order), runs of equal ids are found with run-length
// encoding, and one block per distinct id adds its rows of dy into the table row in row order:
// dtable[id] = ((dtable[id] + dy[r1]) + dy[r2]) + ..., the host reference's exact order.
//
// The table may hold rows [first, first + table_rows) of a vocabulary of `whole` ids (a
// vocabulary-parallel rank's part): ids in [0, whole) outside the part give zero rows and no
// gradient; ids outside [0, whole) are reported. A whole table is first 0, whole = table_rows.
#pragma once

#include <cub/device/device_radix_sort.cuh>
#include <cub/device/device_run_length_encode.cuh>
#include <cub/device/device_scan.cuh>
#include <cuda_runtime.h>

#include <algorithm>
#include <bit>
#include <cstddef>
#include <cstdint>

#include "cupipe/backend/cuda/check.cuh"
#include "cupipe/backend/cuda/context.cuh"
#include "cupipe/backend/cuda/kernels/common.cuh"

namespace cupipe::backend::cuda::kernels {

// y (rows, cols) = table[ids - first], zeros for ids of other parts; a bad id is reported and its row
// filled with NaN.
template <int N, class T>
__global__ void embedding_forward_kernel(const std::int32_t* ids, const T* table, T* y, index_t rows, index_t cols,
                                         index_t first, index_t table_rows, index_t whole, DeviceError* error) {
  const index_t packs_per_row = cols / N;
  const index_t stride = index_t(gridDim.x) * blockDim.x;
  for (index_t i = index_t(blockIdx.x) * blockDim.x + threadIdx.x; i < rows * packs_per_row; i += stride) {
    const index_t row = i / packs_per_row, c = (i - row * packs_per_row) * N;
    const std::int32_t id = ids[row];
    Pack<T, N> out;
    const index_t local = index_t(id) - first;
    if (id < 0 || id >= whole) {
      if (c == 0) record_error(error, token_id_out_of_range, row, id);
#pragma unroll
      for (int j = 0; j < N; ++j) out.v[j] = from_acc<T>(acc_t<T>(NAN));
    } else if (local < 0 || local >= table_rows) {
#pragma unroll
      for (int j = 0; j < N; ++j) out.v[j] = from_acc<T>(acc_t<T>(0));
    } else {
      out = load_pack<N>(table + local * cols + c);
    }
    store_pack<N>(y + row * cols + c, out);
  }
}

template <class T>
void embedding_forward(Context& ctx, const std::int32_t* ids, const T* table, T* y, index_t rows, index_t cols,
                       index_t first, index_t table_rows, index_t whole) {
  if (rows == 0 || cols == 0) return;
  constexpr int width = pack_width<T>;
  constexpr int threads = 256;
  if (cols % width == 0 && packs_aligned(width, table, y))
    embedding_forward_kernel<width><<<grid_for(rows * cols / width, threads, ctx), threads, 0, ctx.stream()>>>(
        ids, table, y, rows, cols, first, table_rows, whole, ctx.device_error());
  else
    embedding_forward_kernel<1><<<grid_for(rows * cols, threads, ctx), threads, 0, ctx.stream()>>>(
        ids, table, y, rows, cols, first, table_rows, whole, ctx.device_error());
  CUPIPE_CHECK_LAUNCH();
}

/// keys[r] = ids[r] - first when in the part, else table_rows (a run the accumulation skips: a bad
/// id, reported, or another part's); positions[r] = r.
template <class Unused = void>
__global__ void embedding_keys_kernel(const std::int32_t* ids, std::uint32_t* keys, std::int32_t* positions,
                                      index_t rows, index_t first, index_t table_rows, index_t whole, DeviceError* error) {
  const index_t stride = index_t(gridDim.x) * blockDim.x;
  for (index_t r = index_t(blockIdx.x) * blockDim.x + threadIdx.x; r < rows; r += stride) {
    const std::int32_t id = ids[r];
    if (id < 0 || id >= whole) record_error(error, token_id_out_of_range, r, id);
    const index_t local = index_t(id) - first;
    keys[r] = local >= 0 && local < table_rows && id < whole ? std::uint32_t(local) : std::uint32_t(table_rows);
    positions[r] = std::int32_t(r);
  }
}

/// One block per run of equal ids: dtable[id] += dy[rows of the run], in row order. G: the table
/// gradient's type (the accumulation type for bf16 dy).
template <int N, class T, class G>
__global__ void embedding_accumulate_kernel(const std::uint32_t* unique_ids, const std::int32_t* run_lengths,
                                            const std::int32_t* run_starts, const std::int32_t* run_count,
                                            const std::int32_t* sorted_rows, const T* dy, G* dtable, index_t cols,
                                            index_t vocab) {
  using A = acc_t<T>;
  const std::int32_t runs = *run_count;
  for (std::int32_t run = blockIdx.x; run < runs; run += gridDim.x) {
    const std::uint32_t id = unique_ids[run];
    if (id >= vocab) continue;  // bad ids (already reported) and other parts' ids
    const std::int32_t start = run_starts[run], length = run_lengths[run];
    G* out = dtable + index_t(id) * cols;
    for (index_t c = index_t(threadIdx.x) * N; c < cols; c += index_t(blockDim.x) * N) {
      const auto current = load_pack<N>(out + c);
      A acc[N];
#pragma unroll
      for (int j = 0; j < N; ++j) acc[j] = to_acc(current.v[j]);
      for (std::int32_t k = 0; k < length; ++k) {
        const auto d = load_pack<N>(dy + index_t(sorted_rows[start + k]) * cols + c);
#pragma unroll
        for (int j = 0; j < N; ++j) acc[j] += to_acc(d.v[j]);
      }
      Pack<G, N> result;
#pragma unroll
      for (int j = 0; j < N; ++j) result.v[j] = from_acc<G>(acc[j]);
      store_pack<N>(out + c, result);
    }
  }
}

/// Scratch layout for the backward: seven int arrays of `rows`, the run count, then CUB's storage.
struct EmbeddingScratch {
  static constexpr std::size_t align = 256;
  static constexpr std::size_t round(std::size_t bytes) { return (bytes + align - 1) / align * align; }

  explicit EmbeddingScratch(index_t rows, index_t vocab) : rows(rows) {
    end_bit = std::max(1, int(std::bit_width(std::uint64_t(vocab))));  // keys lie in [0, vocab]
    std::size_t sort = 0, encode = 0, scan = 0;
    const int n = int(rows);
    CUPIPE_CHECK_CUDA(cub::DeviceRadixSort::SortPairs(nullptr, sort, static_cast<const std::uint32_t*>(nullptr),
                                                      static_cast<std::uint32_t*>(nullptr),
                                                      static_cast<const std::int32_t*>(nullptr),
                                                      static_cast<std::int32_t*>(nullptr), n, 0, end_bit));
    CUPIPE_CHECK_CUDA(cub::DeviceRunLengthEncode::Encode(nullptr, encode, static_cast<const std::uint32_t*>(nullptr),
                                                         static_cast<std::uint32_t*>(nullptr),
                                                         static_cast<std::int32_t*>(nullptr),
                                                         static_cast<std::int32_t*>(nullptr), n));
    CUPIPE_CHECK_CUDA(cub::DeviceScan::ExclusiveSum(nullptr, scan, static_cast<const std::int32_t*>(nullptr),
                                                    static_cast<std::int32_t*>(nullptr), n));
    temp_bytes = std::max({sort, encode, scan, std::size_t(1)});
    array_bytes = round(std::size_t(rows) * 4);
    bytes = 7 * array_bytes + align + temp_bytes;
  }

  template <class P>
  P* array(void* base, int i) const {
    return reinterpret_cast<P*>(static_cast<std::byte*>(base) + std::size_t(i) * array_bytes);
  }
  std::int32_t* run_count(void* base) const {
    return reinterpret_cast<std::int32_t*>(static_cast<std::byte*>(base) + 7 * array_bytes);
  }
  void* temp(void* base) const { return static_cast<std::byte*>(base) + 7 * array_bytes + align; }

  index_t rows;
  int end_bit = 1;
  std::size_t temp_bytes = 0, array_bytes = 0, bytes = 0;
};

template <class T, class G>
void embedding_backward(Context& ctx, const std::int32_t* ids, const T* dy, G* dtable, index_t rows, index_t cols,
                        index_t first, index_t table_rows, index_t whole) {
  if (rows == 0 || cols == 0) return;
  CUPIPE_REQUIRE(rows <= 0x7fffffff && table_rows < 0x7fffffff, "embedding_backward: ", rows, " rows or vocabulary ", table_rows,
                 " too large for 32-bit indices");
  const EmbeddingScratch layout(rows, table_rows);
  void* base = ctx.scratch(layout.bytes);
  auto* keys = layout.array<std::uint32_t>(base, 0);
  auto* sorted_keys = layout.array<std::uint32_t>(base, 1);
  auto* positions = layout.array<std::int32_t>(base, 2);
  auto* sorted_rows = layout.array<std::int32_t>(base, 3);
  auto* unique_ids = layout.array<std::uint32_t>(base, 4);
  auto* lengths = layout.array<std::int32_t>(base, 5);
  auto* starts = layout.array<std::int32_t>(base, 6);
  std::int32_t* runs = layout.run_count(base);
  void* temp = layout.temp(base);
  const int n = int(rows);
  cudaStream_t stream = ctx.stream();

  embedding_keys_kernel<<<grid_for(rows, 256, ctx), 256, 0, stream>>>(ids, keys, positions, rows, first, table_rows, whole,
                                                                        ctx.device_error());
  CUPIPE_CHECK_LAUNCH();
  std::size_t temp_bytes = layout.temp_bytes;
  CUPIPE_CHECK_CUDA(cub::DeviceRadixSort::SortPairs(temp, temp_bytes, keys, sorted_keys, positions, sorted_rows, n, 0,
                                                    layout.end_bit, stream));
  temp_bytes = layout.temp_bytes;
  // Encode writes `runs` lengths, a count that stays on the device; the scan below runs over all n, so
  // the tail past `runs` is zeroed first rather than read uninitialised (compute-sanitizer's initcheck
  // found it on the first GPU run; the starts it produced there were never used).
  CUPIPE_CHECK_CUDA(cudaMemsetAsync(lengths, 0, std::size_t(n) * sizeof(std::int32_t), stream));
  CUPIPE_CHECK_CUDA(cub::DeviceRunLengthEncode::Encode(temp, temp_bytes, sorted_keys, unique_ids, lengths, runs, n, stream));
  temp_bytes = layout.temp_bytes;
  CUPIPE_CHECK_CUDA(cub::DeviceScan::ExclusiveSum(temp, temp_bytes, lengths, starts, n, stream));

  constexpr int width = pack_width<T, G>;
  const int threads = int(std::clamp<index_t>((cols / width + 31) / 32 * 32, 32, 256));
  const unsigned blocks = unsigned(std::min<index_t>(rows, index_t(ctx.sm_count()) * 32));
  if (cols % width == 0 && packs_aligned(width, dy, dtable))
    embedding_accumulate_kernel<width><<<blocks, threads, 0, stream>>>(unique_ids, lengths, starts, runs, sorted_rows,
                                                                       dy, dtable, cols, table_rows);
  else
    embedding_accumulate_kernel<1><<<blocks, threads, 0, stream>>>(unique_ids, lengths, starts, runs, sorted_rows, dy,
                                                                   dtable, cols, table_rows);
  CUPIPE_CHECK_LAUNCH();
}

}  // namespace cupipe::backend::cuda::kernels
