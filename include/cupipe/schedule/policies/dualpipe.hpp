// SPDX-License-Identifier: Apache-2.0
// DualPipeV: the V-shaped, "cut-in-half" form of DeepSeek's DualPipe (DeepSeek-V3 technical report;
// Sea AI Lab's "Cut-in-half" note; deepseek-ai/DualPipe, dualpipev.py). The orders below follow that
// reference step by step; the code is ours.
#pragma once

#include <string_view>
#include <vector>

#include "cupipe/schedule/action.hpp"
#include "cupipe/schedule/placement.hpp"
#include "cupipe/schedule/policy.hpp"

namespace cupipe::schedule {

namespace detail {

/// Worker r of p holds chunk 0 (virtual stage r) and chunk 1 (virtual stage 2p-1-r). Its program:
///   1  2(p-r-1) x F0
///   2  r+1 x (F0 F1)
///   3  p-r-1 x (B1 W F1)                           B1's W deferred, then the oldest deferred W
///   4  m-2p+r+1 x (F0&B1 F1&B0)                    overlapped pairs, whole backwards (B then W)
///   5  p-r-1 x (B1 F1&B0)
///   6  r+1 x (B1 B0)                               the second half of these defer their W
///   7  p-r-1 x (W B0)                              B0's W deferred
///   8  the deferred W's, oldest first
/// The last worker runs its first F0 and B1 of step 4 one after the other rather than overlapped,
/// as the reference does. Needs m >= 2p.
constexpr std::vector<std::vector<Action>> dualpipe_v_actions(const Config& c) {
  const int p = c.stages;
  const int m = c.microbatches;
  std::vector<std::vector<Action>> out(static_cast<std::size_t>(p));
  for (int r = 0; r < p; ++r) {
    auto& list = out[static_cast<std::size_t>(r)];
    int forwards[2] = {0, 0};
    int backwards[2] = {0, 0};
    std::vector<Action> deferred;  // W's in the order their B's ran; taken from the front
    std::size_t taken = 0;
    const auto forward = [&](int chunk, bool overlap = false) {
      list.push_back({ActionKind::F, forwards[chunk]++, chunk, overlap});
    };
    const auto backward = [&](int chunk, bool defer_weight) {
      const Action b{ActionKind::B, backwards[chunk]++, chunk};
      list.push_back(b);
      const Action w{ActionKind::W, b.microbatch, chunk};
      if (defer_weight) deferred.push_back(w);
      else list.push_back(w);
    };
    const auto weight = [&] { list.push_back(deferred[taken++]); };
    for (int i = 0; i < 2 * (p - r - 1); ++i) forward(0);
    for (int i = 0; i < r + 1; ++i) {
      forward(0);
      forward(1);
    }
    for (int i = 0; i < p - r - 1; ++i) {
      backward(1, true);
      weight();
      forward(1);
    }
    for (int i = 0; i < m - 2 * p + r + 1; ++i) {
      forward(0, !(i == 0 && r == p - 1));
      backward(1, false);
      forward(1, true);
      backward(0, false);
    }
    for (int i = 0; i < p - r - 1; ++i) {
      backward(1, false);
      forward(1, true);
      backward(0, false);
    }
    bool defer = false;
    for (int i = 0; i < r + 1; ++i) {
      if (i == (r + 1) / 2 && r % 2 == 1) defer = true;
      backward(1, defer);
      if (i == (r + 1) / 2 && r % 2 == 0) defer = true;
      backward(0, defer);
    }
    for (int i = 0; i < p - r - 1; ++i) {
      weight();
      backward(0, true);
    }
    while (taken < deferred.size()) weight();
  }
  return out;
}

}  // namespace detail

/// DualPipeV: two chunks per worker on the V-shaped placement (as ZBV), B/W split, and in the steady
/// state a forward of one chunk overlapped with the whole backward of the other (`Action::overlap`).
/// Published bubble (deepseek-ai/DualPipe, per worker, PP = 2p virtual stages):
/// (PP/2 - 1)(F&B + B - 3W), with B the whole backward of a chunk and F&B an overlapped pair; on the
/// host the pair runs back to back, so F&B = F + B (the CUDA backend runs the F on a second stream,
/// beside the B). Activations: PP + 1 chunk-microbatches per worker.
/// Needs m >= 2p microbatches.
struct DualPipeV {
  static constexpr std::string_view name = "dualpipev";
  static constexpr std::string_view summary =
      "DeepSeek's DualPipe cut in half: V-shaped, forward of one chunk overlapped with backward of the other";
  static constexpr bool split_backward = true;
  static constexpr UpdateRule update = UpdateRule::flush;
  static constexpr int chunks = 2;
  static constexpr int default_batches = 1;
  static constexpr std::string_view check(const Config& c) {
    if (c.chunks != 2) return "DualPipeV runs exactly 2 chunks per stage (the V shape: down the workers and back up)";
    if (c.microbatches < 2 * c.stages)
      return "DualPipeV needs at least 2 microbatches per stage (microbatches >= 2 x stages), as its reference does";
    return "";
  }
  static constexpr Placement placement(const Config& c) { return v_shape_placement(c.stages); }
  static constexpr std::vector<std::vector<Action>> actions(const Config& c) { return detail::dualpipe_v_actions(c); }
};

}  // namespace cupipe::schedule
