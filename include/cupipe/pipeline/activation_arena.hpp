// SPDX-License-Identifier: Apache-2.0
// ActivationArena: a virtual stage's per-microbatch buffers, laid out in one block before a step runs.
//
// A step's plan fixes, for each worker, the order of its actions, and the step plan fixes each
// microbatch's rows. Together they fix every buffer a stage's actions take for a microbatch (the
// forward's record, the backward's output gradients, the loss's gradient, the input gradient before
// it is sent) and the actions between which it lives. StageExecutor::prepare turns them into
// ArenaRequests; lay_out_arena gives each an offset in one block, so that two buffers live at the
// same time never share memory; and an action then takes its buffer as a pointer into the block: no
// pool search, no lock, no event query and no heap allocation on the hot path.
//
// Memory is accounted as the pool accounts it: a region counts under MemoryTag::activations from when
// an action takes it until the slot drops it, its requested bytes exactly, so measured peaks are the
// same with and without the arena. The block itself is reserved memory, as a pool's cached blocks
// are, and not counted under a tag.
//
// The pool stays for what the layout does not know: a step that was not laid out (post-validated
// runs, which overlap two steps), a microbatch whose rows differ from the layout's, predict(), and
// the messages, which the transport owns (LocalTransport recycles them on the host).
//
// Lifetimes are in the worker's action indices, inclusive. An overlapped F runs beside the B after
// it (schedule::Action::overlap), on a second stream where the backend has one; its buffers live at
// least until that B ends, so the B's buffers never share its memory. Stream order does the rest:
// every action of a worker runs on its main stream, or on the side stream forked from it after what
// came before, so a region a later action reuses is never still read by an earlier one.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <numeric>
#include <span>
#include <type_traits>
#include <utility>
#include <vector>

#include "cupipe/core/error.hpp"
#include "cupipe/core/memory.hpp"
#include "cupipe/core/tensor.hpp"

namespace cupipe::pipeline {

/// What a stage's actions take for a microbatch (see StageExecutor).
enum class ArenaRole : std::uint8_t {
  record,          ///< the forward's record, kept until the microbatch is done (B, or W when split)
  forward_record,  ///< with recomputation: the forward's record, dropped when the forward ends
  grad_record,     ///< per-layer output gradients of the backward, kept for W
  dy,              ///< the last stage's loss gradient
  dx,              ///< the input gradient, until it is sent
};
inline constexpr int arena_roles = 5;

/// One buffer of a step: `elements` values, live from the start of the worker's action `first`
/// to the end of its action `last`.
struct ArenaRequest {
  index_t elements = 0;
  int first = 0;
  int last = 0;

  bool overlaps(const ArenaRequest& o) const noexcept { return first <= o.last && o.first <= last; }
};

/// Offsets (in values, multiples of the alignment) for a list of requests, and the values a block
/// must hold for them all.
struct ArenaLayout {
  std::vector<index_t> offsets;
  index_t elements = 0;
};

namespace detail {
inline index_t round_up(index_t n, index_t to) noexcept { return (n + to - 1) / to * to; }
}  // namespace detail

/// Places the largest request first, each at the lowest offset clear of every placed request whose
/// lifetime overlaps its own (the greedy-by-size planner of TensorFlow Lite's arena). Two requests
/// live at the same time never share a value; each starts at a multiple of `alignment` values.
inline ArenaLayout lay_out_arena(std::span<const ArenaRequest> requests, index_t alignment) {
  CUPIPE_REQUIRE(alignment >= 1, "lay_out_arena: alignment ", alignment, " is not positive");
  ArenaLayout layout;
  layout.offsets.assign(requests.size(), 0);
  std::vector<std::size_t> order(requests.size());
  std::iota(order.begin(), order.end(), std::size_t{0});
  std::stable_sort(order.begin(), order.end(),
                   [&](std::size_t a, std::size_t b) { return requests[a].elements > requests[b].elements; });
  std::vector<std::size_t> placed;
  std::vector<std::pair<index_t, index_t>> busy;  // [begin, end) of placed requests live at the same time
  for (std::size_t i : order) {
    const ArenaRequest& r = requests[i];
    CUPIPE_REQUIRE(r.elements >= 0 && r.first <= r.last, "lay_out_arena: request ", i, " of ", r.elements,
                   " values from action ", r.first, " to ", r.last, " is not a buffer's lifetime");
    if (r.elements == 0) continue;
    const index_t size = detail::round_up(r.elements, alignment);
    busy.clear();
    for (std::size_t p : placed)
      if (requests[p].overlaps(r))
        busy.emplace_back(layout.offsets[p], layout.offsets[p] + detail::round_up(requests[p].elements, alignment));
    std::sort(busy.begin(), busy.end());
    index_t at = 0;
    for (const auto& [begin, end] : busy) {
      if (begin >= at + size) break;
      at = std::max(at, end);
    }
    layout.offsets[i] = at;
    layout.elements = std::max(layout.elements, at + size);
    placed.push_back(i);
  }
  return layout;
}

/// The most values live at once (each request rounded up to `alignment`): no layout is smaller.
inline index_t peak_live(std::span<const ArenaRequest> requests, index_t alignment) {
  index_t peak = 0;
  for (const ArenaRequest& at : requests) {  // the peak is at some request's start
    index_t live = 0;
    for (const ArenaRequest& r : requests)
      if (r.first <= at.first && at.first <= r.last) live += detail::round_up(r.elements, alignment);
    peak = std::max(peak, live);
  }
  return peak;
}

/// A microbatch's buffer on a stage: a region of the stage's arena, or a buffer of its own (from the
/// pool, or a received message). A region counts in its tracker while the slot holds it.
template <class Buffer>
class ArenaSlot {
 public:
  using value_type = std::remove_pointer_t<decltype(std::declval<Buffer&>().data())>;

  ArenaSlot() = default;
  ArenaSlot(Buffer owned) noexcept : owned_(std::move(owned)), data_(owned_.data()) {}  // NOLINT: a buffer is a slot
  ArenaSlot(ArenaSlot&& other) noexcept : owned_(std::move(other.owned_)) { take_region(other); }
  ArenaSlot& operator=(ArenaSlot&& other) noexcept {
    if (this != &other) {
      uncount();
      owned_ = std::move(other.owned_);
      take_region(other);
    }
    return *this;
  }
  ~ArenaSlot() { uncount(); }

  /// `count` values at `data`, an arena's, counted in `tracker` under MemoryTag::activations until
  /// the slot drops them.
  static ArenaSlot region(value_type* data, index_t count, MemoryTracker* tracker) noexcept {
    ArenaSlot slot;
    slot.data_ = data;
    slot.bytes_ = std::size_t(count) * sizeof(value_type);
    slot.tracker_ = tracker;
    if (tracker) tracker->allocate(MemoryTag::activations, slot.bytes_);
    return slot;
  }

  value_type* data() const noexcept { return data_; }
  /// Whether the memory is an arena's.
  bool planned() const noexcept { return data_ != nullptr && owned_.data() == nullptr; }
  /// The buffer it owns (empty for a region); the slot is empty after.
  Buffer release() noexcept {
    uncount();
    data_ = nullptr;
    return std::move(owned_);
  }

 private:
  /// Everything but the owned buffer, which the caller has moved.
  void take_region(ArenaSlot& other) noexcept {
    data_ = std::exchange(other.data_, nullptr);
    bytes_ = std::exchange(other.bytes_, 0);
    tracker_ = std::exchange(other.tracker_, nullptr);
  }
  void uncount() noexcept {
    if (tracker_) tracker_->release(MemoryTag::activations, bytes_);
    tracker_ = nullptr;
    bytes_ = 0;
  }

  Buffer owned_{};
  value_type* data_ = nullptr;
  std::size_t bytes_ = 0;
  MemoryTracker* tracker_ = nullptr;  // a region's, while counted
};

/// One request of a stage's step, with what it is for.
struct ArenaUse {
  int microbatch = 0;
  ArenaRole role = ArenaRole::record;
  ArenaRequest request;
};

/// A virtual stage's block and the layout of its step's buffers in it. Used by the stage's worker
/// thread only, and laid out between steps.
template <class Backend>
class ActivationArena {
 public:
  using T = typename Backend::value_type;
  using buffer = typename Backend::template buffer<T>;
  using slot = ArenaSlot<buffer>;
  /// Every region starts on a 256-byte boundary (a device's allocation granularity and wider than
  /// any vector load).
  static constexpr index_t alignment = index_t(256 / sizeof(T) > 0 ? 256 / sizeof(T) : 1);

  /// Lays out `uses` for `microbatches` microbatches. The block grows when the layout needs more (the
  /// old one is freed first), and never shrinks.
  void lay_out(Backend& be, int microbatches, std::span<const ArenaUse> uses) {
    requests_.clear();
    for (const ArenaUse& u : uses) requests_.push_back(u.request);
    const ArenaLayout layout = lay_out_arena(requests_, alignment);
    entries_.assign(std::size_t(microbatches) * arena_roles, Entry{});
    for (std::size_t i = 0; i < uses.size(); ++i) {
      const ArenaUse& u = uses[i];
      CUPIPE_REQUIRE(u.microbatch >= 0 && u.microbatch < microbatches, "ActivationArena: microbatch ", u.microbatch,
                     " of ", microbatches);
      entries_[index(u.microbatch, u.role)] = Entry{layout.offsets[i], u.request.elements};
    }
    if (layout.elements > block_.size()) {
      free_block();
      // Reserved, not counted: the regions count while in use (see the file comment).
      block_ = be.template allocate<T>(layout.elements, MemoryTag::activations);
      tracker_ = &be.memory;
      tracker_->release(MemoryTag::activations, block_bytes());
    }
    planned_ = layout.elements;
  }

  ActivationArena() = default;
  ActivationArena(const ActivationArena&) = delete;
  ActivationArena& operator=(const ActivationArena&) = delete;
  ~ActivationArena() { free_block(); }

  /// Microbatch j's buffer for `role`, of `elements` values: its region where the layout has one
  /// of that size, else a buffer from `be`'s pool. A region looks as a new buffer would
  /// (Backend::mark_unwritten: the host backend's poison).
  slot take(Backend& be, int j, ArenaRole role, index_t elements) {
    if (j >= 0 && index(j, role) < entries_.size()) {
      const Entry& e = entries_[index(j, role)];
      if (e.elements == elements && elements > 0) {
        T* data = block_.data() + e.offset;
        if constexpr (requires { be.mark_unwritten(data, elements); }) be.mark_unwritten(data, elements);
        return slot::region(data, elements, &be.memory);
      }
    }
    return slot(be.template allocate<T>(elements, MemoryTag::activations));
  }

  /// Values of the current layout (0: none) and of the block.
  index_t planned_elements() const noexcept { return planned_; }
  index_t block_elements() const noexcept { return block_.size(); }

 private:
  struct Entry {
    index_t offset = 0;
    index_t elements = -1;  // none
  };
  static std::size_t index(int j, ArenaRole role) noexcept { return std::size_t(j) * arena_roles + std::size_t(role); }
  std::size_t block_bytes() const noexcept { return std::size_t(block_.size()) * sizeof(T); }
  /// The block's buffer releases its bytes from the tracker as it goes: count them back first.
  void free_block() noexcept {
    if (tracker_ && block_.data()) tracker_->allocate(MemoryTag::activations, block_bytes());
    block_ = buffer{};
  }

  buffer block_{};
  MemoryTracker* tracker_ = nullptr;
  std::vector<Entry> entries_;
  std::vector<ArenaRequest> requests_;
  index_t planned_ = 0;
};

}  // namespace cupipe::pipeline
