// SPDX-License-Identifier: Apache-2.0
// Topology: world = pipeline stages x data-parallel replicas, independent of the launcher.
//
// Rank mapping: rank = replica * stages + stage. Ranks 0..stages-1 are replica 0's pipeline, the next
// `stages` ranks replica 1's, and so on; the replicas of one stage are `stages` ranks apart. Point-to-
// point traffic stays inside one replica's pipeline; gradient all-reduces run among one stage's
// replicas.
#pragma once

#include <string>

#include "cupipe/core/error.hpp"

namespace cupipe::comm {

struct Topology {
  int world = 1;
  int stages = 1;
  int replicas = 1;
  int rank = 0;

  /// The topology for `world` ranks split into `stages` pipeline stages.
  static Topology make(int world, int rank, int stages) {
    CUPIPE_REQUIRE(world >= 1 && rank >= 0 && rank < world, "topology: rank ", rank, " outside a world of ", world);
    CUPIPE_REQUIRE(stages >= 1 && world % stages == 0, "topology: a world of ", world, " ranks cannot hold ", stages,
                   " pipeline stages; the world must be stages x data-parallel replicas");
    return {world, stages, world / stages, rank};
  }

  int stage() const noexcept { return rank % stages; }
  int replica() const noexcept { return rank / stages; }
  int rank_of(int stage, int replica) const noexcept { return replica * stages + stage; }

  /// "world 4 = 2 stages x 2 replicas; rank 0: stage 0 replica 0, ..." for the start-up log.
  std::string describe() const {
    std::string out = "world " + std::to_string(world) + " = " + std::to_string(stages) + " stage(s) x " +
                      std::to_string(replicas) + " data-parallel replica(s); rank = replica * " + std::to_string(stages) +
                      " + stage:";
    for (int r = 0; r < world; ++r)
      out += std::string(r ? "," : "") + " rank " + std::to_string(r) + " -> (stage " + std::to_string(r % stages) +
             ", replica " + std::to_string(r / stages) + ")";
    return out;
  }
};

}  // namespace cupipe::comm
