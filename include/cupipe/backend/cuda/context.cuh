// SPDX-License-Identifier: Apache-2.0
// backend::cuda::Context: what one backend::Cuda<T> owns on its device. A stream, the memory pool, the
// cuBLASLt handle, the GEMM workspace and plan cache, a grow-only scratch area for ops that need
// temporaries, a device-side error record that kernels fill when they meet bad input (a label or
// token id out of range) and the host turns into a cupipe::error, and the peers its device was
// given direct access to.
//
// A context can also run a stretch of work on a second ("side") stream of the same device, beside its
// own: DualPipeV's overlapped F&B pair runs the F there while the B runs on the main stream.
// overlap_begin() makes the side stream wait for the main stream's work so far and sends later ops
// there (with their own GEMM workspace and scratch, since both streams run at once); overlap_end()
// sends later ops back to the main stream, which now runs beside the side stream; overlap_join()
// makes the main stream wait for the side stream. The pool holds released blocks back from reuse
// from overlap_begin() to overlap_join() (DevicePool::defer_releases). Hand-overs into a context
// wait on its main stream (main_stream()), so a sender never reads which stream is active.
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

namespace cupipe::backend::cuda {

/// What a kernel found wrong with its input; code 0 means nothing.
struct DeviceError {
  std::int32_t code = 0;
  std::int32_t row = 0;
  long long value = 0;
};

/// Codes a kernel writes into the DeviceError record.
enum DeviceErrorCode : std::int32_t { no_error = 0, label_out_of_range = 1, token_id_out_of_range = 2, moe_slot_out_of_range = 3 };

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
    if (side_) (void)cudaStreamSynchronize(*side_);
    (void)pool_.defer_releases(false);
    side_gemm_workspace_ = DeviceBuffer<std::byte>();
    side_scratch_ = DeviceBuffer<std::byte>();
    plans_.clear();
    error_ = DeviceBuffer<DeviceError>();
    scratch_ = DeviceBuffer<std::byte>();
    gemm_workspace_ = DeviceBuffer<std::byte>();
    pool_.trim();
  }  // then the members: the handle and the pinned record free themselves

  int device() const noexcept { return device_; }
  /// The stream ops enqueue on: the main stream, or the side stream between overlap_begin() and
  /// overlap_end(). Only the thread that drives this context may call it while an overlap is open.
  cudaStream_t stream() const noexcept { return on_side_ ? side_->get() : stream_.get(); }
  /// The context's own stream, whichever is active: what other contexts order hand-overs against.
  cudaStream_t main_stream() const noexcept { return stream_; }
  /// Whether an overlap is open (from overlap_begin() to overlap_join()).
  bool overlapping() const noexcept { return overlapping_; }

  /// Later ops run on the side stream, after the main stream's work so far.
  void overlap_begin() {
    CUPIPE_REQUIRE(!overlapping_, "backend::cuda::Context::overlap_begin: an overlap is already open on device ", device_,
                   " (overlap_join() closes it)");
    if (!side_) side_.emplace();  // each on its own: a throw part way leaves no half-made set
    if (!fork_) fork_.emplace(false);
    if (!join_) join_.emplace(false);
    fork_->record(stream_);
    side_->wait(*fork_);
    (void)pool_.defer_releases(true);
    overlapping_ = true;
    on_side_ = true;
  }
  /// Later ops run on the main stream again, beside what the side stream still has to do.
  void overlap_end() noexcept { on_side_ = false; }
  /// Whether ops go to the side stream now (an overlap open and not ended).
  bool on_side() const noexcept { return on_side_; }
  /// Sends later ops to the side stream (`side`, where an overlap is open) or to the main stream:
  /// for an overlapped pair whose F and B take turns (pipeline/paired_turns.hpp), each action's own
  /// stream when it takes its turn.
  void set_side(bool side) noexcept { on_side_ = side && overlapping_; }
  /// The main stream waits for the side stream; blocks released since overlap_begin() become
  /// reusable. Does nothing when no overlap is open.
  void overlap_join() {
    if (!overlapping_) return;
    on_side_ = false;
    overlapping_ = false;
    try {
      join_->record(*side_);
      stream_.wait(*join_);
    } catch (...) {  // no join on the device: wait on the host, so the held blocks are safe to reuse
      (void)cudaStreamSynchronize(*side_);
      (void)pool_.defer_releases(false);
      throw;
    }
    (void)pool_.defer_releases(false);  // fenced on the main stream, after its wait for the side stream
  }
  DevicePool& pool() noexcept { return pool_; }
  cublasLtHandle_t cublas_lt() const noexcept { return lt_.handle; }
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
  /// The side stream has its own, allocated on its first GEMM.
  void* gemm_workspace() {
    DeviceBuffer<std::byte>& workspace = on_side_ ? side_gemm_workspace_ : gemm_workspace_;
    if (workspace.empty()) workspace = DeviceBuffer<std::byte>(pool_, index_t(gemm_workspace_bytes), MemoryTag::workspace);
    return workspace.data();
  }

  /// At least `bytes` of device scratch, valid until the next call. Ops on this context's stream use
  /// it in stream order, so replacing it when it grows is safe. The side stream has its own (a block
  /// it gives up during an overlap is held back until the join).
  void* scratch(std::size_t bytes) {
    DeviceBuffer<std::byte>& scratch = on_side_ ? side_scratch_ : scratch_;
    if (bytes > scratch.bytes()) {
      scratch = DeviceBuffer<std::byte>();
      scratch = DeviceBuffer<std::byte>(pool_, index_t(DevicePool::block_size(bytes)), MemoryTag::workspace);
    }
    return scratch.data();
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

  /// Waits for the active stream, and returns (and clears) what kernels reported since the last call.
  DeviceError take_device_error() {
    CUPIPE_CHECK_CUDA(
        cudaMemcpyAsync(&readback_->error, error_.data(), sizeof(DeviceError), cudaMemcpyDeviceToHost, stream()));
    CUPIPE_CHECK_CUDA(cudaStreamSynchronize(stream()));
    const DeviceError found = readback_->error;
    if (found.code != no_error) CUPIPE_CHECK_CUDA(cudaMemsetAsync(error_.data(), 0, sizeof(DeviceError), stream()));
    return found;
  }

  /// Copies one value from device memory to the host, after the active stream's work, and waits for it.
  template <class U>
  U read_scalar(const U* device_value) {
    static_assert(sizeof(U) <= sizeof(Readback::scalar), "read_scalar: value too large");
    CUPIPE_CHECK_CUDA(cudaMemcpyAsync(readback_->scalar, device_value, sizeof(U), cudaMemcpyDeviceToHost, stream()));
    CUPIPE_CHECK_CUDA(cudaStreamSynchronize(stream()));
    U out;
    std::memcpy(&out, readback_->scalar, sizeof(U));
    return out;
  }

 private:
  // The guard keeps `device` current while the members and the body below are made.
  Context(const DeviceGuard&, int device, MemoryTracker& tracker) : device_(device), pool_(device_, tracker, stream_) {
    pool_.let_siblings_trim();  // another stage's pool on this device may empty this cache when short
    CUPIPE_CHECK_CUDA(cudaDeviceGetAttribute(&sm_count_, cudaDevAttrMultiProcessorCount, device_));
    CUPIPE_CHECK_CUDA(cudaDeviceGetAttribute(&l2_bytes_, cudaDevAttrL2CacheSize, device_));
    CUPIPE_CHECK_CUBLAS(cublasLtCreate(&lt_.handle));
    void* host = nullptr;
    CUPIPE_CHECK_CUDA(cudaMallocHost(&host, sizeof(Readback)));
    readback_.record = static_cast<Readback*>(host);
    error_ = DeviceBuffer<DeviceError>(pool_, 1, MemoryTag::workspace);
    CUPIPE_CHECK_CUDA(cudaMemsetAsync(error_.data(), 0, sizeof(DeviceError), stream_));
  }

  struct Readback {  // pinned, so the copies above are truly asynchronous
    DeviceError error;
    alignas(16) unsigned char scalar[16];
  };
  // Owners, so that a constructor step that throws frees what the steps before it made.
  struct LtHandle {
    cublasLtHandle_t handle = nullptr;
    LtHandle() = default;
    LtHandle(const LtHandle&) = delete;
    LtHandle& operator=(const LtHandle&) = delete;
    ~LtHandle() {
      if (handle) (void)cublasLtDestroy(handle);
    }
  };
  struct PinnedReadback {
    Readback* record = nullptr;
    PinnedReadback() = default;
    PinnedReadback(const PinnedReadback&) = delete;
    PinnedReadback& operator=(const PinnedReadback&) = delete;
    ~PinnedReadback() {
      if (record) (void)cudaFreeHost(record);
    }
    Readback* operator->() const noexcept { return record; }
  };

  int device_;
  Stream stream_;
  DevicePool pool_;
  int sm_count_ = 0;
  int l2_bytes_ = 0;
  LtHandle lt_;
  PinnedReadback readback_;
  GemmPlanCache plans_;
  ActionTimer timer_;
  std::optional<Event> handoff_;
  DeviceBuffer<std::byte> gemm_workspace_;
  DeviceBuffer<std::byte> scratch_;
  std::optional<Stream> side_;  // made on the first overlap
  std::optional<Event> fork_, join_;
  DeviceBuffer<std::byte> side_gemm_workspace_;
  DeviceBuffer<std::byte> side_scratch_;
  bool overlapping_ = false;
  bool on_side_ = false;
  DeviceBuffer<DeviceError> error_;
  std::mutex peers_mutex_;
  std::map<int, bool> peers_;  // peer device -> whether this device has direct access to it
};

}  // namespace cupipe::backend::cuda
