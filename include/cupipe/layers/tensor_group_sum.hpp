// SPDX-License-Identifier: Apache-2.0
// tensor_group_sum: the one collective of tensor-parallel layers (layers/tensor_parallel.hpp), an
// in-place sum over the backend context's tensor_group. A layer of one part (Parts == 1: the plain
// Linear and CausalSelfAttention share the split layers' code) sums nothing.
#pragma once

#include <cstddef>
#include <span>
#include <type_traits>
#include <vector>

#include "cupipe/core/error.hpp"
#include "cupipe/core/tensor.hpp"
#include "cupipe/core/tensor_group.hpp"
#include "cupipe/layers/layer.hpp"

namespace cupipe {

/// The backend's tensor-parallel group, which must have `Parts` ranks (`layer` names the caller in
/// the error).
template <int Parts, class B>
TensorGroup& tensor_group_of(B& be, const char* layer) {
  TensorGroup* group = be.tensor_group;
  if (group == nullptr)
    CUPIPE_THROW(layer, " is split over ", Parts, " tensor-parallel ranks, but the backend has no tensor_group (set it "
                 "to the communicator's tensor_group())");
  if (group->size() != Parts)
    CUPIPE_THROW(layer, " is split over ", Parts, " tensor-parallel ranks, but the backend's tensor group has ",
                 group->size());
  return *group;
}

/// This rank's place in the tensor-parallel group: 0 for a layer of one part.
template <int Parts, class B>
int tensor_group_rank(B& be, const char* layer) {
  if constexpr (Parts > 1) return tensor_group_of<Parts>(be, layer).rank();
  else return (void)be, (void)layer, 0;
}

/// Sums `v` (the backend's memory) in place over the backend's tensor-parallel group, which must
/// have `Parts` ranks. Device memory goes straight to a group that takes it (NCCL), else through
/// the host. bf16 values are widened to fp32 in host memory, summed there and rounded once to
/// nearest even (each rank's part was rounded once by its own op; the sum is not rounded per rank);
/// a `row_bias` (bf16 only: RowParallelLinear's bias, v's row width) is added to the fp32 sum before
/// that rounding, as the whole layer's GEMM adds its bias before its one rounding.
template <int Parts, class B, class T>
void tensor_group_sum(B& be, ViewOn<B, T> v, const char* layer, ConstViewOn<B, T> row_bias = {}) {
  if constexpr (Parts > 1) {
    static_assert(std::is_same_v<T, float> || std::is_same_v<T, double> || std::is_same_v<T, bfloat16>,
                  "tensor parallelism sums float, double or bfloat16 activations");
    TensorGroup& group = tensor_group_of<Parts>(be, layer);
    const std::size_t n = std::size_t(v.numel());
    if (n == 0) return;
    be.synchronize();
    if constexpr (std::is_same_v<T, bfloat16>) {
      std::vector<bfloat16> stored(n);
      be.download(v.data(), std::span<bfloat16>(stored));
      std::vector<float> wide(n);
      for (std::size_t i = 0; i < n; ++i) wide[i] = float(stored[i]);
      group.sum(wide.data(), n);
      if (row_bias.data() != nullptr) {  // (a default view is a null scalar: numel() 1)
        const std::size_t cols = std::size_t(row_bias.numel());
        CUPIPE_REQUIRE(cols > 0 && n % cols == 0, layer, ": a bias of ", cols, " values for rows of ", v.shape());
        std::vector<bfloat16> bias(cols);
        be.download(row_bias.data(), std::span<bfloat16>(bias));
        for (std::size_t i = 0; i < n; ++i) wide[i] += float(bias[i % cols]);
      }
      for (std::size_t i = 0; i < n; ++i) stored[i] = bfloat16(wide[i]);
      be.upload(std::span<const bfloat16>(stored), v.data());
    } else if (host_accessible<typename B::space> || group.device_memory()) {
      group.sum(v.data(), n);
    } else {
      std::vector<T> host(n);
      be.download(v.data(), std::span<T>(host));
      group.sum(host.data(), n);
      be.upload(std::span<const T>(host), v.data());
    }
  } else {
    (void)be, (void)v, (void)layer;
  }
  (void)row_bias;
}

/// Every rank's `v` (the backend's memory, the same size on each), in host memory: rank t's at
/// [t n, (t + 1) n). An all-gather through the group's sum (each rank's slot is exact: the others add
/// zeros); for small per-row statistics.
template <int Parts, class B, class T>
std::vector<T> tensor_group_gather(B& be, ViewOn<B, const T> v, const char* layer) {
  const std::size_t n = std::size_t(v.numel());
  std::vector<T> out(n * std::size_t(Parts), T(0));
  const int t = tensor_group_rank<Parts>(be, layer);
  be.synchronize();
  be.download(v.data(), std::span<T>(out.data() + std::size_t(t) * n, n));
  if constexpr (Parts > 1)
    if (n > 0) tensor_group_of<Parts>(be, layer).sum(out.data(), out.size());
  return out;
}

/// How a tensor split `split` over `Parts` ranks is described: not at all with one part.
template <int Parts>
constexpr TensorSplit split_over(TensorSplit split) {
  return Parts > 1 ? split : TensorSplit::none;
}

}  // namespace cupipe
