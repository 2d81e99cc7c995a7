// SPDX-License-Identifier: Apache-2.0
// DevicePool: a caching device allocator with exact accounting, and DeviceBuffer<T>, the owner of one
// block from it.
//
// - A pool serves one device and one stream: a block released while kernels on that stream may still
//   read it is handed out again to work enqueued later on the same stream, so reuse by the owner is
//   stream-ordered and needs no wait.
// - Another stream may write into a block of this pool (a pipeline hand-over copies on the sender's
//   stream into a buffer the receiver owns). For that, a pool made with its stream records a release
//   event on that stream when a block comes back; while that event is pending it is the block's
//   reuse_fence(), which a foreign writer makes its stream wait on before writing. So a block is
//   never overwritten before the work that read it last has finished, without host synchronisation.
// - While the owner's context runs work on a second stream (Context::overlap_begin .. overlap_join),
//   released blocks are held back (defer_releases): a block the side stream may still use is not
//   handed to the main stream until the main stream has waited for the side stream; then the held
//   blocks enter the cache with fences recorded on the main stream, after that wait.
// - A cudaMalloc that runs out of memory trims this pool's cache and tries again, then trims the
//   caches of the other stages' pools on the same device (those that let_siblings_trim()) and tries
//   once more, before it throws.
// - Requested bytes are accounted exactly to a MemoryTracker under each buffer's tag (that is what
//   peaks report); the bytes taken from the driver (rounded, cached ones included) are counted apart.
#pragma once

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstddef>
#include <map>
#include <mutex>
#include <utility>
#include <vector>

#include "cupipe/backend/cuda/check.cuh"
#include "cupipe/backend/cuda/device_guard.cuh"
#include "cupipe/core/error.hpp"
#include "cupipe/core/memory.hpp"
#include "cupipe/core/shape.hpp"
#include "cupipe/core/tensor.hpp"

namespace cupipe::backend::cuda {

class DevicePool {
 public:
  /// Blocks are rounded up to this many bytes, which also keeps every block 16-byte aligned for
  /// vector loads (cudaMalloc itself returns 256-byte aligned memory).
  static constexpr std::size_t granularity = 512;

  /// A pool for `device`. With `stream` (the owner's stream) released blocks get reuse fences.
  DevicePool(int device, MemoryTracker& tracker, cudaStream_t stream = nullptr)
      : device_(device), tracker_(&tracker), stream_(stream) {}

  /// Lets a pool on the same device that runs out of memory empty this pool's cache (the pools of
  /// the pipeline's contexts opt in; a communicator's, whose blocks NCCL kernels may be waiting on,
  /// does not).
  void let_siblings_trim() {
    std::lock_guard lock(registry_mutex());
    if (std::find(registry().begin(), registry().end(), this) == registry().end()) registry().push_back(this);
  }
  DevicePool(const DevicePool&) = delete;
  DevicePool& operator=(const DevicePool&) = delete;
  ~DevicePool() {
    {
      std::lock_guard lock(registry_mutex());
      auto& pools = registry();
      pools.erase(std::remove(pools.begin(), pools.end(), this), pools.end());
    }
    trim();
    std::lock_guard lock(mutex_);
    for (auto& [ptr, event] : fences_) (void)cudaEventDestroy(event);
    for (cudaEvent_t event : spare_events_) (void)cudaEventDestroy(event);
    for (const Held& held : held_) (void)cudaFree(held.ptr);  // cudaFree waits for the device first
  }

  static constexpr std::size_t block_size(std::size_t bytes) noexcept {
    return (bytes + granularity - 1) / granularity * granularity;
  }

  /// A block of at least `bytes` (nullptr for 0), accounted under `tag`. Its contents are undefined.
  void* allocate(std::size_t bytes, MemoryTag tag) {
    if (bytes == 0) return nullptr;
    const std::size_t size = block_size(bytes);
    void* ptr = nullptr;
    {
      std::lock_guard lock(mutex_);
      if (auto it = free_.find(size); it != free_.end() && !it->second.empty()) {
        ptr = it->second.back();
        it->second.pop_back();
        cached_ -= size;
        // A fence that has already passed protects nothing; recycle its event at once.
        if (auto fence = fences_.find(ptr); fence != fences_.end() && event_done(fence->second)) {
          spare_events_.push_back(fence->second);
          fences_.erase(fence);
        }
      }
    }
    if (!ptr) ptr = fresh_block(size, bytes, tag);
    tracker_->allocate(tag, bytes);
    return ptr;
  }

  /// Returns a block from allocate(bytes, tag) to the cache. Call it after enqueuing the last work
  /// that uses the block on the owner's stream: the reuse fence is recorded there.
  void release(void* ptr, std::size_t bytes, MemoryTag tag) noexcept {
    if (!ptr) return;
    tracker_->release(tag, bytes);
    const std::size_t size = block_size(bytes);
    std::lock_guard lock(mutex_);
    try {
      if (holding_) {
        held_.push_back({ptr, size});
        return;
      }
      cache(ptr, size);
    } catch (...) {  // no memory to remember it: give it back to the driver instead
      (void)cudaFree(ptr);
      reserved_ -= size;
    }
  }

  /// From defer_releases(true) on, released blocks are held back from reuse; defer_releases(false)
  /// caches them, fencing each on the owner's stream as it is now. Call it with false once the owner's
  /// stream has waited for every other stream that used them. Returns how many blocks it cached.
  std::size_t defer_releases(bool on) noexcept {
    std::lock_guard lock(mutex_);
    holding_ = on;
    if (on) return 0;
    const std::size_t count = held_.size();
    for (const Held& held : held_) {
      try {
        cache(held.ptr, held.size);
      } catch (...) {
        (void)cudaFree(held.ptr);
        reserved_ -= held.size;
      }
    }
    held_.clear();
    return count;
  }

  /// The event a stream other than the owner's must wait for before writing into the block at
  /// `ptr` (handed out by allocate()): the owner's last use of it before it was reused. Null when
  /// there is nothing to wait for. Valid until the block is released.
  cudaEvent_t reuse_fence(const void* ptr) const {
    std::lock_guard lock(mutex_);
    const auto it = fences_.find(ptr);
    return it == fences_.end() ? nullptr : it->second;
  }

  /// Frees every cached block back to the driver (blocks in use are untouched). cudaFree waits for
  /// the device, so pending reads of a cached block finish first.
  void trim() noexcept {
    std::lock_guard lock(mutex_);
    for (auto& [size, blocks] : free_) {
      for (void* ptr : blocks) {
        if (auto fence = fences_.find(ptr); fence != fences_.end()) {
          spare_events_.push_back(fence->second);
          fences_.erase(fence);
        }
        (void)cudaFree(ptr);
      }
      reserved_ -= size * blocks.size();
    }
    free_.clear();
    cached_ = 0;
  }

  int device() const noexcept { return device_; }
  MemoryTracker& tracker() const noexcept { return *tracker_; }
  /// Bytes held from the driver: blocks in use plus cached ones, rounded to the granularity.
  std::size_t reserved_bytes() const {
    std::lock_guard lock(mutex_);
    return reserved_;
  }
  std::size_t peak_reserved_bytes() const {
    std::lock_guard lock(mutex_);
    return peak_reserved_;
  }
  /// Bytes in released blocks waiting for reuse.
  std::size_t cached_bytes() const {
    std::lock_guard lock(mutex_);
    return cached_;
  }
  /// How many times the pool called cudaMalloc (a cache hit does not).
  std::size_t driver_allocations() const {
    std::lock_guard lock(mutex_);
    return driver_allocations_;
  }

 private:
  void* fresh_block(std::size_t size, std::size_t bytes, MemoryTag tag) {
    void* ptr = nullptr;
    const DeviceGuard guard(device_);  // cudaMalloc allocates on the current device
    cudaError_t status = cudaMalloc(&ptr, size);
    if (status == cudaErrorMemoryAllocation) {  // cached blocks of other sizes may be in the way
      (void)cudaGetLastError();
      trim();
      status = cudaMalloc(&ptr, size);
    }
    if (status == cudaErrorMemoryAllocation) {  // so may the caches of other stages on this device
      (void)cudaGetLastError();
      if (trim_siblings() > 0) status = cudaMalloc(&ptr, size);
    }
    if (status != cudaSuccess) {
      (void)cudaGetLastError();
      ::cupipe::detail::throw_error(
          ::cupipe::detail::str("device pool on device ", device_, ": cannot allocate ", bytes, " bytes for ",
                                name(tag), " (", tracker_->in_use(), " bytes in use): ", cudaGetErrorString(status)),
          "cudaMalloc", __FILE__, __LINE__);
    }
    std::lock_guard lock(mutex_);
    reserved_ += size;
    ++driver_allocations_;
    if (reserved_ > peak_reserved_) peak_reserved_ = reserved_;
    return ptr;
  }

  // Every pool in the process, so that one short of memory can empty its siblings' caches. Lock
  // order: the registry, then a pool's own mutex (nothing takes them the other way round).
  static std::mutex& registry_mutex() {
    static std::mutex mutex;
    return mutex;
  }
  static std::vector<DevicePool*>& registry() {
    static std::vector<DevicePool*> pools;
    return pools;
  }

  /// Trims the other pools on this device; returns the bytes their caches gave back.
  std::size_t trim_siblings() noexcept {
    std::size_t freed = 0;
    std::lock_guard lock(registry_mutex());
    for (DevicePool* pool : registry()) {
      if (pool == this || pool->device_ != device_) continue;
      const std::size_t before = pool->cached_bytes();
      pool->trim();  // cudaFree waits for the device, so pending reads of those blocks finish first
      freed += before;
    }
    return freed;
  }

  /// Puts a released block into the cache behind its reuse fence (mutex held).
  void cache(void* ptr, std::size_t size) {
    if (stream_) record_fence(ptr);
    free_[size].push_back(ptr);
    cached_ += size;
  }

  static bool event_done(cudaEvent_t event) noexcept {
    const cudaError_t status = cudaEventQuery(event);
    if (status == cudaSuccess) return true;
    (void)cudaGetLastError();  // cudaErrorNotReady is not an error to report later
    return false;
  }

  /// Records the block's reuse fence on the owner's stream (mutex held). Where an event cannot be
  /// made or recorded, waits for the stream instead, so the block is safe for any writer.
  void record_fence(void* ptr) noexcept {
    cudaEvent_t event = nullptr;
    if (auto it = fences_.find(ptr); it != fences_.end()) {
      event = it->second;
      fences_.erase(it);
    } else if (!spare_events_.empty()) {
      event = spare_events_.back();
      spare_events_.pop_back();
    } else {
      // An event lives on the device current at its creation and must match the stream's.
      const DeviceGuard guard(device_, std::nothrow);
      if (cudaEventCreateWithFlags(&event, cudaEventDisableTiming) != cudaSuccess) event = nullptr;
    }
    if (event && cudaEventRecord(event, stream_) == cudaSuccess) {
      try {
        fences_.emplace(ptr, event);
        return;
      } catch (...) {
      }
    }
    (void)cudaGetLastError();
    if (event) (void)cudaEventDestroy(event);
    (void)cudaStreamSynchronize(stream_);
  }

  int device_;
  MemoryTracker* tracker_;
  cudaStream_t stream_ = nullptr;
  mutable std::mutex mutex_;
  std::map<std::size_t, std::vector<void*>> free_;
  std::map<const void*, cudaEvent_t> fences_;  ///< pending release events, by block
  std::vector<cudaEvent_t> spare_events_;
  struct Held {
    void* ptr;
    std::size_t size;
  };
  std::vector<Held> held_;  ///< released while defer_releases(true), not yet reusable
  bool holding_ = false;
  std::size_t cached_ = 0;
  std::size_t reserved_ = 0;
  std::size_t peak_reserved_ = 0;
  std::size_t driver_allocations_ = 0;
};

/// An owning, uninitialised device array from a DevicePool, accounted under a tag. Move-only.
template <class T>
class DeviceBuffer {
 public:
  using value_type = T;

  DeviceBuffer() = default;
  DeviceBuffer(DevicePool& pool, index_t count, MemoryTag tag) : pool_(&pool), size_(count), tag_(tag) {
    CUPIPE_REQUIRE(count >= 0, "negative device buffer size ", count);
    data_ = static_cast<T*>(pool.allocate(bytes(), tag));
  }
  DeviceBuffer(DeviceBuffer&& other) noexcept { swap(other); }
  DeviceBuffer& operator=(DeviceBuffer&& other) noexcept {
    DeviceBuffer(std::move(other)).swap(*this);
    return *this;
  }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  ~DeviceBuffer() {
    if (pool_) pool_->release(data_, bytes(), tag_);
  }

  void swap(DeviceBuffer& other) noexcept {
    std::swap(pool_, other.pool_);
    std::swap(data_, other.data_);
    std::swap(size_, other.size_);
    std::swap(tag_, other.tag_);
  }

  T* data() noexcept { return data_; }
  const T* data() const noexcept { return data_; }
  index_t size() const noexcept { return size_; }
  bool empty() const noexcept { return size_ == 0; }
  std::size_t bytes() const noexcept { return static_cast<std::size_t>(size_) * sizeof(T); }
  MemoryTag tag() const noexcept { return tag_; }

  /// A view of the first shape.numel() elements; throws if the buffer is too small.
  DeviceView<T> view(Shape shape) {
    CUPIPE_REQUIRE(shape.numel() <= size_, "device buffer of ", size_, " elements is too small for shape ", shape);
    return {data_, shape};
  }
  DeviceConstView<T> view(Shape shape) const {
    CUPIPE_REQUIRE(shape.numel() <= size_, "device buffer of ", size_, " elements is too small for shape ", shape);
    return {data_, shape};
  }

 private:
  DevicePool* pool_ = nullptr;
  T* data_ = nullptr;
  index_t size_ = 0;
  MemoryTag tag_ = MemoryTag::workspace;
};

}  // namespace cupipe::backend::cuda
