// SPDX-License-Identifier: Apache-2.0
// gpu::Context: what one backend::Cuda<T> owns on its device. A stream, the memory pool, the
// cuBLASLt handle, the GEMM workspace and plan cache, a grow-only scratch area for ops that need
// temporaries, a device-side error record that kernels fill when they meet bad input (a label or
// token id out of range) and the host turns into a cupipe::error, and the peers its device was
// given direct access to.
#pragma once

#include <cublasLt.h>
#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <map>
#include <mutex>
#include <optional>

#include "cupipe/backend/cuda/check.cuh"
#include "cupipe/backend/cuda/gemm_plan.cuh"
#include "cupipe/backend/cuda/memory_pool.cuh"
#include "cupipe/backend/cuda/stream.cuh"
#include "cupipe/backend/cuda/timeline.cuh"
#include "cupipe/core/error.hpp"
#include "cupipe/core/memory.hpp"

namespace cupipe::gpu {

/// What a kernel found wrong with its input; code 0 means nothing.
struct DeviceError {
  std::int32_t code = 0;
  std::int32_t row = 0;
  long long value = 0;
};

/// Codes a kernel writes into the DeviceError record.
enum DeviceErrorCode : std::int32_t { no_error = 0, label_out_of_range = 1, token_id_out_of_range = 2 };

namespace detail {
inline int checked_device(int device) {
  int count = 0;
  CUPIPE_CHECK_CUDA(cudaGetDeviceCount(&count));
  CUPIPE_REQUIRE(device >= 0 && device < count, "CUDA device ", device, " does not exist (", count,
                 count == 1 ? " device" : " devices", " present)");
  return device;
}
}  // namespace detail

class Context {
 public:
  /// cuBLASLt's own recommendation for Hopper; also enough for every Ampere kernel.
  static constexpr std::size_t gemm_workspace_bytes = std::size_t(32) << 20;

  /// Everything is made on `device`; the caller's current device is unchanged afterwards.
  Context(int device, MemoryTracker& tracker) : Context(DeviceGuard(detail::checked_device(device)), device, tracker) {}
  Context(const Context&) = delete;
  Context& operator=(const Context&) = delete;
  ~Context() {
    DeviceGuard guard(device_, std::nothrow);
    (void)cudaStreamSynchronize(stream_);
    plans_.clear();
    error_ = DeviceBuffer<DeviceError>();
    scratch_ = DeviceBuffer<std::byte>();
    gemm_workspace_ = DeviceBuffer<std::byte>();
    pool_.trim();
    if (readback_) (void)cudaFreeHost(readback_);
    if (lt_) cublasLtDestroy(lt_);
  }

  int device() const noexcept { return device_; }
  cudaStream_t stream() const noexcept { return stream_; }
  DevicePool& pool() noexcept { return pool_; }
  cublasLtHandle_t cublas_lt() const noexcept { return lt_; }
  int sm_count() const noexcept { return sm_count_; }
  int l2_bytes() const noexcept { return l2_bytes_; }
  GemmPlanCache& gemm_plans() noexcept { return plans_; }

  /// Lets this context's device read and write `peer`'s memory directly where the hardware can
  /// (NVLink or PCIe), and says whether it can. Asks CUDA once per peer: peer access is a property
  /// of the device's CUDA context, so it stays on for the process.
  bool enable_peer_access(int peer) {
    std::lock_guard lock(peers_mutex_);
    if (const auto known = peers_.find(peer); known != peers_.end()) return known->second;
    int can = 0;
    CUPIPE_CHECK_CUDA(cudaDeviceCanAccessPeer(&can, device_, peer));
    if (can) {
      const DeviceGuard guard(device_);
      const cudaError_t status = cudaDeviceEnablePeerAccess(peer, 0);
      if (status == cudaErrorPeerAccessAlreadyEnabled)  // another context on this device did it
        (void)cudaGetLastError();
      else
        CUPIPE_CHECK_CUDA(status);
    }
    peers_.emplace(peer, can != 0);
    return can != 0;
  }

  /// The cuBLASLt workspace, allocated on the first GEMM (accounted as workspace).
  void* gemm_workspace() {
    if (gemm_workspace_.empty())
      gemm_workspace_ = DeviceBuffer<std::byte>(pool_, index_t(gemm_workspace_bytes), MemoryTag::workspace);
    return gemm_workspace_.data();
  }

  /// At least `bytes` of device scratch, valid until the next call. Ops on this context's stream use
  /// it in stream order, so replacing it when it grows is safe.
  void* scratch(std::size_t bytes) {
    if (bytes > scratch_.bytes()) {
      scratch_ = DeviceBuffer<std::byte>();
      scratch_ = DeviceBuffer<std::byte>(pool_, index_t(DevicePool::block_size(bytes)), MemoryTag::workspace);
    }
    return scratch_.data();
  }

  /// Device-side timestamps of pipeline steps on this context's stream.
  ActionTimer& timer() noexcept { return timer_; }

  /// The event a hand-over to another context records after its copy on this stream, for the
  /// receiver's stream to wait on. One per context: the receiver's wait is enqueued before this
  /// context records it again, and a wait uses the record current when it was enqueued.
  Event& handoff_event() {
    if (!handoff_) handoff_.emplace(false);
    return *handoff_;
  }

  /// The record kernels write bad-input reports into.
  DeviceError* device_error() noexcept { return error_.data(); }

  /// Waits for the stream, and returns (and clears) what kernels reported since the last call.
  DeviceError take_device_error() {
    CUPIPE_CHECK_CUDA(
        cudaMemcpyAsync(&readback_->error, error_.data(), sizeof(DeviceError), cudaMemcpyDeviceToHost, stream_));
    CUPIPE_CHECK_CUDA(cudaStreamSynchronize(stream_));
    const DeviceError found = readback_->error;
    if (found.code != no_error) CUPIPE_CHECK_CUDA(cudaMemsetAsync(error_.data(), 0, sizeof(DeviceError), stream_));
    return found;
  }

  /// Copies one value from device memory to the host and waits for it.
  template <class U>
  U read_scalar(const U* device_value) {
    static_assert(sizeof(U) <= sizeof(Readback::scalar), "read_scalar: value too large");
    CUPIPE_CHECK_CUDA(cudaMemcpyAsync(readback_->scalar, device_value, sizeof(U), cudaMemcpyDeviceToHost, stream_));
    CUPIPE_CHECK_CUDA(cudaStreamSynchronize(stream_));
    U out;
    std::memcpy(&out, readback_->scalar, sizeof(U));
    return out;
  }

 private:
  // The guard keeps `device` current while the members and the body below are made.
  Context(const DeviceGuard&, int device, MemoryTracker& tracker) : device_(device), pool_(device_, tracker, stream_) {
    CUPIPE_CHECK_CUDA(cudaDeviceGetAttribute(&sm_count_, cudaDevAttrMultiProcessorCount, device_));
    CUPIPE_CHECK_CUDA(cudaDeviceGetAttribute(&l2_bytes_, cudaDevAttrL2CacheSize, device_));
    CUPIPE_CHECK_CUBLAS(cublasLtCreate(&lt_));
    void* host = nullptr;
    CUPIPE_CHECK_CUDA(cudaMallocHost(&host, sizeof(Readback)));
    readback_ = static_cast<Readback*>(host);
    error_ = DeviceBuffer<DeviceError>(pool_, 1, MemoryTag::workspace);
    CUPIPE_CHECK_CUDA(cudaMemsetAsync(error_.data(), 0, sizeof(DeviceError), stream_));
  }

  struct Readback {  // pinned, so the copies above are truly asynchronous
    DeviceError error;
    alignas(16) unsigned char scalar[16];
  };

  int device_;
  Stream stream_;
  DevicePool pool_;
  int sm_count_ = 0;
  int l2_bytes_ = 0;
  cublasLtHandle_t lt_ = nullptr;
  Readback* readback_ = nullptr;
  GemmPlanCache plans_;
  ActionTimer timer_;
  std::optional<Event> handoff_;
  DeviceBuffer<std::byte> gemm_workspace_;
  DeviceBuffer<std::byte> scratch_;
  DeviceBuffer<DeviceError> error_;
  std::mutex peers_mutex_;
  std::map<int, bool> peers_;  // peer device -> whether this device has direct access to it
};

}  // namespace cupipe::gpu
