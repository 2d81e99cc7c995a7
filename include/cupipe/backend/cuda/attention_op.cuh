// SPDX-License-Identifier: Apache-2.0
// The CUDA causal self-attention op (layout and checks in backend/op_checks.hpp, the host op in
// backend/host/ops.hpp): which path a call takes (attention_path.cuh) and each path's call: cuDNN's
// fused SDPA (cudnn_attention.hpp), ours on tensor cores (kernels/attention_mma.cuh), the tiled
// kernels (kernels/attention_tiled.cuh) or the simple ones (kernels/attention.cuh). Part of ops.cuh,
// which includes it at its end; including it alone includes ops.cuh first.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string_view>
#include <type_traits>
#include <vector>

#include "cupipe/backend/cuda/attention_path.cuh"
#include "cupipe/backend/cuda/kernels/attention.cuh"
#include "cupipe/backend/cuda/kernels/attention_mma.cuh"
#include "cupipe/backend/cuda/kernels/attention_tiled.cuh"
#include "cupipe/backend/cuda/ops.cuh"

namespace cupipe::ops {

// ---------------------------------------------------------------------------------------------
// Causal self-attention (layout in op_checks.hpp). The path (cuDNN's fused SDPA, our tiled kernels or
// the simple ones) is chosen per call by backend/cuda/attention_path.cuh; the log-sum-exp per row and
// head is in the compute type and in the op's (n, H) layout on every path.

}  // namespace cupipe::ops
namespace cupipe::backend::cuda::detail {
/// Both hand-written attention kernels put the heads in gridDim.y and the sequences in gridDim.z.
inline void require_attention_grid(std::string_view op, index_t rows, index_t heads, index_t seq_len) {
  constexpr index_t most = backend::cuda::kernels::max_grid_yz;
  CUPIPE_REQUIRE(rows / seq_len <= most && heads <= most, op, ": ", rows / seq_len, " sequences of ", seq_len,
                 " rows and ", heads, " heads in one call, more than the attention kernels' grid takes (", most,
                 " of each); split the microbatch");
}

template <class T, class C>
inline constexpr bool tiled_attention_capable = backend::cuda::kernels::attention_tiled::stores<T> && std::is_same_v<C, float>;
template <class T, class C>
inline constexpr bool bf16_attention = std::is_same_v<T, bfloat16> && std::is_same_v<C, float>;
template <class T, class C>
inline constexpr bool cudnn_attention_capable = backend::cuda::built_with_cudnn && bf16_attention<T, C>;

template <class T, class C>
backend::cuda::AttentionChoice choose_attention_for(backend::Cuda<T, C>& be, index_t rows, index_t width, index_t heads, index_t seq_len) {
  const index_t D = width / heads;
  bool tiled = false;
  if constexpr (tiled_attention_capable<T, C>) tiled = backend::cuda::kernels::attention_tiled::takes<T>(D);
  const backend::cuda::cudnn_attention::Sizes sizes{rows / seq_len, seq_len, heads, D};
  return backend::cuda::choose_attention(be.attention, bf16_attention<T, C>, tiled, sizes, be.cudnn_attention());
}

/// One attention call's rows, width (C) and sizes, and the path it takes.
struct AttentionCall {
  index_t rows, width;
  backend::cuda::cudnn_attention::Sizes sizes;
  backend::cuda::AttentionKernel kernel;
};
template <class T, class C>
AttentionCall attention_call(backend::Cuda<T, C>& be, index_t rows, index_t qkv_cols, index_t heads, index_t seq_len) {
  const index_t width = qkv_cols / 3;
  return {rows, width, {rows / seq_len, seq_len, heads, width / heads}, choose_attention_for(be, rows, width, heads, seq_len).kernel};
}

/// cuDNN's workspace for one call, from the context's pool (at least one byte: a buffer is never empty).
template <class T, class C>
auto cudnn_workspace(backend::Cuda<T, C>& be, std::size_t bytes) {
  return be.template allocate<std::byte>(index_t(std::max<std::size_t>(bytes, 1)), MemoryTag::workspace);
}

/// The sequences a hand-written kernel runs for one call: whole ones of `seq_len`, or with document
/// borders the documents, one launch for all of them (FlashAttention's varlen form): their cu_seqlens
/// are copied to a workspace of the context, in stream order (cudaMemcpyAsync returns once it has
/// read the host's pageable copy), which `table` keeps until the call's kernels are enqueued.
struct CallSequences {
  std::optional<backend::cuda::DeviceBuffer<std::int32_t>> table;
  backend::cuda::kernels::Sequences seqs;
};
template <class T, class C>
CallSequences call_sequences(backend::Cuda<T, C>& be, std::string_view op, const DocumentStarts& documents, index_t rows,
                             index_t seq_len) {
  CallSequences out;
  if (documents.empty()) {
    out.seqs = backend::cuda::kernels::Sequences::uniform(rows, seq_len);
    return out;
  }
  const std::vector<std::int32_t> cu = cumulative_lengths(documents, rows, seq_len);
  const index_t count = index_t(cu.size()) - 1;
  CUPIPE_REQUIRE(count <= backend::cuda::kernels::max_grid_yz, op, ": ", count, " documents in one call, more than the attention ",
                 "kernels' grid takes (", backend::cuda::kernels::max_grid_yz, "); split the microbatch");
  index_t longest = 0;
  for (index_t z = 0; z < count; ++z) longest = std::max<index_t>(longest, cu[std::size_t(z + 1)] - cu[std::size_t(z)]);
  out.table.emplace(be.template allocate<std::int32_t>(index_t(cu.size()), MemoryTag::workspace));
  CUPIPE_CHECK_CUDA(cudaMemcpyAsync(out.table->data(), cu.data(), cu.size() * sizeof(std::int32_t), cudaMemcpyHostToDevice,
                                    be.stream()));
  out.seqs = {out.table->data(), longest, count};
  return out;
}
}  // namespace cupipe::backend::cuda::detail
namespace cupipe::ops {

/// The path causal attention takes on `be` for `rows` rows of `width` (C) columns in `heads` heads and
/// sequences of `seq_len`, and why: what a trainer prints before its first step. On the cuDNN path
/// this builds (and keeps) the call's graphs, as the first call would.
template <class T, class C>
backend::cuda::AttentionChoice attention_choice(backend::Cuda<T, C>& be, index_t rows, index_t width, index_t heads, index_t seq_len) {
  CUPIPE_REQUIRE(heads > 0 && seq_len > 0 && width % heads == 0 && rows % seq_len == 0, "attention_choice: ", rows,
                 " rows of ", width, " columns are not whole sequences of ", seq_len, " tokens in ", heads, " heads");
  const backend::cuda::DeviceGuard guard(be.device());
  return backend::cuda::detail::choose_attention_for(be, rows, width, heads, seq_len);
}

/// With document borders (packed sequences) each document is a causal sequence of its own: the
/// hand-written kernels run them all in one launch; cuDNN's path calls itself per document.
template <class T, class C>
void causal_attention_forward(backend::Cuda<T, C>& be, DeviceConstView<T> qkv, DeviceView<T> out, DeviceView<C> lse,
                              index_t heads, index_t seq_len, const DocumentStarts& documents = {}) {
  checks::causal_attention_forward(qkv, out, lse, heads, seq_len, documents);
  backend::cuda::detail::require_attention_grid("causal_attention_forward", qkv.rows(), heads, seq_len);
  const backend::cuda::detail::OpScope scope(be, "cupipe::causal_attention_forward");
  if (qkv.rows() == 0) return;
  const auto [rows, width, sizes, kernel] = backend::cuda::detail::attention_call(be, qkv.rows(), qkv.cols(), heads, seq_len);
  if (!documents.empty() && kernel == backend::cuda::AttentionKernel::cudnn)
    return each_document_in(documents, rows, seq_len, "causal_attention_forward", [&](index_t first, index_t length) {
      causal_attention_forward(be, qkv.row_slice(first, length), out.row_slice(first, length), lse.row_slice(first, length),
                               heads, length);
    });
  const auto call = backend::cuda::detail::call_sequences(be, "causal_attention_forward", documents, rows, seq_len);
  const backend::cuda::kernels::Sequences seqs = call.seqs;
  if constexpr (backend::cuda::detail::cudnn_attention_capable<T, C>) {
    if (kernel == backend::cuda::AttentionKernel::cudnn) {
      // cuDNN writes its statistics (S, H, T); the op's lse is (S T, H).
      auto& engine = be.cudnn_attention().engine();
      auto stats = be.template allocate<float>(rows * heads, MemoryTag::workspace);
      auto workspace = backend::cuda::detail::cudnn_workspace(be, backend::cuda::cudnn_attention::forward_workspace(engine, sizes));
      backend::cuda::cudnn_attention::forward(engine, be.stream(), sizes, qkv.data(), out.data(), stats.data(), workspace.data());
      backend::cuda::kernels::lse_layout<false>(be.context(), stats.data(), lse.data(), rows, seq_len, int(heads));
      return;
    }
  }
  if constexpr (backend::cuda::detail::bf16_attention<T, C>) {  // misaligned rows or too little shared memory: the simple kernels
    if (kernel == backend::cuda::AttentionKernel::mma && backend::cuda::kernels::attention_mma::takes(be.context(), sizes.head_dim, qkv.data(), out.data())) {
      backend::cuda::kernels::attention_mma::forward(be.context(), backend::cuda::detail::device_ptr(qkv.data()), backend::cuda::detail::device_ptr(out.data()),
                                           lse.data(), rows, width, int(heads), seqs);
      return;
    }
  }
  if constexpr (backend::cuda::detail::tiled_attention_capable<T, C>) {
    if (kernel == backend::cuda::AttentionKernel::tiled) {
      backend::cuda::kernels::attention_tiled::forward(be.context(), backend::cuda::detail::device_ptr(qkv.data()), backend::cuda::detail::device_ptr(out.data()),
                                             lse.data(), rows, width, int(heads), seqs);
      return;
    }
  }
  backend::cuda::kernels::causal_attention_forward(be.context(), backend::cuda::detail::device_ptr(qkv.data()), backend::cuda::detail::device_ptr(out.data()), lse.data(),
                                         rows, width, int(heads), seqs);
}

/// dqkv (overwritten) from dout, with the probabilities recomputed from the saved log-sum-exp; document
/// borders as the forward's.
template <class T, class C>
void causal_attention_backward(backend::Cuda<T, C>& be, DeviceConstView<T> qkv, DeviceConstView<T> out, DeviceConstView<C> lse,
                               DeviceConstView<T> dout, DeviceView<T> dqkv, index_t heads, index_t seq_len,
                               const DocumentStarts& documents = {}) {
  checks::causal_attention_backward(qkv, out, lse, dout, dqkv, heads, seq_len, documents);
  backend::cuda::detail::require_attention_grid("causal_attention_backward", qkv.rows(), heads, seq_len);
  const backend::cuda::detail::OpScope scope(be, "cupipe::causal_attention_backward");
  if (qkv.rows() == 0) return;
  const auto [rows, width, sizes, kernel] = backend::cuda::detail::attention_call(be, qkv.rows(), qkv.cols(), heads, seq_len);
  if (!documents.empty() && kernel == backend::cuda::AttentionKernel::cudnn)
    return each_document_in(documents, rows, seq_len, "causal_attention_backward", [&](index_t first, index_t length) {
      causal_attention_backward(be, qkv.row_slice(first, length), out.row_slice(first, length), lse.row_slice(first, length),
                                dout.row_slice(first, length), dqkv.row_slice(first, length), heads, length);
    });
  const auto call = backend::cuda::detail::call_sequences(be, "causal_attention_backward", documents, rows, seq_len);
  const backend::cuda::kernels::Sequences seqs = call.seqs;
  if constexpr (backend::cuda::detail::cudnn_attention_capable<T, C>) {
    if (kernel == backend::cuda::AttentionKernel::cudnn) {
      auto& engine = be.cudnn_attention().engine();
      auto stats = be.template allocate<float>(rows * heads, MemoryTag::workspace);
      backend::cuda::kernels::lse_layout<true>(be.context(), lse.data(), stats.data(), rows, seq_len, int(heads));
      auto workspace = backend::cuda::detail::cudnn_workspace(be, backend::cuda::cudnn_attention::backward_workspace(engine, sizes));
      backend::cuda::cudnn_attention::backward(engine, be.stream(), sizes, qkv.data(), out.data(), stats.data(), dout.data(), dqkv.data(),
                                     workspace.data());
      return;
    }
  }
  auto delta = be.template allocate<C>(rows * heads, MemoryTag::workspace);
  if constexpr (backend::cuda::detail::bf16_attention<T, C>) {
    if (kernel == backend::cuda::AttentionKernel::mma && backend::cuda::kernels::attention_mma::takes(be.context(), sizes.head_dim, qkv.data(), out.data()) &&
        backend::cuda::kernels::attention_mma::takes(be.context(), sizes.head_dim, dout.data(), dqkv.data())) {
      backend::cuda::kernels::attention_mma::backward(be.context(), backend::cuda::detail::device_ptr(qkv.data()), backend::cuda::detail::device_ptr(out.data()),
                                            lse.data(), backend::cuda::detail::device_ptr(dout.data()), backend::cuda::detail::device_ptr(dqkv.data()),
                                            delta.data(), rows, width, int(heads), seqs);
      return;
    }
  }
  if constexpr (backend::cuda::detail::tiled_attention_capable<T, C>) {
    if (kernel == backend::cuda::AttentionKernel::tiled) {
      backend::cuda::kernels::attention_tiled::backward(be.context(), backend::cuda::detail::device_ptr(qkv.data()), backend::cuda::detail::device_ptr(out.data()),
                                              lse.data(), backend::cuda::detail::device_ptr(dout.data()), backend::cuda::detail::device_ptr(dqkv.data()),
                                              delta.data(), rows, width, int(heads), seqs);
      return;
    }
  }
  backend::cuda::kernels::causal_attention_backward(be.context(), backend::cuda::detail::device_ptr(qkv.data()), backend::cuda::detail::device_ptr(out.data()), lse.data(),
                                          backend::cuda::detail::device_ptr(dout.data()), backend::cuda::detail::device_ptr(dqkv.data()), delta.data(), rows,
                                          width, int(heads), seqs);
}

}  // namespace cupipe::ops
