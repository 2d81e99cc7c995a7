// SPDX-License-Identifier: Apache-2.0
// Activation offload, planned from a schedule: which stashed records leave the device between a
// microbatch's forward and its backward, when, and what that leaves resident.
//
// A virtual stage that offloads keeps at most `resident` forward records in device memory between
// its actions. When a forward ends with more held, the records whose backward comes last in the
// worker's order go to host memory (Belady's rule: what is needed furthest ahead leaves first, which
// moves the fewest records for the cap); a backward whose record left brings it back as it starts.
// The plan depends only on the schedule's order, so every timing runs the same moves, and the
// runtime (StageExecutor), the memory estimate and the simulator read the same OffloadPlan.
//
// Costs: while its record is out, a microbatch holds nothing on the device; during the forward that
// sends records out and the backward that brings one back, one record more than `resident` is held.
// The copies are synchronous in the runtime today (the forward that evicts and the backward that
// restores each take one record's copy longer: Costs::offload in simulate); a copy stream that
// overlaps them with compute is what a device would add.
#pragma once

#include <algorithm>
#include <cstddef>
#include <string>
#include <vector>

#include "cupipe/core/error.hpp"
#include "cupipe/schedule/action.hpp"

namespace cupipe::schedule {

/// A record to move: microbatch `microbatch` of virtual stage `virtual_stage`.
struct OffloadMove {
  int virtual_stage = 0;
  int microbatch = 0;
  friend constexpr bool operator==(const OffloadMove&, const OffloadMove&) = default;
};

/// The moves of a plan, per worker and per action of its list.
struct OffloadPlan {
  /// [worker][i]: the records that go to host memory when action i ends (after a forward).
  std::vector<std::vector<std::vector<OffloadMove>>> out_after;
  /// [worker][i]: whether action i (a backward) brings its record back before it runs.
  std::vector<std::vector<char>> back_before;
  /// [worker]: the most (virtual stage, microbatch) records on the device at once, as
  /// schedule::peak_activations counts them without offload.
  std::vector<int> peak_resident;
  /// [worker]: records sent out per step (each comes back once).
  std::vector<int> moves;

  constexpr bool empty() const noexcept { return out_after.empty(); }
  /// Records worker w's action i copies: those it sends out after it, and its own brought back.
  constexpr int copies(int w, std::size_t i) const noexcept {
    if (empty()) return 0;
    return int(out_after[std::size_t(w)][i].size()) + (back_before[std::size_t(w)][i] != 0 ? 1 : 0);
  }
};

/// The offload plan of `plan` for the virtual stages in `stages` (each keeping at most `resident`
/// forward records on the device between actions). Empty `stages`: an empty plan (nothing moves).
/// Throws for a virtual stage out of range or `resident` below 1.
constexpr OffloadPlan plan_offload(const Plan& plan, const std::vector<int>& stages, int resident) {
  OffloadPlan out;
  if (stages.empty()) return out;
  const int virtual_stages = plan.config.virtual_stages();
  CUPIPE_REQUIRE(resident >= 1, "offload: resident must be at least 1 record per stage, got ", resident);
  for (int k : stages)
    CUPIPE_REQUIRE(k >= 0 && k < virtual_stages, "offload: virtual stage ", k, " is not one of the plan's ",
                   virtual_stages);
  const std::size_t p = plan.actions.size();
  const int m = plan.config.total_microbatches();
  const ActionKind release = plan.split_backward ? ActionKind::W : ActionKind::B;
  out.out_after.resize(p);
  out.back_before.resize(p);
  out.peak_resident.assign(p, 0);
  out.moves.assign(p, 0);
  for (std::size_t w = 0; w < p; ++w) {
    const auto& list = plan.actions[w];
    out.out_after[w].assign(list.size(), {});
    out.back_before[w].assign(list.size(), 0);
    // Where each (virtual stage, microbatch)'s backward is in the list.
    std::vector<int> backward_at(std::size_t(virtual_stages) * std::size_t(m), -1);
    for (std::size_t i = 0; i < list.size(); ++i)
      if (list[i].kind == ActionKind::B)
        backward_at[std::size_t(plan.virtual_stage(int(w), list[i])) * std::size_t(m) + std::size_t(list[i].microbatch)] =
            int(i);
    const auto offloads = [&](int k) { return std::find(stages.begin(), stages.end(), k) != stages.end(); };
    // Per virtual stage: the microbatches whose record is on the device, and those out.
    std::vector<std::vector<int>> on_device(static_cast<std::size_t>(virtual_stages));
    std::vector<std::vector<int>> away(static_cast<std::size_t>(virtual_stages));
    for (std::size_t i = 0; i < list.size(); ++i) {
      const Action& a = list[i];
      const int k = plan.virtual_stage(int(w), a);
      auto& held = on_device[std::size_t(k)];
      auto& out_now = away[std::size_t(k)];
      if (a.kind == ActionKind::F) {
        held.push_back(a.microbatch);
      } else if (a.kind == ActionKind::B) {
        const auto gone = std::find(out_now.begin(), out_now.end(), a.microbatch);
        if (gone != out_now.end()) {
          out_now.erase(gone);
          held.push_back(a.microbatch);
          out.back_before[w][i] = 1;
        }
      }
      int total = 0;
      for (const auto& h : on_device) total += int(h.size());
      out.peak_resident[w] = std::max(out.peak_resident[w], total);
      if (a.kind == release) held.erase(std::remove(held.begin(), held.end(), a.microbatch), held.end());
      if (a.kind != ActionKind::F || !offloads(k)) continue;
      // After a forward: over the cap, the records needed last leave (never one whose backward has run).
      while (int(held.size()) > resident) {
        const auto last = std::max_element(held.begin(), held.end(), [&](int x, int y) {
          return backward_at[std::size_t(k) * std::size_t(m) + std::size_t(x)] <
                 backward_at[std::size_t(k) * std::size_t(m) + std::size_t(y)];
        });
        if (backward_at[std::size_t(k) * std::size_t(m) + std::size_t(*last)] < int(i)) break;
        out.out_after[w][i].push_back({k, *last});
        out_now.push_back(*last);
        held.erase(last);
        ++out.moves[w];
      }
    }
  }
  return out;
}

}  // namespace cupipe::schedule
