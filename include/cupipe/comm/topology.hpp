// SPDX-License-Identifier: Apache-2.0
// Topology: world = pipeline stages x data-parallel replicas x tensor-parallel ranks, independent of
// the launcher.
//
// Rank mapping: rank = (replica * stages + stage) * tensor + t. Tensor parallelism is innermost, so
// a tensor-parallel group (which sums activations in every layer) is consecutive ranks, on one node
// under any launcher that places ranks in order; then the stages of one replica's pipeline; then the
// replicas. With tensor = 1 (no tensor parallelism) rank = replica * stages + stage: ranks
// 0..stages-1 are replica 0's pipeline, the next `stages` ranks replica 1's, and so on. Point-to-point
// traffic stays inside one pipeline (between ranks of the same t); gradient all-reduces run among one
// stage's replicas (of the same t); tensor-parallel sums among the ranks of one stage of one replica.
#pragma once

#include <string>

#include "cupipe/core/error.hpp"

namespace cupipe::comm {

struct Topology {
  int world = 1;
  int stages = 1;
  int replicas = 1;
  int rank = 0;
  int tensor = 1;  ///< tensor-parallel ranks per stage

  /// The topology for `world` ranks split into `stages` pipeline stages of `tensor` ranks each.
  static Topology make(int world, int rank, int stages, int tensor = 1) {
    CUPIPE_REQUIRE(world >= 1 && rank >= 0 && rank < world, "topology: rank ", rank, " outside a world of ", world);
    CUPIPE_REQUIRE(tensor >= 1, "topology: tensor-parallel degree ", tensor, " is not positive");
    CUPIPE_REQUIRE(stages >= 1 && world % (stages * tensor) == 0, "topology: a world of ", world, " ranks cannot hold ",
                   stages, " pipeline stages", tensor > 1 ? " of " + std::to_string(tensor) + " tensor-parallel ranks" : "",
                   "; the world must be stages x data-parallel replicas", tensor > 1 ? " x tensor-parallel ranks" : "");
    return {world, stages, world / (stages * tensor), rank, tensor};
  }

  int stage() const noexcept { return (rank / tensor) % stages; }
  int replica() const noexcept { return rank / (tensor * stages); }
  /// This rank's place in its tensor-parallel group, 0 .. tensor - 1.
  int tensor_rank() const noexcept { return rank % tensor; }
  int rank_of(int stage, int replica, int t = 0) const noexcept { return (replica * stages + stage) * tensor + t; }

  /// "world 4 = 2 stages x 2 replicas; rank 0: stage 0 replica 0, ..." for the start-up log.
  std::string describe() const {
    const bool tp = tensor > 1;
    std::string out = "world " + std::to_string(world) + " = " + std::to_string(stages) + " stage(s) x " +
                      std::to_string(replicas) + " data-parallel replica(s)" +
                      (tp ? " x " + std::to_string(tensor) + " tensor-parallel rank(s); rank = (replica * " +
                                std::to_string(stages) + " + stage) * " + std::to_string(tensor) + " + t:"
                          : "; rank = replica * " + std::to_string(stages) + " + stage:");
    for (int r = 0; r < world; ++r) {
      const Topology at{world, stages, replicas, r, tensor};
      out += std::string(r ? "," : "") + " rank " + std::to_string(r) + " -> (stage " + std::to_string(at.stage()) +
             ", replica " + std::to_string(at.replica()) + (tp ? ", t " + std::to_string(at.tensor_rank()) : "") + ")";
    }
    return out;
  }
};

}  // namespace cupipe::comm
