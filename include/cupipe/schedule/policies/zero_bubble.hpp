// SPDX-License-Identifier: Apache-2.0
// Zero-bubble schedules (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024): the backward
// splits into B (input gradient, on the critical path) and W (weight gradient, deferred to fill bubbles).
#pragma once

#include <algorithm>
#include <string_view>
#include <vector>

#include "cupipe/schedule/policies/one_f_one_b.hpp"

namespace cupipe::schedule {

namespace detail {

/// F and B follow a 1F1B order with `warmup(s)` leading forwards; a list scheduler on unit costs
/// (F = B = W = 1, no transfer time) then places the W's: a free stage runs its next F or B when the
/// input has arrived (and, for F, when it holds fewer than `cap` microbatches between F and W),
/// otherwise its oldest pending W.
constexpr std::vector<std::vector<Action>> zero_bubble_actions(const Config& c, bool h1) {
  const int p = c.stages;
  const int m = c.microbatches;
  const int cap = std::min(h1 ? p : 2 * p - 1, m);
  constexpr int never = 1 << 30;
  std::vector<std::vector<Action>> out(static_cast<std::size_t>(p));
  std::vector<int> forward_end(static_cast<std::size_t>(p * m), never);
  std::vector<int> backward_end(static_cast<std::size_t>(p * m), never);
  auto at = [m](int s, int j) { return static_cast<std::size_t>(s * m + j); };
  std::vector<std::vector<Action>> order(static_cast<std::size_t>(p));
  for (int s = 0; s < p; ++s)
    order[static_cast<std::size_t>(s)] = one_f_one_b_order(m, std::min(h1 ? p - s - 1 : 2 * (p - s - 1), m));
  std::vector<int> next(static_cast<std::size_t>(p), 0), forwards(static_cast<std::size_t>(p), 0),
      backwards(static_cast<std::size_t>(p), 0), weights(static_cast<std::size_t>(p), 0);
  int finished = 0;
  const int horizon = 4 * (m + p) + 8;  // far beyond any unit-cost makespan; a guard, never hit
  for (int t = 0; finished < p && t < horizon; ++t) {
    for (int s = 0; s < p; ++s) {
      const auto us = static_cast<std::size_t>(s);
      auto& list = out[us];
      if (weights[us] == m) continue;
      if (static_cast<int>(list.size()) > t) continue;  // busy: one entry per time step, idle ones padded
      bool ready = false;
      if (next[us] < 2 * m) {
        const Action& a = order[us][static_cast<std::size_t>(next[us])];
        if (a.kind == ActionKind::F)
          ready = forwards[us] - weights[us] < cap && (s == 0 || forward_end[at(s - 1, a.microbatch)] <= t);
        else
          ready = s == p - 1 ? forward_end[at(s, a.microbatch)] <= t : backward_end[at(s + 1, a.microbatch)] <= t;
        if (ready) {
          list.push_back(a);
          (a.kind == ActionKind::F ? forward_end : backward_end)[at(s, a.microbatch)] = t + 1;
          ++(a.kind == ActionKind::F ? forwards : backwards)[us];
          ++next[us];
        }
      }
      if (ready) continue;
      if (weights[us] < backwards[us]) {
        list.push_back({ActionKind::W, weights[us], 0});
        if (++weights[us] == m) ++finished;
      } else {
        list.push_back({ActionKind::W, -1, -1});
      }
    }
  }
  for (auto& list : out) std::erase_if(list, [](const Action& a) { return a.microbatch < 0; });
  return out;
}


/// ZB-V's per-worker orders, the pattern of the zero-bubble paper's V schedule (section 6 of Qi et al.,
/// arXiv:2401.10241). Worker r holds chunk 0 (virtual stage r) and chunk 1 (virtual stage 2p-1-r):
///   warm-up    2(p-r)-1 x F0;  r x (F1 F0);  p-r x (F1 B1 W1)
///   steady     F0 B0 W0 F1 B1 W1  (F0 left out once all forwards of chunk 0 are done)
///   cool-down  r x (B0 B1);  p-r x (B0 W0);  then the W1 and W0 still pending.
/// Below 2p-1 microbatches the plan is the one for 2p-1 without the microbatches that do not exist,
/// so every m has a plan. A fixed pattern rather than a list scheduler on unit costs: a list
/// scheduler's orders are tuned to F = B = W and stall when B is heavier; this one is within ZB-H1's
/// makespan at every cost ratio the tests try.
constexpr std::vector<std::vector<Action>> zero_bubble_v_actions(const Config& c) {
  const int p = c.stages;
  const int m = c.microbatches;
  const int n = std::max(2 * p - 1, m);
  std::vector<std::vector<Action>> out(static_cast<std::size_t>(p));
  for (int r = 0; r < p; ++r) {
    auto& list = out[static_cast<std::size_t>(r)];
    int next[3][2] = {};  // [kind][chunk] -> the next microbatch of that kind on that chunk
    auto run = [&](ActionKind kind, int chunk) {
      int& j = next[static_cast<int>(kind)][chunk];
      list.push_back({kind, j++, chunk});
    };
    const auto& forwards = next[static_cast<int>(ActionKind::F)];
    const auto& backwards = next[static_cast<int>(ActionKind::B)];
    const auto& weights = next[static_cast<int>(ActionKind::W)];
    for (int i = 0; i < 2 * (p - r) - 1; ++i) run(ActionKind::F, 0);
    for (int i = 0; i < r; ++i) {
      run(ActionKind::F, 1);
      run(ActionKind::F, 0);
    }
    for (int i = 0; i < p - r; ++i) {
      run(ActionKind::F, 1);
      run(ActionKind::B, 1);
      run(ActionKind::W, 1);
    }
    while (forwards[1] < forwards[0] || forwards[0] < n) {
      if (forwards[0] < n) run(ActionKind::F, 0);
      run(ActionKind::B, 0);
      run(ActionKind::W, 0);
      run(ActionKind::F, 1);
      run(ActionKind::B, 1);
      run(ActionKind::W, 1);
    }
    for (int i = 0; i < r; ++i) {
      run(ActionKind::B, 0);
      run(ActionKind::B, 1);
    }
    for (int i = 0; i < p - r; ++i) {
      run(ActionKind::B, 0);
      run(ActionKind::W, 0);
    }
    while (weights[1] < backwards[1]) run(ActionKind::W, 1);
    while (weights[0] < backwards[0]) run(ActionKind::W, 0);
    std::erase_if(list, [m](const Action& a) { return a.microbatch >= m; });
  }
  return out;
}

}  // namespace detail

/// ZB-H1: stage s keeps at most min(p-s, m) microbatches between F and W, 1F1B's activation memory;
/// the bubble with F=B=W is a third of 1F1B's. Orders come from a unit-cost list scheduler with
/// priority B > F > W under that limit.
struct ZeroBubbleH1 : detail::OneChunkPolicy {
  static constexpr std::string_view name = "zb-h1";
  static constexpr std::string_view summary = "B and W split; W fills bubbles; 1F1B's activation memory";
  static constexpr bool split_backward = true;
  static constexpr UpdateRule update = UpdateRule::flush;
  static constexpr int default_batches = 1;
  static constexpr std::vector<std::vector<Action>> actions(const Config& c) { return detail::zero_bubble_actions(c, true); }
};

/// ZB-H2: as ZB-H1 but stage s may hold min(2(p-s)-1, m) microbatches (up to 2p-1 on stage 0), so
/// warm-up forwards fill the wait for the first B and deferred W's fill the drain. One step alone
/// keeps the stage-to-stage ramp ((p-1)*F on the last stage); with optimizer post-validation
/// (PipelineOptions::post_validation) the next step fills it and the steady state has none at F = B = W.
struct ZeroBubbleH2 : ZeroBubbleH1 {
  static constexpr std::string_view name = "zb-h2";
  static constexpr std::string_view summary = "as zb-h1 with up to 2p-1 microbatches held: a near-zero bubble";
  static constexpr std::vector<std::vector<Action>> actions(const Config& c) { return detail::zero_bubble_actions(c, false); }
};

/// ZB-V (Qi et al., "Zero Bubble Pipeline Parallelism", section 6; the V-shaped schedule that "Pipeline
/// Parallelism with Controllable Memory", NeurIPS 2024, builds on): two chunks per worker on the
/// V-shaped placement (worker w holds virtual stages w and 2p-1-w, so the first and the last virtual
/// stage, the embedding and the loss, share worker 0), B and W split. Each worker holds at most
/// min(2p, 2m) chunk-microbatches between F and W: p whole-stage microbatches, 1F1B's peak. With
/// F = B = W the makespan is m(F+B+W) + (p-1)F/2 once m >= 2p-1: half of ZB-H1's ramp, the rest of
/// the bubble gone; with optimizer post-validation the next step fills the ramp too.
struct ZeroBubbleV {
  static constexpr std::string_view name = "zbv";
  static constexpr std::string_view summary = "zero bubble on the V-shaped placement: 2 chunks, B/W split, 1F1B's memory";
  static constexpr bool split_backward = true;
  static constexpr UpdateRule update = UpdateRule::flush;
  static constexpr int chunks = 2;
  static constexpr int default_batches = 1;
  static constexpr std::string_view check(const Config& c) {
    return c.chunks != 2 ? "ZBV runs exactly 2 chunks per stage (the V shape: down the workers and back up)" : "";
  }
  static constexpr Placement placement(const Config& c) { return v_shape_placement(c.stages); }
  static constexpr std::vector<std::vector<Action>> actions(const Config& c) {
    return detail::zero_bubble_v_actions(c);
  }
};

}  // namespace cupipe::schedule
