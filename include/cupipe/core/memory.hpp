// SPDX-License-Identifier: Apache-2.0
// Memory accounting by purpose. Every allocation cupipe makes for a stage is tagged, so the peak
// bytes reported for activations or weights are measured, not estimated.
#pragma once

#include <array>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <string_view>

namespace cupipe {

enum class MemoryTag : std::uint8_t { weights, gradients, optimizer, activations, workspace };
inline constexpr std::size_t memory_tag_count = 5;

constexpr std::string_view name(MemoryTag tag) noexcept {
  constexpr std::array<std::string_view, memory_tag_count> names{"weights", "gradients", "optimizer",
                                                                  "activations", "workspace"};
  return names[static_cast<std::size_t>(tag)];
}

/// Bytes in use and their peak, per tag and in total. Thread-safe.
class MemoryTracker {
 public:
  void allocate(MemoryTag tag, std::size_t bytes) noexcept {
    bump(tags_[index(tag)], static_cast<std::int64_t>(bytes));
    bump(total_, static_cast<std::int64_t>(bytes));
  }
  void release(MemoryTag tag, std::size_t bytes) noexcept {
    tags_[index(tag)].in_use.fetch_sub(static_cast<std::int64_t>(bytes), std::memory_order_relaxed);
    total_.in_use.fetch_sub(static_cast<std::int64_t>(bytes), std::memory_order_relaxed);
  }

  std::int64_t in_use(MemoryTag tag) const noexcept { return tags_[index(tag)].in_use.load(); }
  std::int64_t peak(MemoryTag tag) const noexcept { return tags_[index(tag)].peak.load(); }
  std::int64_t in_use() const noexcept { return total_.in_use.load(); }
  std::int64_t peak() const noexcept { return total_.peak.load(); }

  /// Restarts peak tracking from what is in use now (e.g. at the start of a training step).
  void reset_peaks() noexcept {
    for (auto& c : tags_) c.peak.store(c.in_use.load());
    total_.peak.store(total_.in_use.load());
  }

 private:
  struct Counter {
    std::atomic<std::int64_t> in_use{0};
    std::atomic<std::int64_t> peak{0};
  };
  static constexpr std::size_t index(MemoryTag tag) noexcept { return static_cast<std::size_t>(tag); }
  static void bump(Counter& c, std::int64_t bytes) noexcept {
    const std::int64_t now = c.in_use.fetch_add(bytes, std::memory_order_relaxed) + bytes;
    std::int64_t seen = c.peak.load(std::memory_order_relaxed);
    while (now > seen && !c.peak.compare_exchange_weak(seen, now, std::memory_order_relaxed)) {
    }
  }

  std::array<Counter, memory_tag_count> tags_{};
  Counter total_{};
};

/// Bytes one parameter holds in a stage: `versions` stored copies (`value_bytes` each), and its
/// gradient, `optimizer_slots` optimizer values and, where the stored type is narrower than the
/// compute type, a master copy (`compute_bytes` each; 0 means value_bytes). What the memory plan and
/// the planner count.
constexpr double parameter_state_bytes(int value_bytes, int compute_bytes, int optimizer_slots, int versions) noexcept {
  const int compute = compute_bytes > 0 ? compute_bytes : value_bytes;
  const int master = compute != value_bytes ? 1 : 0;
  return double(value_bytes) * double(versions) + double(compute) * double(1 + optimizer_slots + master);
}

}  // namespace cupipe
