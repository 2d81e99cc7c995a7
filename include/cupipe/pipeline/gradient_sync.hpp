// SPDX-License-Identifier: Apache-2.0
// GradientSync: the one owner of where replicas and tensor-parallel ranks meet over gradients, and
// of the flush update that follows. A Pipeline calls it; it calls down only (optimizer_step.hpp's
// sums, norms and updates, and the communicator), never back up.
//   - early sums: inside a train_step, each virtual stage's sum over the replicas starts as soon as
//     its last weight-gradient action is done (after_action), while the worker goes on;
//   - the flush reduction: whatever a step left unsummed is summed before the update (reduce);
//   - ZeRO-1: reduce-scatter of the gradients, the sharded norm, the gather of the updated shards;
//   - ZeRO-2: the same with the gradients kept as shards, their reduce-scatters started inside the
//     step like the early sums (gradient_shards.hpp);
//   - the tensor-parallel norm: split tensors' squares summed over the group, replicated ones once;
//   - expert parallelism: the experts' tensors summed over the replicas that hold them, the rest
//     over all (pipeline/expert_parallel.hpp), and the norm as tensor parallelism's over the group;
//   - the flush update itself (flush_update), refused when the norm is not finite.
// The asynchronous schedules' per-stage updates run inside the step, where a stage's last
// microbatch completes (StageExecutor::finish); post-validated steps update at each worker's step
// boundary (post_validated_run.hpp). Both call optimizer_step.hpp's update_stage.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <vector>

#include "cupipe/comm/communicator.hpp"
#include "cupipe/core/error.hpp"
#include "cupipe/layers/tensor_parallel.hpp"
#include "cupipe/pipeline/expert_parallel.hpp"
#include "cupipe/pipeline/gradient_shards.hpp"
#include "cupipe/pipeline/optimizer_step.hpp"
#include "cupipe/schedule/action.hpp"

namespace cupipe::pipeline {

/// Where a pipeline's gradients are summed: the communicator (null: one process), this stage's
/// split group (null: none; the tensor-parallel group, or the expert-parallel one), the ZeRO stage (PipelineOptions::zero) and whether the
/// finite-norm check is on.
struct SyncSetup {
  comm::Communicator* comm = nullptr;
  TensorGroup* tensor_group = nullptr;
  int zero = 0;
  bool check_finite = true;
};

/// `States` holds the stages' gradients; `Model` gives the parameter table and the tied copies;
/// `FirstBackend` is the memory the early sums read (comm::reads_backend_memory).
template <class States, class Model, class FirstBackend, bool Flush>
class GradientSync {
 public:
  static constexpr TiedCopies tied = Model::body::tied;

  GradientSync(States& states, const schedule::Plan& plan, SyncSetup setup)
      : states_(states), plan_(plan), setup_(setup),
        experts_(setup.comm && layers::tensor_parallel::parts_of(Model::parameter_table(), true) > 1
                     ? setup.comm->expert_group() : nullptr) {}

  comm::Communicator* comm() const noexcept { return setup_.comm; }
  bool replicated() const noexcept { return comm() && comm()->topology().replicas > 1; }
  /// Whether ZeRO shards anything here (the optimizer state): it is on, and there are replicas.
  bool zero_sharded() const noexcept { return setup_.zero >= 1 && replicated(); }
  /// Whether ZeRO-2 keeps the gradients as shards here.
  bool gradients_sharded() const noexcept { return setup_.zero >= 2 && replicated(); }

  /// Whether a train_step's stage sums (or, with ZeRO-2, reduce-scatters) may start inside the
  /// step: data parallelism under a flush schedule with a communicator that starts them and reads
  /// the backend's memory; not with ZeRO-1, which reduce-scatters at the update.
  bool overlaps_sums() const {
    if (!Flush || !replicated() || experts_ || !comm::reads_backend_memory<FirstBackend>(*comm())) return false;
    if (gradients_sharded()) return comm()->starts_reduce_scatters();
    return comm()->starts_sums() && !setup_.zero;
  }

  /// Before a step whose stage sums start early: finds, once, the action after which each virtual
  /// stage's gradients are complete (its last W where the plan splits the backward, else its last B).
  void prepare_early_sums() {
    started_.assign(std::size_t(States::size), 0);
    if (!last_gradient_action_.empty()) return;
    last_gradient_action_.assign(std::size_t(States::size), schedule::Action{schedule::ActionKind::F, -1, -1});
    const schedule::ActionKind weights = plan_.split_backward ? schedule::ActionKind::W : schedule::ActionKind::B;
    for (int w = 0; w < int(plan_.actions.size()); ++w)
      for (const schedule::Action& a : plan_.actions[std::size_t(w)])
        if (a.kind == weights) last_gradient_action_[std::size_t(plan_.virtual_stage(w, a))] = a;
  }
  /// After action `a` of worker `w` (on w's thread): if it completed its virtual stage's gradients,
  /// starts that stage's sum over the replicas (with ZeRO-2 its reduce-scatter, unless the stage
  /// holds a tied copy, whose sum with the other copy comes first, at the update).
  void after_action(int w, const schedule::Action& a) {
    if (a.kind == schedule::ActionKind::F) return;
    const int v = plan_.virtual_stage(w, a);
    if (!(last_gradient_action_[std::size_t(v)] == a)) return;
    bool started = true;
    states_.visit(v, [&](auto k, auto& st) {
      if (gradients_sharded()) {
        started = !holds_tied_copy(tied, States::template model_offset<decltype(k)::value>(), st.param_count);
        if (started) start_scatter(*comm(), st);
        return;
      }
      st.be->synchronize();
      comm()->start_sum_over_replicas(st.grads.data(), std::size_t(st.param_count));
    });
    started_[std::size_t(v)] = started ? 1 : 0;
  }
  /// How many stage sums the step started early.
  int started() const { return int(std::count(started_.begin(), started_.end(), 1)); }

  /// After a step's backward: its gradients are this replica's own until reduce() sums them (a flush
  /// update, or gradients(), does; steps of forward_backward accumulate locally first).
  void step_done() {
    if (Flush && replicated()) unreduced_ = true;
  }
  /// After a failed step: sums already started write into the gradients, so they end first (the
  /// other replicas start theirs whatever happened here; a failure of theirs ends in the collective
  /// timeout); then every local stage's gradients are zeroed.
  void abandon_step() {
    if (any_started()) {
      try {
        comm()->finish_sums();
      } catch (...) {
      }
      std::fill(started_.begin(), started_.end(), 0);
    }
    states_.for_each([](auto, auto& st) { st.zero_grads(); });
  }

  /// Sums the accumulated gradients over the replicas if a step left them unsummed: the sums started
  /// during a backward are finished, the other stages summed now. With ZeRO-2 each replica keeps
  /// its shard of the sums (scatter()).
  void reduce() {
    if (gradients_sharded()) return scatter();
    if (!unreduced_) return;
    const bool early = any_started();
    if (early) comm()->finish_sums();
    states_.for_each([&](auto k, auto& st) {
      if (early && started_[std::size_t(decltype(k)::value)]) return;
      if (experts_) sum_expert_parallel(*comm(), *experts_, st, ranges(k, st));
      else sum_over_replicas(comm(), st);
    });
    std::fill(started_.begin(), started_.end(), 0);
    unreduced_ = false;
  }

  /// `read()` (Pipeline::gradients) on the gradients summed over the replicas, the accumulation
  /// left able to go on: without ZeRO-2 the sum is made in place, so after the read only the first
  /// replica keeps it and the others zero theirs. The state is then again one term per replica, the
  /// same sum (exactly: the others add zeros), for more forward_backward passes to add to and the
  /// update to sum. ZeRO-2 and -3 keep their summed shards apart from what a backward adds.
  template <class Read>
  auto read_summed(Read&& read) {
    const bool summed_in_place = unreduced_ && !gradients_sharded();
    reduce();
    if (!summed_in_place) return read();
    const auto split = [&] {  // also where read() throws: the sum must not count twice later
      if (experts_) states_.for_each([&](auto k, auto& st) { keep_one_sum(comm()->topology(), st, ranges(k, st)); });
      else if (comm()->topology().replica() != 0) states_.for_each([](auto, auto& st) { st.zero_grads(); });
      unreduced_ = true;
    };
    try {
      auto out = read();
      split();
      return out;
    } catch (...) {
      split();
      throw;
    }
  }

  /// The flush update from the accumulated gradients; returns the global gradient norm before
  /// clipping. With ZeRO-1 (and a communicator that can) the gradients are reduce-scattered, each
  /// replica receiving only its shard's sums, and the updated shards gathered after; else all-reduced.
  template <class Optimizer>
  double flush_update(const Optimizer& optimizer) {
    double norm = 0;
    if (gradients_sharded()) {
      scatter();
      norm = sharded_flush_norm(states_, *comm(), Model::parameter_table(), tied);
    } else if (zero_sharded() && unreduced_ && comm()->reduce_scatters()) {
      // The tied copies' gradients are summed over the stages first, each replica its own, so that
      // every shard of either copy receives the whole sum from the reduce-scatter.
      if constexpr (tied.count > 0) (void)sum_tied_gradients(states_, comm(), tied);
      states_.for_each([&](auto, auto& st) { reduce_scatter_over_replicas(*comm(), st); });
      unreduced_ = false;
      norm = sharded_flush_norm(states_, *comm(), Model::parameter_table(), tied);
    } else {
      reduce();
      norm = setup_.tensor_group ? tensor_parallel_norm() : flush_norm(states_, comm(), tied);
    }
    refuse_non_finite(norm);
    apply_flush(states_, optimizer, norm);
    if (zero_sharded()) states_.for_each([&](auto, auto& st) { gather_updated_weights(comm(), st); });
    return norm;
  }

  /// Throws, with every gradient zeroed, where the norm is not finite and check_finite is on.
  void refuse_non_finite(double norm) {
    if (!setup_.check_finite || std::isfinite(norm)) return;
    states_.for_each([](auto, auto& st) { st.zero_grads(); });
    unreduced_ = false;
    CUPIPE_THROW("Pipeline: the global gradient norm is ", norm, " (a gradient is not finite); the update was not "
                 "applied, and the weights are those before this step (PipelineOptions::check_finite)");
  }

 private:
  /// ZeRO-2: if a step left the gradients unsummed, every stage's whole buffer reduce-scattered
  /// into its shard and released: the scatters started during the backward finished, the tied
  /// copies' gradients summed over the stages (each replica its own, so that every shard of either
  /// copy receives the whole sum), then the other stages reduce-scattered now.
  void scatter() {
    if (!unreduced_) return;
    const bool early = any_started();
    if (early) comm()->finish_sums();
    if constexpr (tied.count > 0) (void)sum_tied_gradients(states_, comm(), tied);
    states_.for_each([&](auto k, auto& st) {
      if (early && started_[std::size_t(decltype(k)::value)]) keep_own_block(st);
      else scatter_gradients(*comm(), st);
    });
    std::fill(started_.begin(), started_.end(), 0);
    unreduced_ = false;
  }

  /// Stage k's experts' and other tensors' ranges.
  template <class K, class St>
  static ExpertRanges ranges(K, const St& st) {
    return ExpertRanges(Model::parameter_table(), States::template model_offset<K::value>(), st.param_count);
  }

  bool any_started() const { return std::find(started_.begin(), started_.end(), 1) != started_.end(); }

  /// The global gradient norm with tensor parallelism: split tensors' squares summed over the group,
  /// replicated tensors' (the same on every rank of it) once; the second tied copy left out (from
  /// the split sum where the copies are split, as a vocabulary-parallel wte and lm_head are).
  double tensor_parallel_norm() {
    double split = 0, replicated = 0;
    const std::vector<ParamInfo> table = Model::parameter_table();
    if constexpr (tied.count > 0)
      (split_at(table, tied.second) ? split : replicated) -= sum_tied_gradients(states_, comm(), tied);
    states_.for_each([&](auto k, auto& st) {
      constexpr index_t offset = States::template model_offset<decltype(k)::value>();
      for (const ParamInfo& p : table) {
        if (p.offset < offset || p.offset >= offset + st.param_count) continue;
        using St = std::remove_reference_t<decltype(st)>;
        const double s = sum_of_squares(*st.be, ConstViewOn<typename St::backend_type, typename St::G>{
                                                    st.grads.data() + (p.offset - offset), Shape{p.numel}});
        (p.split == TensorSplit::none ? replicated : split) += s;
      }
    });
    double sums[1] = {split};
    setup_.tensor_group->sum(sums, 1);
    return std::sqrt(comm()->sum_over_stages(sums[0] + replicated));
  }

  States& states_;
  const schedule::Plan& plan_;
  SyncSetup setup_;
  moe::ExpertGroup* experts_;  ///< with experts split over it, the expert-parallel group (null: none)
  bool unreduced_ = false;     ///< this replica's own sums, not yet over the replicas
  std::vector<char> started_;  ///< [virtual stage]: its sum was started in the step (one writer each)
  std::vector<schedule::Action> last_gradient_action_;  ///< [virtual stage], computed once
};

}  // namespace cupipe::pipeline
