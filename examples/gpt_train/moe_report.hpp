// SPDX-License-Identifier: Apache-2.0
// gpt_train --experts: what the mixture-of-experts layers did, as the trainer reports it. A
// moe::Tally on each of this process's workers (the layers add to it in their backward), summed
// over the workers and over every rank at the log steps (a collective: every rank calls interval()
// at the same steps), printed by the leader, and totalled for the run's JSON summary. For a dense
// model (config.experts == 0) every member does nothing.
#pragma once

#include <array>
#include <cstdint>
#include <cstdio>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "cupipe/comm/communicator.hpp"
#include "cupipe/gpt/model.hpp"
#include "cupipe/moe/tally.hpp"

namespace gpt_trainer {

template <cupipe::gpt::Config config, int P>
class MoeReport {
 public:
  template <class Pipe>
  MoeReport(Pipe& pipe, cupipe::comm::Communicator* comm) : comm_(comm) {
    if constexpr (config.experts > 0)
      for (int w = 0; w < P; ++w)
        if (pipe.local(w)) pipe.backend(w).moe_tally = &tallies_[std::size_t(w)];
  }

  /// The model's experts, before training.
  template <class Say>
  void describe(Say&& say) const {
    if constexpr (config.experts > 0) {
      std::string blocks;
      for (cupipe::index_t b = 0; b < config.layers; ++b)
        if (config.moe_block(b)) blocks += (blocks.empty() ? "" : ", ") + std::to_string(b);
      char capacity[96] = "dropless";
      if (config.capacity_factor > 0)
        std::snprintf(capacity, sizeof capacity, "capacity factor %g per sequence (what overflows is dropped)",
                      config.capacity_factor);
      say("mixture of experts: the MLP of blocks %s is %lld experts of its shape, top-%lld per token, %s; %.2f M "
          "parameters, %.2f M active per token\n",
          blocks.c_str(), (long long)config.experts, (long long)config.top_k, capacity,
          double(config.unique_parameters()) / 1e6, double(config.active_parameters()) / 1e6);
    }
  }

  /// Counts steps from `updates` on (a resumed run's first).
  void start(std::int64_t updates) { updates_ = updates; }

  /// The steps since the last call (`updates`: the steps done so far), summed over every rank;
  /// printed when `print` (the leader). The balance loss and z-loss are each layer's mean over the
  /// step's sequences or tokens, averaged over the MoE layers and the steps (a balance loss of 1: every
  /// expert as likely as it is chosen, evenly).
  template <class Say>
  void interval(std::int64_t updates, Say&& say, bool print) {
    if constexpr (config.experts > 0) {
      cupipe::moe::Tally t = take();
      const double steps = double(updates - updates_);
      updates_ = updates;
      total_.add(t);
      total_steps_ += steps;
      if (print && steps > 0)
        say("  experts: balance loss %.3f per layer (1: even), z-loss %.2f, aux loss %.4f a step; %.2f%% of slots "
            "dropped; busiest expert %.2fx the mean load\n",
            t.balance_loss / (steps * double(config.moe_blocks())), t.z_loss / (steps * double(config.moe_blocks())),
            t.aux_loss / steps, 100 * t.drop_fraction(), t.max_over_mean_load());
      if (print && steps > 0 && t.all_to_all_seconds > 0)
        say("  experts: all-to-all %.2f ms a step per rank, %.2f ms of it exposed (measured; the rest ran beside "
            "compute)\n",
            1e3 * t.all_to_all_seconds / (steps * ranks()), 1e3 * t.exposed_all_to_all_seconds / (steps * ranks()));
      if (print && steps > 0 && t.all_to_alls_beside_partner > 0)
        say("  experts: %lld of %lld all-to-alls ran while the paired action computed (DualPipeV's F&B pairs taking "
            "turns)\n",
            (long long)t.all_to_alls_beside_partner, (long long)t.all_to_alls);
    }
  }

  /// The whole run's totals (what interval() took), for the JSON summary.
  nlohmann::json summary() const {
    const cupipe::moe::Tally& t = total_;
    return {{"experts", config.experts},
            {"top_k", config.top_k},
            {"moe_every", config.moe_every},
            {"capacity_factor", config.capacity_factor},
            {"active_parameters", config.active_parameters()},
            {"routed_slots", t.routed},
            {"dropped_slots", t.dropped},
            {"dropped_fraction", t.drop_fraction()},
            {"max_over_mean_load", t.max_over_mean_load()},
            {"balance_loss_per_layer", total_steps_ > 0 ? t.balance_loss / (total_steps_ * double(config.moe_blocks())) : 0.0},
            {"aux_loss_per_step", total_steps_ > 0 ? t.aux_loss / total_steps_ : 0.0},
            {"all_to_all_seconds_per_step_per_rank", total_steps_ > 0 ? t.all_to_all_seconds / (total_steps_ * ranks()) : 0.0},
            {"exposed_all_to_all_seconds_per_step_per_rank",
             total_steps_ > 0 ? t.exposed_all_to_all_seconds / (total_steps_ * ranks()) : 0.0},
            {"all_to_alls", t.all_to_alls},
            {"all_to_alls_beside_partner", t.all_to_alls_beside_partner},
            {"load", t.load}};
  }

 private:
  /// This process's tallies summed and cleared, then summed over every rank.
  cupipe::moe::Tally take() {
    cupipe::moe::Tally t;
    t.load.assign(std::size_t(config.experts), 0);
    for (cupipe::moe::Tally& local : tallies_) {
      t.add(local);
      local = {};
    }
    if (comm_ != nullptr) {
      std::vector<double> v{t.balance_loss, t.z_loss, t.aux_loss, double(t.routed), double(t.dropped), double(t.layers),
                            t.all_to_all_seconds, t.exposed_all_to_all_seconds, double(t.all_to_alls),
                            double(t.all_to_alls_beside_partner)};
      constexpr std::size_t loads = 10;  // where the load per expert starts in v
      for (std::int64_t l : t.load) v.push_back(double(l));
      comm_->sum_over_world(v.data(), v.size());
      t.balance_loss = v[0];
      t.z_loss = v[1];
      t.aux_loss = v[2];
      t.routed = std::int64_t(v[3]);
      t.dropped = std::int64_t(v[4]);
      t.layers = int(v[5]);
      t.all_to_all_seconds = v[6];
      t.exposed_all_to_all_seconds = v[7];
      t.all_to_alls = std::int64_t(v[8]);
      t.all_to_alls_beside_partner = std::int64_t(v[9]);
      for (std::size_t e = 0; e < t.load.size(); ++e) t.load[e] = std::int64_t(v[loads + e]);
    }
    return t;
  }
  /// Ranks whose tallies take() sums.
  double ranks() const { return comm_ ? double(comm_->topology().world) : 1.0; }
  cupipe::comm::Communicator* comm_;
  std::array<cupipe::moe::Tally, std::size_t(P)> tallies_{};
  cupipe::moe::Tally total_{};
  std::int64_t updates_ = 0;  ///< the steps done at the last interval()
  double total_steps_ = 0;
};

}  // namespace gpt_trainer
