// SPDX-License-Identifier: Apache-2.0
// HostBlockCache: large host blocks kept for reuse by HostBuffer. glibc's malloc serves blocks of
// 128 KiB and more straight from mmap and gives them back with munmap on free, so a pipeline step
// that allocates its activations and frees them again page-faults on every page of every large
// buffer on every step (the kernel zeroes each page on the fault). On the 2-core VM that made the
// GPT's one-microbatch step 12-15% slower than its layers timed alone. Freed blocks of those sizes
// now wait here, by size, for the next allocation of the same size; a reused block is zeroed as a
// fresh one is, so HostBuffer's contents do not change.
#pragma once

#include <cstddef>
#include <cstring>
#include <iterator>
#include <map>
#include <mutex>
#include <new>

namespace cupipe {

namespace detail {
#if defined(__SANITIZE_ADDRESS__)
inline constexpr bool address_sanitizer = true;
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
inline constexpr bool address_sanitizer = true;
#else
inline constexpr bool address_sanitizer = false;
#endif
#else
inline constexpr bool address_sanitizer = false;
#endif
}  // namespace detail

/// Process-wide, thread-safe. Blocks below `smallest` bytes go to the allocator as before; larger
/// ones are cached on free up to `capacity` bytes in all (beyond it they are freed). Under
/// AddressSanitizer nothing is cached, so a use after free is still caught.
class HostBlockCache {
 public:
  static constexpr std::size_t smallest = std::size_t(128) << 10;
  static constexpr std::size_t alignment = 64;

  /// The one cache (never destroyed, so buffers freed during static destruction still find it).
  static HostBlockCache& instance() {
    static HostBlockCache* cache = new HostBlockCache;
    return *cache;
  }

  /// A zeroed block of `bytes` (at least 1), from the cache where one of its size waits.
  void* allocate(std::size_t bytes) {
    const std::size_t size = rounded(bytes);
    if (cached(size)) {
      std::lock_guard lock(mutex_);
      if (const auto it = free_.find(size); it != free_.end()) {
        void* block = it->second;
        free_.erase(it);
        held_ -= size;
        ++reused_;
        std::memset(block, 0, size);
        return block;
      }
    }
    void* block = ::operator new(size, std::align_val_t(alignment));
    std::memset(block, 0, size);
    return block;
  }

  /// Returns a block allocate(bytes) gave.
  void release(void* block, std::size_t bytes) noexcept {
    if (block == nullptr) return;
    const std::size_t size = rounded(bytes);
    if (cached(size)) {
      std::lock_guard lock(mutex_);
      if (held_ + size <= capacity_) {
        free_.emplace(size, block);
        held_ += size;
        return;
      }
    }
    ::operator delete(block, std::align_val_t(alignment));
  }

  /// Frees every cached block (the blocks in use stay).
  void trim() noexcept {
    std::lock_guard lock(mutex_);
    for (const auto& [size, block] : free_) ::operator delete(block, std::align_val_t(alignment));
    free_.clear();
    held_ = 0;
  }

  /// Caps the bytes held for reuse (default 1 GiB); 0 caches nothing. Trims what is over it.
  void set_capacity(std::size_t bytes) noexcept {
    std::lock_guard lock(mutex_);
    capacity_ = bytes;
    while (held_ > capacity_ && !free_.empty()) {
      const auto it = std::prev(free_.end());
      held_ -= it->first;
      ::operator delete(it->second, std::align_val_t(alignment));
      free_.erase(it);
    }
  }

  /// Bytes of freed blocks held for reuse, and how many allocations a cached block served.
  std::size_t held_bytes() const {
    std::lock_guard lock(mutex_);
    return held_;
  }
  std::size_t reused() const {
    std::lock_guard lock(mutex_);
    return reused_;
  }

 private:
  HostBlockCache() = default;
  static std::size_t rounded(std::size_t bytes) {
    const std::size_t b = bytes == 0 ? 1 : bytes;
    return b < smallest ? b : (b + 4095) / 4096 * 4096;  // whole pages: near sizes share blocks
  }
  static bool cached(std::size_t size) { return !detail::address_sanitizer && size >= smallest; }

  mutable std::mutex mutex_;
  std::multimap<std::size_t, void*> free_;
  std::size_t held_ = 0, reused_ = 0;
  std::size_t capacity_ = std::size_t(1) << 30;
};

}  // namespace cupipe
