// SPDX-License-Identifier: Apache-2.0
// Controllable-memory V schedules (Qi et al., "Pipeline Parallelism with Controllable Memory",
// NeurIPS 2024): V-Min and V-Half hold about 1/3 and 1/2 of 1F1B's activations; ZBV (zero_bubble.hpp)
// is the third point of the family, with 1F1B's memory and the smallest bubble.
#pragma once

#include <algorithm>
#include <array>
#include <cstdint>
#include <string_view>
#include <vector>

#include "cupipe/schedule/policies/zero_bubble.hpp"

namespace cupipe::schedule {

/// How much activation memory a V schedule may hold, against 1F1B's: the policy parameter of VShape.
enum class VMemory : std::uint8_t {
  min,   ///< V-Min: about 1/3, the largest bubble of the three
  half,  ///< V-Half: about 1/2
  full,  ///< ZBV: 1F1B's, the smallest bubble
};

namespace detail {

/// A worker's F/B times: [F chunk 0, F chunk 1, B chunk 1, B chunk 0][microbatch], in unit slots.
using VSlots = std::array<std::vector<int>, 4>;

/// The most chunk-microbatches worker `t` holds when each W runs in the next slot no F or B takes,
/// oldest B first (an F takes one, a W gives it back). `occupied` is scratch space.
constexpr int v_peak_memory(const VSlots& t, int horizon, std::vector<int>& occupied) {
  occupied.assign(static_cast<std::size_t>(horizon), -1);
  for (int k = 0; k < 4; ++k)
    for (int x : t[static_cast<std::size_t>(k)]) occupied[static_cast<std::size_t>(x)] = k;
  int held = 0, peak = 0, pending = 0;
  for (int s = 0; s < horizon; ++s) {
    const int k = occupied[static_cast<std::size_t>(s)];
    if (k >= 0) (k < 2 ? held : pending) += 1;
    else if (pending > 0) --pending, --held;
    peak = std::max(peak, held);
  }
  return peak;
}

/// Each worker's actions from the slots of its four kinds of action (F0, F1, B1, B0), in slot order,
/// each W in the first free slot after its B.
constexpr std::vector<std::vector<Action>> v_actions_from_slots(const std::vector<VSlots>& slots, int m, int horizon) {
  const int p = static_cast<int>(slots.size());
  std::vector<std::vector<Action>> out(static_cast<std::size_t>(p));
  constexpr std::array<Action, 4> kinds{Action{ActionKind::F, 0, 0}, Action{ActionKind::F, 0, 1},
                                        Action{ActionKind::B, 0, 1}, Action{ActionKind::B, 0, 0}};
  for (int r = 0; r < p; ++r) {
    std::vector<int> by_slot(static_cast<std::size_t>(horizon), -1);  // k * m + j
    for (int k = 0; k < 4; ++k)
      for (int j = 0; j < m; ++j) by_slot[static_cast<std::size_t>(slots[static_cast<std::size_t>(r)][static_cast<std::size_t>(k)][static_cast<std::size_t>(j)])] =
            k * m + j;
    auto& list = out[static_cast<std::size_t>(r)];
    std::vector<Action> weights;  // in the order of their B's
    std::size_t taken = 0;
    for (int s = 0; s < horizon; ++s) {
      if (const int id = by_slot[static_cast<std::size_t>(s)]; id >= 0) {
        Action a = kinds[static_cast<std::size_t>(id / m)];
        a.microbatch = id % m;
        list.push_back(a);
        if (a.kind == ActionKind::B) weights.push_back({ActionKind::W, a.microbatch, a.chunk});
      } else if (taken < weights.size()) {
        list.push_back(weights[taken++]);
      }
    }
  }
  return out;
}

/// V-Min and V-Half, built as the paper builds them: a building block (the slots of one microbatch's
/// F and B on every worker) repeated every 6 slots, so memory follows from each block's lifespans;
/// then a squeeze that moves warm-up and cool-down actions into earlier free slots wherever no worker's
/// peak grows; then each W in the first free slot after its B. The blocks are the stable patterns of
/// the authors' reference (sail-sg/zero-bubble-pipeline-parallelism, v_schedule); worker r, p workers:
///   V-Min   F0 r,   F1 2p-r-1,   B1 2p+d+r,      B0 4p+d-r-1    d = 2 if p % 3 == 0, else 0
///   V-Half  F0 2r,  F1 3p-r-2,   B1 3p+d+2r-1,   B0 6p+d-r-2    d = 3 if p is even, else 0
/// The slots assume F = B = W (as the paper does); the runtime order is what is kept.
constexpr std::vector<std::vector<Action>> controllable_v_actions(const Config& c, bool half) {
  const int p = c.stages;
  const int m = c.microbatches;
  constexpr int period = 6;  // F, B, W of two chunks
  std::vector<VSlots> slots(static_cast<std::size_t>(p));
  int horizon = 0;
  for (int r = 0; r < p; ++r) {
    const int d = half ? (p % 2 == 0 ? 3 : 0) : (p % 3 == 0 ? 2 : 0);
    const std::array<int, 4> block = half ? std::array<int, 4>{2 * r, 3 * p - r - 2, 3 * p + d + 2 * r - 1, 6 * p + d - r - 2}
                                          : std::array<int, 4>{r, 2 * p - r - 1, 2 * p + d + r, 4 * p + d - r - 1};
    for (std::size_t k = 0; k < 4; ++k)
      for (int j = 0; j < m; ++j) slots[static_cast<std::size_t>(r)][k].push_back(block[k] + period * j);
    horizon = std::max(horizon, block[3] + period * m);
  }
  horizon += 2 * period * m + 8;  // room for every W after the last B

  // Squeeze: actions outside worker 0's steady state (its first B of chunk 0 to its last F of
  // chunk 0), in slot order, each to the earliest free slot after its inputs that keeps every
  // worker within the block's peak.
  std::vector<int> scratch;
  int peak = 0;
  for (const VSlots& t : slots) peak = std::max(peak, v_peak_memory(t, horizon, scratch));
  struct Entry {
    int slot, worker, kind, microbatch;
  };
  std::vector<Entry> order;
  for (int r = 0; r < p; ++r)
    for (int k = 0; k < 4; ++k)
      for (int j = 0; j < m; ++j)
        order.push_back({slots[static_cast<std::size_t>(r)][static_cast<std::size_t>(k)][static_cast<std::size_t>(j)], r, k, j});
  std::sort(order.begin(), order.end(),
            [](const Entry& a, const Entry& b) { return a.slot != b.slot ? a.slot < b.slot : a.worker < b.worker; });
  const auto at = [&](int r, int k, int j) -> int& {
    return slots[static_cast<std::size_t>(r)][static_cast<std::size_t>(k)][static_cast<std::size_t>(j)];
  };
  const int steady_begin = at(0, 3, 0), steady_end = at(0, 0, m - 1);
  for (const Entry& e : order) {
    const int r = e.worker, k = e.kind, j = e.microbatch;
    int& slot = at(r, k, j);
    if (slot >= steady_begin && slot <= steady_end) continue;
    // The input: F0 from the worker above, F1 and B0 from the worker below (the turn at p-1 stays on
    // it), B1 from the worker above (the loss at worker 0 follows its own F1).
    int ready = -1;
    if (k == 0 && r > 0) ready = at(r - 1, 0, j);
    if (k == 1) ready = r == p - 1 ? at(r, 0, j) : at(r + 1, 1, j);
    if (k == 2) ready = r == 0 ? at(0, 1, j) : at(r - 1, 2, j);
    if (k == 3) ready = r == p - 1 ? at(r, 2, j) : at(r + 1, 3, j);
    if (j > 0) ready = std::max(ready, at(r, k, j - 1));  // microbatches of one kind keep their order
    const int original = slot;
    v_peak_memory(slots[static_cast<std::size_t>(r)], horizon, scratch);
    const std::vector<int> occupied = scratch;
    for (int s = ready + 1; s < original; ++s) {
      if (occupied[static_cast<std::size_t>(s)] >= 0) continue;
      slot = s;
      if (v_peak_memory(slots[static_cast<std::size_t>(r)], horizon, scratch) <= peak) break;
      slot = original;
    }
  }

  return v_actions_from_slots(slots, m, horizon);
}

}  // namespace detail

/// The controllable-memory V family on the V-shaped placement (as ZBV), B and W split: `Memory`
/// trades activation memory for bubble. VShape<VMemory::min> is V-Min, <half> V-Half, <full> ZBV.
template <VMemory Memory>
struct VShape : ZeroBubbleV {
  static constexpr std::string_view name = Memory == VMemory::min ? "v-min" : Memory == VMemory::half ? "v-half" : "zbv";
  static constexpr std::string_view summary =
      Memory == VMemory::min    ? "controllable-memory V: about 1/3 of 1F1B's activations, the largest bubble of the V family"
      : Memory == VMemory::half ? "controllable-memory V: about 1/2 of 1F1B's activations, a bubble between V-Min's and ZBV's"
                                : ZeroBubbleV::summary;
  static constexpr std::string_view check(const Config& c) {
    if (c.chunks == 2) return "";
    return Memory == VMemory::min    ? "V-Min runs exactly 2 chunks per stage (the V shape: down the workers and back up)"
           : Memory == VMemory::half ? "V-Half runs exactly 2 chunks per stage (the V shape: down the workers and back up)"
                                     : ZeroBubbleV::check(c);
  }
  static constexpr std::vector<std::vector<Action>> actions(const Config& c) {
    if constexpr (Memory == VMemory::full) return detail::zero_bubble_v_actions(c);
    else return detail::controllable_v_actions(c, Memory == VMemory::half);
  }
};

using VMin = VShape<VMemory::min>;
using VHalf = VShape<VMemory::half>;

}  // namespace cupipe::schedule
