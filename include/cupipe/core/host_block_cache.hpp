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
#include <cstdint>
#include <cstring>
#include <iterator>
#include <limits>
#include <map>
#include <mutex>
#include <new>

namespace cupipe {

/// What a new host block holds: zeros (HostBuffer's default), 0xFF bytes (a NaN in every float
/// type, -1 in every signed integer: see backend::Host's poison) or whatever its last user left.
enum class BlockFill { zero, poison, none };

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
#if defined(__SANITIZE_THREAD__)
inline constexpr bool thread_sanitizer = true;
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer)
inline constexpr bool thread_sanitizer = true;
#else
inline constexpr bool thread_sanitizer = false;
#endif
#else
inline constexpr bool thread_sanitizer = false;
#endif
}  // namespace detail

/// Process-wide, thread-safe. Blocks below `smallest` bytes go to the allocator as before; larger
/// ones are cached on free up to `capacity` bytes in all; to make room for a freed block the ones
/// freed longest ago go back to the allocator. So sizes a process stopped using (a calibration's
/// profiles before training, another layout's activations) give way to the sizes it uses now,
/// instead of filling the cache and leaving every new block to page-fault. Under AddressSanitizer
/// and ThreadSanitizer nothing is cached.
class HostBlockCache {
 public:
  static constexpr std::size_t smallest = std::size_t(128) << 10;
  static constexpr std::size_t alignment = 64;

  /// The one cache (never destroyed, so buffers freed during static destruction still find it).
  static HostBlockCache& instance() {
    static HostBlockCache* cache = new HostBlockCache;
    return *cache;
  }

  /// A block of `bytes` (at least 1), filled as `fill` says, from the cache where one of its size
  /// waits (the one freed last). Where the allocator has no memory left, the cache frees what it
  /// holds and tries once more.
  void* allocate(std::size_t bytes, BlockFill fill = BlockFill::zero) {
    const std::size_t size = rounded(bytes);
    void* block = cached(size) ? take(size) : nullptr;
    if (block == nullptr) {
      try {
        block = ::operator new(size, std::align_val_t(alignment));
      } catch (const std::bad_alloc&) {
        trim();
        block = ::operator new(size, std::align_val_t(alignment));
      }
    }
    // Outside the lock: other workers' allocations do not wait for it.
    if (fill != BlockFill::none) std::memset(block, fill == BlockFill::zero ? 0 : 0xFF, size);
    return block;
  }

  /// Returns a block allocate(bytes) gave. Where the cache is full, the blocks freed longest ago
  /// make room; a block larger than the whole capacity is freed.
  void release(void* block, std::size_t bytes) noexcept {
    if (block == nullptr) return;
    const std::size_t size = rounded(bytes);
    if (cached(size)) {
      std::lock_guard lock(mutex_);
      if (size <= capacity_) {
        while (held_ + size > capacity_ && !free_.empty()) free_oldest();
        try {
          free_.emplace(size, Entry{++clock_, block});
          held_ += size;
          return;
        } catch (...) {  // no memory for the map's node: free the block below
        }
      }
    }
    ::operator delete(block, std::align_val_t(alignment));
  }

  /// Frees every cached block (the blocks in use stay).
  void trim() noexcept {
    std::lock_guard lock(mutex_);
    for (const auto& [size, entry] : free_) ::operator delete(entry.block, std::align_val_t(alignment));
    free_.clear();
    held_ = 0;
  }

  /// Caps the bytes held for reuse (default 1 GiB); 0 caches nothing. Trims what is over it.
  void set_capacity(std::size_t bytes) noexcept {
    std::lock_guard lock(mutex_);
    capacity_ = bytes;
    while (held_ > capacity_ && !free_.empty()) free_oldest();
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
    if (b > std::numeric_limits<std::size_t>::max() - 4095) throw std::bad_alloc();
    return b < smallest ? b : (b + 4095) / 4096 * 4096;  // whole pages: near sizes share blocks
  }
  /// Under AddressSanitizer or ThreadSanitizer nothing is cached, so a use after free or a race on
  /// reused memory is still caught.
  static bool cached(std::size_t size) {
    return !detail::address_sanitizer && !detail::thread_sanitizer && size >= smallest;
  }
  /// The cached block of `size` freed last (its pages are the likeliest to be warm), or null.
  void* take(std::size_t size) {
    std::lock_guard lock(mutex_);
    const auto end = free_.upper_bound(size);
    if (end == free_.begin() || std::prev(end)->first != size) return nullptr;
    const auto it = std::prev(end);
    void* block = it->second.block;
    free_.erase(it);
    held_ -= size;
    ++reused_;
    return block;
  }

  /// Frees the cached block released longest ago; the caller holds the lock and has a block.
  void free_oldest() noexcept {
    auto oldest = free_.begin();
    for (auto it = free_.begin(); it != free_.end(); ++it)
      if (it->second.age < oldest->second.age) oldest = it;
    held_ -= oldest->first;
    ::operator delete(oldest->second.block, std::align_val_t(alignment));
    free_.erase(oldest);
  }

  struct Entry {
    std::uint64_t age;  ///< when it was released (clock_)
    void* block;
  };
  mutable std::mutex mutex_;
  std::multimap<std::size_t, Entry> free_;  ///< by size; within a size, in the order released
  std::uint64_t clock_ = 0;
  std::size_t held_ = 0, reused_ = 0;
  std::size_t capacity_ = std::size_t(1) << 30;
};

}  // namespace cupipe
