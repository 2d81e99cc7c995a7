// SPDX-License-Identifier: Apache-2.0
// Context parallelism's ring attention on backend::Cuda: the host op's names, signatures and checks
// (backend/host/ops_ring.hpp, the reference), with the kernels of one ring step in
// backend/cuda/kernels/ring_attention.cuh. Part of ops.cuh, which includes it at its end.
//
// The ring passes device memory (cp::ContextGroup::device_memory(): NCCL's, comm/nccl_groups.hpp, or a
// test's ring of threads). Each pass starts after the context's work so far (the ring orders its own
// stream after this one's) and its wait is the host's, under the ring's deadline: no stream waits
// for a transfer. Forward: cp - 1 passes of the keys and values, each started before the step's
// kernels and finished after they are queued, so the transfer runs beside them. Backward: the keys
// and values go round again the same way, their gradient travelling with them, one pass of it after
// each step's kernels (it waits for them), as on the host.
//
// Runs in fp32 or fp64 storage (Cuda<float>, Cuda<double>): the running output is stored between
// steps, which in bf16 would round it cp times; the attention layer refuses bf16 storage with the
// reason before it gets here. Compiled, not yet run on a GPU (docs/gpu_notes.md):
// tests/cuda/test_cuda_ops.cu checks it against the host op on a ring of threads when a GPU is lent.
#pragma once

#include <optional>
#include <type_traits>
#include <utility>

#include "cupipe/backend/cuda/cuda.cuh"
#include "cupipe/backend/cuda/kernels/ring_attention.cuh"
#include "cupipe/backend/cuda/ops.cuh"
#include "cupipe/backend/op_checks.hpp"
#include "cupipe/core/error.hpp"
#include "cupipe/core/tensor.hpp"
#include "cupipe/cp/context_group.hpp"
#include "cupipe/cp/zigzag.hpp"

namespace cupipe::backend::cuda::detail {

/// The ring's shape for `rows` local rows of sequences of `seq_len`, checked against the kernels'
/// grid; `op` names the caller.
inline kernels::ring_attention::Step ring_step(const cp::ContextGroup& ring, index_t rows, index_t seq_len, index_t heads,
                                               int step, const char* op) {
  CUPIPE_REQUIRE(ring.device_memory(), op, " on CUDA: the context-parallel ring passes host memory (MPI's); a device "
                 "backend's ring passes device memory (NcclCommunicator's)");
  const int cp = ring.size(), rank = ring.rank();
  const index_t c = cp::chunk_rows(seq_len, cp);
  CUPIPE_REQUIRE(2 * (rows / (2 * c)) <= kernels::max_grid_yz && heads <= kernels::max_grid_yz, op, ": ", rows / (2 * c),
                 " sequences' shares and ", heads, " heads in one call, more than the kernels' grid takes; split the microbatch");
  const auto mine = cp::chunks_of(rank, cp), theirs = cp::chunks_of(cp::ring_source(rank, step, cp), cp);
  return {c, mine[0], mine[1], theirs[0], theirs[1]};
}

/// A pass of `bytes` round `ring`, started on construction, finished by finish() or, should
/// something throw before that, by the destructor, before the buffers it moves go back to the pool
/// (declare them first): no pass is left in flight over freed memory, and the ring stays usable.
class RingPass {
 public:
  RingPass(cp::ContextGroup& ring, const void* send, void* receive, std::size_t bytes, cudaStream_t stream) {
    ring.start_pass(send, receive, bytes, stream);
    ring_ = &ring;
  }
  RingPass(const RingPass&) = delete;
  RingPass& operator=(const RingPass&) = delete;
  ~RingPass() {
    if (!ring_) return;
    try {
      ring_->finish_pass();
    } catch (...) {  // unwinding already: the first error is the one to report
    }
  }
  void finish() { std::exchange(ring_, nullptr)->finish_pass(); }

 private:
  cp::ContextGroup* ring_ = nullptr;
};

}  // namespace cupipe::backend::cuda::detail

namespace cupipe::ops {

template <class T, class C>
void ring_attention_forward(backend::Cuda<T, C>& be, cp::ContextGroup& ring, DeviceConstView<T> qkv, DeviceView<T> out,
                            DeviceView<C> lse, index_t heads, index_t seq_len) {
  static_assert(std::is_same_v<T, C>, "ring attention on CUDA runs in fp32 or fp64 storage (Cuda<float>, Cuda<double>)");
  checks::ring_attention_forward(qkv, out, lse, heads, seq_len, ring.size());
  const backend::cuda::detail::OpScope scope(be, "cupipe::ring_attention_forward");
  const index_t rows = qkv.rows(), C_ = qkv.cols() / 3;
  (void)backend::cuda::detail::ring_step(ring, rows, seq_len, heads, 0, "ring attention");
  if (rows == 0) return;
  namespace k = backend::cuda::kernels::ring_attention;
  auto a = be.template allocate<T>(rows * 2 * C_, MemoryTag::workspace), b = be.template allocate<T>(rows * 2 * C_, MemoryTag::workspace);
  T *kv = a.data(), *next = b.data();
  k::pack(be.context(), qkv.data(), kv, rows, C_);
  const int cp = ring.size();
  for (int step = 0; step < cp; ++step) {
    std::optional<backend::cuda::detail::RingPass> pass;
    if (step + 1 < cp) pass.emplace(ring, kv, next, std::size_t(rows * 2 * C_) * sizeof(T), be.stream());
    k::forward_step(be.context(), qkv.data(), kv, out.data(), lse.data(), rows, C_, int(heads),
                    backend::cuda::detail::ring_step(ring, rows, seq_len, heads, step, "ring attention"), step == 0);
    if (pass) {
      pass->finish();
      std::swap(kv, next);
    }
  }
}

template <class T, class C>
void ring_attention_backward(backend::Cuda<T, C>& be, cp::ContextGroup& ring, DeviceConstView<T> qkv, DeviceConstView<T> out,
                             DeviceConstView<C> lse, DeviceConstView<T> dout, DeviceView<T> dqkv, index_t heads, index_t seq_len) {
  static_assert(std::is_same_v<T, C>, "ring attention on CUDA runs in fp32 or fp64 storage (Cuda<float>, Cuda<double>)");
  checks::ring_attention_backward(qkv, out, lse, dout, dqkv, heads, seq_len, ring.size());
  const backend::cuda::detail::OpScope scope(be, "cupipe::ring_attention_backward");
  const index_t rows = qkv.rows(), C_ = qkv.cols() / 3, kv_values = rows * 2 * C_;
  (void)backend::cuda::detail::ring_step(ring, rows, seq_len, heads, 0, "ring attention (backward)");
  if (rows == 0) return;
  namespace k = backend::cuda::kernels::ring_attention;
  auto kv_a = be.template allocate<T>(kv_values, MemoryTag::workspace), kv_b = be.template allocate<T>(kv_values, MemoryTag::workspace);
  auto dkv_a = be.template allocate<T>(kv_values, MemoryTag::workspace), dkv_b = be.template allocate<T>(kv_values, MemoryTag::workspace);
  auto delta = be.template allocate<T>(rows * heads, MemoryTag::workspace);
  T *kv = kv_a.data(), *next = kv_b.data(), *dkv = dkv_a.data(), *next_dkv = dkv_b.data();
  const std::size_t bytes = std::size_t(kv_values) * sizeof(T);
  k::pack(be.context(), qkv.data(), kv, rows, C_);
  CUPIPE_CHECK_CUDA(cudaMemsetAsync(dkv, 0, bytes, be.stream()));
  k::delta(be.context(), out.data(), dout.data(), delta.data(), rows, C_, int(heads));
  const int cp = ring.size();
  for (int step = 0; step < cp; ++step) {
    std::optional<backend::cuda::detail::RingPass> pass;
    if (step + 1 < cp) pass.emplace(ring, kv, next, bytes, be.stream());
    k::backward_step(be.context(), qkv.data(), kv, lse.data(), dout.data(), delta.data(), dqkv.data(), dkv, rows, C_, int(heads),
                     backend::cuda::detail::ring_step(ring, rows, seq_len, heads, step, "ring attention (backward)"), step == 0);
    if (pass) {
      pass->finish();
      std::swap(kv, next);
    }
    // The gradient of the keys and values in hand goes on with them; after the last step, home.
    if (cp > 1) {
      ring.start_pass(dkv, next_dkv, bytes, be.stream());
      ring.finish_pass();
      std::swap(dkv, next_dkv);
    }
  }
  k::unpack(be.context(), dkv, dqkv.data(), rows, C_);
}

}  // namespace cupipe::ops
