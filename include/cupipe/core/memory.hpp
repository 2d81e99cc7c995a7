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

/// A run's ZeRO setting (PipelineOptions::zero, reshard_after_forward) and its data-parallel
/// replicas: what shards the parameter state.
struct ZeroSetting {
  int stage = 0;     ///< 0 off, 1 optimizer state, 2 and gradients, 3 and weights
  int replicas = 1;  ///< data-parallel replicas the shards are over (ZeRO changes nothing at 1)
  bool reshard_after_forward = true;
};

/// One worker's parameter state by the allocator's tags: weights (in use and master), gradients and
/// optimizer slots.
struct StateBytes {
  double weights = 0, gradients = 0, optimizer = 0;
  constexpr double total() const noexcept { return weights + gradients + optimizer; }
};

/// The bytes of a worker's parameter state under `zero`: `params` parameters over its virtual
/// stages, the largest of which holds `largest_stage`; sizes as parameter_state_bytes. `in_step`:
/// the most each tag holds within a flush step; else between steps. With replicas, per tag:
/// - weights: ZeRO-0 to 2, `versions` copies and the master; ZeRO-3, the shard (compute type) and,
///   within a step, the gathered whole weights of one virtual stage (reshard_after_forward) or of
///   all of them;
/// - gradients: the whole (ZeRO-0, 1); with ZeRO-2 and 3 the shard and, within a step, the whole
///   buffer the backward accumulates into;
/// - optimizer: its slots, the shard's only with ZeRO-1 and up.
/// A shard is params / replicas here; the runtime's is ceil(n / replicas) of each stage's n, or
/// fewer on the last replicas (at most one value more per stage and array).
constexpr StateBytes sharded_state_bytes(double params, double largest_stage, int value_bytes, int compute_bytes,
                                         int optimizer_slots, int versions, ZeroSetting zero, bool in_step) noexcept {
  const double v = double(value_bytes), c = double(compute_bytes > 0 ? compute_bytes : value_bytes);
  const double master = c != v ? 1.0 : 0.0;
  const int stage = zero.replicas > 1 ? zero.stage : 0;
  const double shard = params / double(zero.replicas > 1 ? zero.replicas : 1);
  StateBytes b;
  b.weights = stage >= 3 ? c * shard + (in_step ? v * (zero.reshard_after_forward ? largest_stage : params) : 0.0)
                         : params * (v * double(versions) + c * master);
  b.gradients = stage >= 2 ? c * shard + (in_step ? c * params : 0.0) : c * params;
  b.optimizer = c * double(optimizer_slots) * (stage >= 1 ? shard : params);
  return b;
}

}  // namespace cupipe
