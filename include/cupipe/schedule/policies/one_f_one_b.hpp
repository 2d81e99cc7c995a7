// SPDX-License-Identifier: Apache-2.0
// GPipe and 1F1B: one chunk per worker, a flush after every batch.
#pragma once

#include <algorithm>
#include <string_view>
#include <vector>

#include "cupipe/schedule/policy.hpp"

namespace cupipe::schedule {

namespace detail {

/// F and B of microbatches 0..n-1 in 1F1B order: `warmup` forwards, alternation, then the drain.
constexpr std::vector<Action> one_f_one_b_order(int n, int warmup) {
  std::vector<Action> list;
  for (int j = 0; j < warmup; ++j) list.push_back({ActionKind::F, j, 0});
  for (int j = 0; j + warmup < n; ++j) {
    list.push_back({ActionKind::F, j + warmup, 0});
    list.push_back({ActionKind::B, j, 0});
  }
  for (int j = n - warmup; j < n; ++j) list.push_back({ActionKind::B, j, 0});
  return list;
}

/// 1F1B over all of the config's microbatches; PipeDream and 2BW run it across batches unflushed.
constexpr std::vector<std::vector<Action>> one_f_one_b_actions(const Config& c) {
  std::vector<std::vector<Action>> actions;
  const int n = c.total_microbatches();
  for (int s = 0; s < c.stages; ++s) actions.push_back(one_f_one_b_order(n, std::min(c.stages - s - 1, n)));
  return actions;
}

/// Knobs and checks of a one-chunk policy on the looped placement.
struct OneChunkPolicy {
  static constexpr int chunks = 1;
  static constexpr std::string_view check(const Config& c) { return c.chunks != 1 ? one_chunk_reason : ""; }
  static constexpr Placement placement(const Config& c) { return looped_placement(c.stages, 1); }
};

}  // namespace detail

/// GPipe (Huang et al., NeurIPS 2019): all forwards, then all backwards, then a flush.
struct GPipe : detail::OneChunkPolicy {
  static constexpr std::string_view name = "gpipe";
  static constexpr std::string_view summary = "all forwards, then all backwards, then a flush";
  static constexpr bool split_backward = false;
  static constexpr UpdateRule update = UpdateRule::flush;
  static constexpr int default_batches = 1;

  static constexpr std::vector<std::vector<Action>> actions(const Config& c) {
    std::vector<std::vector<Action>> out(static_cast<std::size_t>(c.stages));
    for (auto& list : out) {
      for (int j = 0; j < c.microbatches; ++j) list.push_back({ActionKind::F, j, 0});
      for (int j = 0; j < c.microbatches; ++j) list.push_back({ActionKind::B, j, 0});
    }
    return out;
  }
};

/// 1F1B with a flush, i.e. PipeDream-Flush (Narayanan et al., ICML 2021) as used by Megatron-LM:
/// stage s runs min(p-s-1, m) warm-up forwards, alternates one forward and one backward, then
/// drains the remaining backwards. Holds at most min(p-s, m) microbatches' activations.
struct OneFOneB : GPipe {
  static constexpr std::string_view name = "1f1b";
  static constexpr std::string_view summary = "one forward, one backward; at most p-s microbatches held; a flush";
  static constexpr std::vector<std::vector<Action>> actions(const Config& c) { return detail::one_f_one_b_actions(c); }
};

}  // namespace cupipe::schedule
