// SPDX-License-Identifier: Apache-2.0
// What the mixture-of-experts layers of a stage did in a step, as a trainer reports it: the
// auxiliary losses they added (the load-balancing loss and the router z-loss, already divided by
// the step's loss normalizer, so the microbatches add up to the step's value), the token slots
// routed and dropped, and the load per expert. A backend context points at one (Host::moe_tally,
// Cuda::moe_tally: null, nothing is counted); layers/moe.hpp adds to it once per microbatch, in its
// backward_input, so a forward run again (activation recomputation) or a prediction counts nothing
// (but the time of its all-to-alls, which it spends).
// No dependencies, so a backend context can name it.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

namespace cupipe::moe {

struct Tally {
  double balance_loss = 0;      ///< sum over layers of the sequence-wise load-balancing loss (before its coefficient)
  double z_loss = 0;            ///< sum over layers of the router z-loss (before its coefficient)
  double aux_loss = 0;          ///< what the two added to the training loss (with their coefficients)
  std::int64_t routed = 0;      ///< token slots routed (tokens x top-k, every layer)
  std::int64_t dropped = 0;     ///< of those, dropped by an expert's capacity
  std::vector<std::int64_t> load;  ///< [expert] slots each expert took (kept), every layer
  int layers = 0;               ///< MoE layer passes counted (layers x microbatches)
  /// Expert parallelism, measured on this rank: the wall time of the layers' counts' exchanges and
  /// all-to-alls from start to end (forward, backward, and a recomputed forward), and the part of it
  /// the rank spent waiting for them, not computing (exposed: the dispatch runs beside the slots a
  /// rank sent itself, the backward's combine beside the router's backward).
  double all_to_all_seconds = 0;
  double exposed_all_to_all_seconds = 0;
  /// The all-to-alls of tokens (two a layer and pass: the dispatch and the combine), and of those
  /// the ones during which a paired action computed (DualPipeV's overlapped F&B pairs that take
  /// turns: pipeline/paired_turns.hpp; on CUDA, queued its kernels).
  std::int64_t all_to_alls = 0;
  std::int64_t all_to_alls_beside_partner = 0;

  /// Adds another stage's (or rank's) tally.
  void add(const Tally& o) {
    balance_loss += o.balance_loss;
    z_loss += o.z_loss;
    aux_loss += o.aux_loss;
    routed += o.routed;
    dropped += o.dropped;
    if (load.size() < o.load.size()) load.resize(o.load.size(), 0);
    for (std::size_t e = 0; e < o.load.size(); ++e) load[e] += o.load[e];
    layers += o.layers;
    all_to_all_seconds += o.all_to_all_seconds;
    exposed_all_to_all_seconds += o.exposed_all_to_all_seconds;
    all_to_alls += o.all_to_alls;
    all_to_alls_beside_partner += o.all_to_alls_beside_partner;
  }

  /// The busiest expert's load over the mean load (1: perfectly balanced; 0 when nothing was routed).
  double max_over_mean_load() const {
    std::int64_t total = 0, most = 0;
    for (std::int64_t l : load) {
      total += l;
      most = std::max(most, l);
    }
    return total == 0 ? 0.0 : double(most) * double(load.size()) / double(total);
  }

  /// The share of routed slots dropped (0 when nothing was routed).
  double drop_fraction() const { return routed == 0 ? 0.0 : double(dropped) / double(routed); }
};

}  // namespace cupipe::moe
