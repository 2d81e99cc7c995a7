// SPDX-License-Identifier: Apache-2.0
// Topology: world = pipeline stages x data-parallel replicas x tensor-parallel ranks, independent of
// the launcher.
//
// Rank mapping (RankOrder): tensor parallelism is innermost, so a tensor-parallel group (which sums
// activations in every layer) is consecutive ranks, on one node under any launcher that places ranks
// in order. By default (RankOrder::stages_outermost, Megatron-LM's order) the data-parallel replicas
// of a stage come next and the pipeline stages last:
//   rank = (stage * replicas + replica) * tensor + t,
// so the gradient all-reduces (the heaviest traffic after tensor parallelism's) run between nearby
// ranks and only the light point-to-point hand-overs cross the outermost dimension. The override
// RankOrder::replicas_outermost puts one replica's whole pipeline on consecutive ranks:
//   rank = (replica * stages + stage) * tensor + t.
// Point-to-point traffic stays inside one pipeline (between ranks of the same replica and t);
// gradient all-reduces run among one stage's replicas (of the same t); tensor-parallel sums among the
// ranks of one stage of one replica. describe() prints the mapping at start-up.
//
// Context parallelism (cp/, Topology::context) splits each sequence over `context` ranks that hold
// the same weights, so they count among a stage's replicas: the gradient sums, the loss's
// normalisers and ZeRO's shards run over data-parallel x context-parallel ranks, as Megatron-LM's
// do. A ring is `context` consecutive replicas: replica = data-parallel replica * context + the
// rank's place in its ring (context_rank()).
//
// Expert parallelism (moe/, Topology::experts) groups `experts` consecutive replicas of a stage: each
// holds its own tokens, as a data-parallel replica does, and a share of every mixture-of-experts
// layer's experts (expert_rank() its place in the group); the replicas at the same place of every
// group hold the same experts.
#pragma once

#include <string>

#include "cupipe/core/error.hpp"

namespace cupipe::comm {

/// Which of the two outer dimensions varies slowest over the ranks (tensor parallelism is always
/// innermost).
enum class RankOrder { stages_outermost, replicas_outermost };

/// "stages-outermost" / "replicas-outermost", as the trainers' --rank-order takes them.
inline const char* rank_order_name(RankOrder order) {
  return order == RankOrder::stages_outermost ? "stages-outermost" : "replicas-outermost";
}
inline RankOrder parse_rank_order(const std::string& name) {
  if (name == "stages-outermost") return RankOrder::stages_outermost;
  if (name == "replicas-outermost") return RankOrder::replicas_outermost;
  CUPIPE_THROW("rank order '", name, "': use stages-outermost (the default: a stage's replicas on nearby ranks) or "
               "replicas-outermost (a replica's pipeline on consecutive ranks)");
}

struct Topology {
  int world = 1;
  int stages = 1;
  int replicas = 1;
  int rank = 0;
  int tensor = 1;  ///< tensor-parallel ranks per stage
  RankOrder order = RankOrder::stages_outermost;
  int context = 1;  ///< context-parallel ranks per ring (among the replicas)
  int experts = 1;  ///< expert-parallel ranks per group (among the replicas)

  /// The topology for `world` ranks split into `stages` pipeline stages of `tensor` ranks each, a
  /// stage's replicas in rings of `context`.
  static Topology make(int world, int rank, int stages, int tensor = 1, RankOrder order = RankOrder::stages_outermost,
                       int context = 1, int experts = 1) {
    CUPIPE_REQUIRE(world >= 1 && rank >= 0 && rank < world, "topology: rank ", rank, " outside a world of ", world);
    CUPIPE_REQUIRE(tensor >= 1, "topology: tensor-parallel degree ", tensor, " is not positive");
    CUPIPE_REQUIRE(stages >= 1 && world % (stages * tensor) == 0, "topology: a world of ", world, " ranks cannot hold ",
                   stages, " pipeline stages", tensor > 1 ? " of " + std::to_string(tensor) + " tensor-parallel ranks" : "",
                   "; the world must be stages x data-parallel replicas", tensor > 1 ? " x tensor-parallel ranks" : "");
    const int replicas = world / (stages * tensor);
    CUPIPE_REQUIRE(context >= 1 && replicas % context == 0, "topology: a stage's ", replicas, " replica(s) cannot form rings of ",
                   context, " context-parallel ranks; the world must be stages x data-parallel replicas x context-parallel "
                   "ranks", tensor > 1 ? " x tensor-parallel ranks" : "");
    CUPIPE_REQUIRE(experts >= 1 && replicas % experts == 0 && (experts == 1 || context == 1), "topology: a stage's ", replicas,
                   " replica(s) cannot form expert-parallel groups of ", experts, context > 1 ? " beside context parallelism" : "",
                   "; the world must be stages x data-parallel replicas", tensor > 1 ? " x tensor-parallel ranks" : "",
                   ", the replicas a multiple of the expert-parallel degree");
    return {world, stages, replicas, rank, tensor, order, context, experts};
  }

  int stage() const noexcept {
    return order == RankOrder::stages_outermost ? rank / (tensor * replicas) : (rank / tensor) % stages;
  }
  int replica() const noexcept {
    return order == RankOrder::stages_outermost ? (rank / tensor) % replicas : rank / (tensor * stages);
  }
  /// This rank's place in its tensor-parallel group, 0 .. tensor - 1.
  int tensor_rank() const noexcept { return rank % tensor; }
  /// This rank's place in its context-parallel ring, 0 .. context - 1, and the ring's data-parallel
  /// replica (the ranks of a ring read the same sequences), 0 .. replicas / context - 1.
  int context_rank() const noexcept { return replica() % context; }
  int data_replica() const noexcept { return replica() / context; }
  /// The split color of this rank's ring (its stage, tensor place and data-parallel replica), and
  /// "the context-parallel ring of 2 ranks (stage 0, data-parallel replica 1)", for errors.
  int ring_color() const noexcept { return (stage() * tensor + tensor_rank()) * (replicas / context) + data_replica(); }
  std::string ring_name() const {
    return "the context-parallel ring of " + std::to_string(context) + " ranks (stage " + std::to_string(stage()) +
           ", data-parallel replica " + std::to_string(data_replica()) + ")";
  }
  /// This rank's place in its expert-parallel group, 0 .. experts - 1 (it holds that share of the
  /// experts), and the group's index among the stage's groups.
  int expert_rank() const noexcept { return replica() % experts; }
  int expert_group_index() const noexcept { return replica() / experts; }
  int rank_of(int stage, int replica, int t = 0) const noexcept {
    return (order == RankOrder::stages_outermost ? stage * replicas + replica : replica * stages + stage) * tensor + t;
  }

  /// "world 4 = 2 stage(s) x 2 data-parallel replica(s); rank = stage * 2 + replica: rank 0 ->
  /// (stage 0, replica 0), ..." for the start-up log.
  std::string describe() const {
    const bool tp = tensor > 1;
    const std::string inner = order == RankOrder::stages_outermost ? "stage * " + std::to_string(replicas) + " + replica"
                                                                   : "replica * " + std::to_string(stages) + " + stage";
    const std::string rings = context > 1 ? " x " + std::to_string(context) + " context-parallel rank(s)" : "";
    std::string out = "world " + std::to_string(world) + " = " + std::to_string(stages) + " stage(s) x " +
                      std::to_string(replicas / context) + " data-parallel replica(s)" + rings +
                      (tp ? " x " + std::to_string(tensor) + " tensor-parallel rank(s); rank = (" + inner + ") * " +
                                std::to_string(tensor) + " + t:"
                          : "; rank = " + inner + ":");
    for (int r = 0; r < world; ++r) {
      const Topology at{world, stages, replicas, r, tensor, order, context, experts};
      out += std::string(r ? "," : "") + " rank " + std::to_string(r) + " -> (stage " + std::to_string(at.stage()) +
             ", replica " + std::to_string(at.replica()) + (tp ? ", t " + std::to_string(at.tensor_rank()) : "") + ")";
    }
    if (context > 1)
      out += "; replica = data-parallel replica * " + std::to_string(context) + " + place in its context-parallel ring of " +
             std::to_string(context);
    if (experts > 1)
      out += "; experts split over groups of " + std::to_string(experts) + " consecutive replicas (place = replica % " +
             std::to_string(experts) + ")";
    return out;
  }
};

}  // namespace cupipe::comm
