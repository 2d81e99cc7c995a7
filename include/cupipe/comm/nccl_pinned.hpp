// SPDX-License-Identifier: Apache-2.0
// The pinned host memory an NcclCommunicator (comm/nccl.hpp) stages through. Every pipeline message
// is preceded by a small header carrying its key (NcclHeader), which the receiver checks on arrival;
// the headers' host side lives in pinned slots (NcclHeaderRing), so their copies are asynchronous
// and the host only ever waits in the communicator's deadline-bound waits. Collectives on host
// memory go through a pinned buffer that grows to the largest array (PinnedStaging), because a copy
// into pageable memory blocks the host until the stream gets there, outside any deadline. Both are
// allocated outside a step where they can be: cudaMallocHost synchronises the device.
// Built with CUDA (CUPIPE_HAS_NCCL).
#pragma once

#include <cuda_runtime_api.h>
#include <nccl.h>

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <vector>

#include "cupipe/backend/cuda/check.cuh"
#include "cupipe/backend/cuda/stream.cuh"
#include "cupipe/core/error.hpp"

namespace cupipe::comm::detail {

/// What precedes each message on the wire: its key and its payload's size.
struct NcclHeader {
  std::int32_t flow;
  std::int32_t virtual_stage;
  std::int32_t microbatch;
  std::int32_t reserved;
  std::int64_t bytes;
};

/// Pinned header slots, allocated once (cudaMallocHost synchronises the device, so never inside
/// a step): received() for the receive in progress (the host waits for it), and a ring for the
/// sends. A send's slot is read only by its header's host-to-device copy; the slot's event marks
/// that copy done, and take() waits for it before the ring comes round again. The copy stream
/// waits only for the callers' kernels, never for NCCL, so that wait is short and always ends.
class NcclHeaderRing {
 public:
  static constexpr int slots = 64;
  NcclHeaderRing() {
    void* pinned = nullptr;
    CUPIPE_CHECK_CUDA(cudaMallocHost(&pinned, sizeof(NcclHeader) * (slots + 1)));
    headers_ = static_cast<NcclHeader*>(pinned);
    copied_.reserve(slots);
    for (int i = 0; i < slots; ++i) copied_.emplace_back(false);
  }
  NcclHeaderRing(const NcclHeaderRing&) = delete;
  NcclHeaderRing& operator=(const NcclHeaderRing&) = delete;
  ~NcclHeaderRing() { release(); }
  /// The next send slot, its previous copy done; mark(slot, stream) after enqueuing its copy.
  int take() {
    const int slot = next_;
    next_ = (next_ + 1) % slots;
    if (used_[std::size_t(slot)]) copied_[std::size_t(slot)].synchronize();
    used_[std::size_t(slot)] = false;
    return slot;
  }
  NcclHeader* at(int slot) noexcept { return &headers_[slot]; }
  void mark(int slot, cudaStream_t stream) {
    copied_[std::size_t(slot)].record(stream);
    used_[std::size_t(slot)] = true;
  }
  NcclHeader* received() noexcept { return &headers_[slots]; }
  void release() noexcept {
    if (headers_) (void)cudaFreeHost(headers_);
    headers_ = nullptr;
  }

 private:
  NcclHeader* headers_ = nullptr;
  std::vector<backend::cuda::Event> copied_;
  std::array<bool, slots> used_{};
  int next_ = 0;
};

/// Pinned host memory for staging host arrays; it grows (cudaMallocHost, which synchronises the
/// device) only when a larger array comes, so a first call with the largest small size, outside a
/// step, keeps the small sums from ever pinning memory inside one.
class PinnedStaging {
 public:
  PinnedStaging() = default;
  PinnedStaging(const PinnedStaging&) = delete;
  PinnedStaging& operator=(const PinnedStaging&) = delete;
  ~PinnedStaging() { release(); }
  /// At least `bytes`; what an earlier call returned is freed when this one grows.
  std::byte* at_least(std::size_t bytes) {
    if (bytes > bytes_) {
      const std::size_t grown = std::max(bytes, 2 * bytes_);
      void* fresh = nullptr;
      CUPIPE_CHECK_CUDA(cudaMallocHost(&fresh, grown));
      if (pinned_) (void)cudaFreeHost(pinned_);
      pinned_ = fresh;
      bytes_ = grown;
    }
    return static_cast<std::byte*>(pinned_);
  }
  void release() noexcept {
    if (pinned_) (void)cudaFreeHost(pinned_);
    pinned_ = nullptr;
  }

 private:
  void* pinned_ = nullptr;
  std::size_t bytes_ = 0;
};

/// Makes `device` this thread's CUDA device for rank `rank`, refusing one that is not present.
inline int select_nccl_device(int rank, int device) {
  int count = 0;
  CUPIPE_CHECK_CUDA(cudaGetDeviceCount(&count));
  CUPIPE_REQUIRE(device >= 0 && device < count, "NcclCommunicator: rank ", rank, " asked for CUDA device ", device,
                 " but ", count, count == 1 ? " device is" : " devices are", " present");
  CUPIPE_CHECK_CUDA(cudaSetDevice(device));
  return device;
}

/// Bytes of one value of the types the communicator sums (fp32 or fp64).
inline std::size_t nccl_size_of(ncclDataType_t type) { return type == ncclFloat64 ? sizeof(double) : sizeof(float); }

/// Whether `data` is device (or managed) memory, which NCCL reads as it is; host memory is staged.
inline bool on_device(const void* data) {
  cudaPointerAttributes attributes{};
  CUPIPE_CHECK_CUDA(cudaPointerGetAttributes(&attributes, data));
  return attributes.type == cudaMemoryTypeDevice || attributes.type == cudaMemoryTypeManaged;
}

}  // namespace cupipe::comm::detail
