// SPDX-License-Identifier: Apache-2.0
// transfer(): the pipeline's hand-over of an activation or gradient from one stage's context to
// another's, the CUDA overload of the customization point whose host version is a plain copy
// (backend/host/host.hpp). Nothing here waits on the host:
// - the copy runs on the sender's stream, after the sender's kernels that produced `src`, and
//   first waits for the destination block's reuse fence (the receiver's last use of that block,
//   see DevicePool), so a recycled block is never overwritten while the receiver still reads it;
// - the same device: cudaMemcpyAsync; different devices: cudaMemcpyPeerAsync (over NVLink/PCIe
//   peer access where cudaDeviceCanAccessPeer allows it, which the sender's context enables once
//   per peer; CUDA stages the copy through the host otherwise);
// - the sender records its hand-over event after the copy and the receiver's main stream waits on
//   it, so the receiver's next kernels see the data.
// `dst` must be a whole buffer allocated from `to` (its reuse fence is looked up by address).
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>

#include "cupipe/backend/cuda/check.cuh"
#include "cupipe/backend/cuda/cuda.cuh"
#include "cupipe/backend/cuda/device_guard.cuh"
#include "cupipe/backend/cuda/nvtx.cuh"
#include "cupipe/backend/cuda/stream.cuh"
#include "cupipe/backend/op_checks.hpp"
#include "cupipe/core/error.hpp"
#include "cupipe/core/tensor.hpp"

namespace cupipe::ops {

/// Copies `src` (in `from`'s memory) into `dst` (a buffer of `to`), ordered after `from`'s work so
/// far and before `to`'s work from now on. Returns without waiting for the copy.
template <class T, class C, class U>
void transfer(backend::Cuda<T, C>& from, backend::Cuda<T, C>& to, DeviceConstView<U> src, DeviceView<U> dst) {
  checks::transfer(src, dst);
  if (src.numel() == 0) return;
  const backend::cuda::NvtxRange range("cupipe::transfer");
  // The copy is enqueued from the sender's device; the thread's own current device is restored on return.
  const backend::cuda::DeviceGuard device(from.device());
  const std::size_t bytes = std::size_t(src.numel()) * sizeof(U);
  if (from.device() != to.device()) from.context().enable_peer_access(to.device());
  if (&from != &to)
    if (cudaEvent_t fence = to.context().pool().reuse_fence(dst.data()))
      CUPIPE_CHECK_CUDA(cudaStreamWaitEvent(from.stream(), fence, 0));
  if (from.device() == to.device())
    CUPIPE_CHECK_CUDA(cudaMemcpyAsync(dst.data(), src.data(), bytes, cudaMemcpyDeviceToDevice, from.stream()));
  else
    CUPIPE_CHECK_CUDA(cudaMemcpyPeerAsync(dst.data(), to.device(), src.data(), from.device(), bytes, from.stream()));
  if (&from == &to) return;  // one stream: already in order
  backend::cuda::Event& copied = from.context().handoff_event();
  copied.record(from.stream());
  // The receiver's main stream: its thread may have an overlap open (backend::cuda::Context), and an input
  // taken before overlap_begin reaches the side stream through the fork.
  CUPIPE_CHECK_CUDA(cudaStreamWaitEvent(to.context().main_stream(), copied, 0));
}

}  // namespace cupipe::ops
