// SPDX-License-Identifier: Apache-2.0
// Megatron-LM's interleaved 1F1B: several chunks per worker on the looped placement.
#pragma once

#include <algorithm>
#include <string_view>
#include <vector>

#include "cupipe/schedule/policy.hpp"

namespace cupipe::schedule {

/// Megatron-LM's interleaved 1F1B (Narayanan et al., "Efficient Large-Scale Language Model Training
/// on GPU Clusters Using Megatron-LM", SC'21). Stage s holds chunks s, s+p, ..., s+(V-1)p and walks
/// microbatches depth-first in groups of p: all V chunks of microbatches 0..p-1, then the next group.
///
/// Supported microbatch counts: m a multiple of p (groups of p, as in Megatron-LM), or any m < 2p,
/// which runs as one depth-first group of all m microbatches (m < p included, with more bubble).
/// Other m are rejected: a leftover group of another size than the rest deadlocks once sends block
/// (verify finds it). Warm-up on stage s is min(2(p-s-1) + (V-1)g, V*m) forwards for group size g,
/// as in Megatron-LM. V is the pipeline's chunk count; plans for other counts (the explorer's
/// --chunks) come from the same generator.
template <int V>
struct Interleaved {
  static_assert(V >= 2, "Interleaved<V> needs at least 2 chunks per stage; with 1 chunk use OneFOneB");
  static constexpr std::string_view name = "interleaved";
  static constexpr std::string_view summary = "1F1B over V chunks per stage, depth-first in groups of p (Megatron-LM)";
  static constexpr bool split_backward = false;
  static constexpr UpdateRule update = UpdateRule::flush;
  static constexpr int chunks = V;
  static constexpr int default_batches = 1;

  static constexpr std::string_view check(const Config& c) {
    if (c.chunks < 2) return "Interleaved<V> needs at least 2 chunks per stage; with 1 chunk use OneFOneB";
    if (c.microbatches % c.stages != 0 && c.microbatches >= 2 * c.stages)
      return "Interleaved<V> needs microbatches to be a multiple of stages, or fewer than 2 x stages (one depth-first "
             "group): a leftover group of another size deadlocks once sends block";
    return "";
  }

  static constexpr Placement placement(const Config& c) { return looped_placement(c.stages, c.chunks); }

  static constexpr std::vector<std::vector<Action>> actions(const Config& c) {
    const std::vector<Action> forwards = order(c, ActionKind::F);
    const std::vector<Action> backwards = order(c, ActionKind::B);
    const int total = c.microbatches * c.chunks;
    const int group = groups(c).front();
    std::vector<std::vector<Action>> out(static_cast<std::size_t>(c.stages));
    for (int s = 0; s < c.stages; ++s) {
      auto& list = out[static_cast<std::size_t>(s)];
      const int warmup = std::min(2 * (c.stages - s - 1) + (c.chunks - 1) * group, total);
      for (int k = 0; k < warmup; ++k) list.push_back(forwards[static_cast<std::size_t>(k)]);
      for (int k = 0; k + warmup < total; ++k) {
        list.push_back(forwards[static_cast<std::size_t>(k + warmup)]);
        list.push_back(backwards[static_cast<std::size_t>(k)]);
      }
      for (int k = total - warmup; k < total; ++k) list.push_back(backwards[static_cast<std::size_t>(k)]);
    }
    return out;
  }

 private:
  /// Sizes of the depth-first microbatch groups: groups of p, or one group of all m when m < 2p.
  static constexpr std::vector<int> groups(const Config& c) {
    if (c.microbatches < 2 * c.stages) return {c.microbatches};
    return std::vector<int>(static_cast<std::size_t>(c.microbatches / c.stages), c.stages);
  }

  /// Each group of microbatches runs through chunk 0, 1, ... (forwards) or chunk V-1, V-2, ...
  /// (backwards) before the next group starts.
  static constexpr std::vector<Action> order(const Config& c, ActionKind kind) {
    std::vector<Action> out;
    int first = 0;
    for (const int size : groups(c)) {
      for (int i = 0; i < c.chunks; ++i) {
        const int chunk = kind == ActionKind::F ? i : c.chunks - 1 - i;
        for (int j = first; j < first + size; ++j) out.push_back({kind, j, chunk});
      }
      first += size;
    }
    return out;
  }
};

}  // namespace cupipe::schedule
