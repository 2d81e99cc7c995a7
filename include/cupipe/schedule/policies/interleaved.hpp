// SPDX-License-Identifier: Apache-2.0
// Several chunks per worker on the looped placement: Megatron-LM's interleaved 1F1B (depth-first)
// and looped breadth-first.
#pragma once

#include <algorithm>
#include <string_view>
#include <vector>

#include "cupipe/schedule/policy.hpp"

namespace cupipe::schedule {

namespace detail {
/// Knobs, check and placement of a flush policy with V >= 2 chunks per stage on the looped placement
/// (Interleaved<V>, BreadthFirst<V>); `Policy::one_chunk` says what a configuration of one chunk
/// should use instead.
template <class Policy, int V>
struct SeveralChunkPolicy {
  static_assert(V >= 2, "Interleaved<V> and BreadthFirst<V> need at least 2 chunks per stage; with 1 chunk use "
                        "OneFOneB or GPipe");
  static constexpr bool split_backward = false;
  static constexpr UpdateRule update = UpdateRule::flush;
  static constexpr int chunks = V;
  static constexpr int default_batches = 1;

  static constexpr std::string_view check(const Config& c) { return c.chunks < 2 ? Policy::one_chunk : ""; }
  static constexpr Placement placement(const Config& c) { return looped_placement(c.stages, c.chunks); }
};
}  // namespace detail

/// Megatron-LM's interleaved 1F1B (Narayanan et al., "Efficient Large-Scale Language Model Training
/// on GPU Clusters Using Megatron-LM", SC'21). Stage s holds chunks s, s+p, ..., s+(V-1)p and walks
/// microbatches depth-first in groups of p: all V chunks of microbatches 0..p-1, then the next group.
///
/// Any microbatch count: m < 2p runs as one depth-first group of all m microbatches (m < p
/// included, with more bubble). From 2p on, the m microbatches go in floor(m/p) groups as even as
/// can be, the larger first (m = 10, p = 4: groups of 5 and 5; m = 13: 5, 4, 4), as PyTorch's
/// Interleaved1F1B groups them where it accepts m: every group is at least p long, so the steady
/// state has no hole and the bubble is (p-1)/V of a stage's F+B for every m >= p. A group longer
/// than p makes the last worker's forwards of a chunk reach worker 0 before it takes them, so the
/// plan declares channel_depth = (largest group) - p + 1 and verify proves it under that depth;
/// channels of depth 1 would need holes (the earlier plan padded m up to a multiple of p, and each
/// missing microbatch left every stage idle for 2/3 of a chunk's F+B). Warm-up on stage s is
/// min(2(p-s-1) + (V-1)g, V*m) forwards for the first (largest) group size g, as in Megatron-LM;
/// it holds (V-1)(g-p) more chunk-microbatches than groups of p would. V is the pipeline's chunk
/// count; plans for other counts (the explorer's --chunks) come from the same generator.
template <int V>
struct Interleaved : detail::SeveralChunkPolicy<Interleaved<V>, V> {
  static constexpr std::string_view name = "interleaved";
  static constexpr std::string_view summary = "1F1B over V chunks per stage, depth-first in groups of about p (Megatron-LM)";
  static constexpr std::string_view one_chunk = "Interleaved<V> needs at least 2 chunks per stage; with 1 chunk use OneFOneB";

  /// Messages the channel from the last worker back to worker 0 holds: a group longer than p
  /// queues its surplus forwards there.
  static constexpr int channel_depth(const Config& c) { return std::max(1, groups(c).front() - c.stages + 1); }

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
  /// Sizes of the depth-first microbatch groups: one group of all m when m < 2p, else floor(m/p)
  /// groups as even as can be, the larger first (each at least p long).
  static constexpr std::vector<int> groups(const Config& c) {
    if (c.microbatches < 2 * c.stages) return {c.microbatches};
    const int count = c.microbatches / c.stages, size = c.microbatches / count, larger = c.microbatches % count;
    std::vector<int> out(static_cast<std::size_t>(count), size);
    for (int i = 0; i < larger; ++i) ++out[static_cast<std::size_t>(i)];
    return out;
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

/// Looped breadth-first (Lamy-Poirier, "Breadth-First Pipeline Parallelism", MLSys 2023): the
/// interleaved placement, but every microbatch goes through a chunk before any goes through the next,
/// forwards in chunk order and backwards in reverse, as GPipe does per chunk. The bubble is
/// Interleaved<V>'s at the same m; the activation memory is GPipe's (V*m chunk-microbatches), and each
/// chunk's gradients are complete early, which is what overlaps a data-parallel reduction with the
/// rest of the backward. Worker 0 runs every forward of chunk c before it takes chunk c+1's inputs,
/// so the channel from the last worker back to worker 0 must hold up to m messages: the plan declares
/// channel_depth m.
template <int V>
struct BreadthFirst : detail::SeveralChunkPolicy<BreadthFirst<V>, V> {
  static constexpr std::string_view name = "bfs";
  static constexpr std::string_view summary = "looped breadth-first: each chunk runs all microbatches before the next";
  static constexpr std::string_view one_chunk = "BreadthFirst<V> needs at least 2 chunks per stage; with 1 chunk it is GPipe";
  static constexpr int channel_depth(const Config& c) { return c.microbatches; }

  static constexpr std::vector<std::vector<Action>> actions(const Config& c) {
    std::vector<Action> list;
    for (int chunk = 0; chunk < c.chunks; ++chunk)
      for (int j = 0; j < c.microbatches; ++j) list.push_back({ActionKind::F, j, chunk});
    for (int chunk = c.chunks - 1; chunk >= 0; --chunk)
      for (int j = 0; j < c.microbatches; ++j) list.push_back({ActionKind::B, j, chunk});
    return std::vector<std::vector<Action>>(static_cast<std::size_t>(c.stages), list);
  }
};

}  // namespace cupipe::schedule
