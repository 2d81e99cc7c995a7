// SPDX-License-Identifier: Apache-2.0
// ZeRO-3 (PipelineOptions::zero = 3; Rajbhandari et al., 2020, stage 3; FSDP's sharded parameters):
// each data-parallel replica keeps its shard of every stage's weights (StageState::param_shard, the
// float master values with bf16 storage), which its optimizer updates; the gradients are sharded as
// with ZeRO-2 (gradient_shards.hpp) and the optimizer state as with ZeRO-1.
//
// A virtual stage's whole weights exist only where an action needs them. Before a stage's forward or
// backward (a W reads no weights) ParameterShards::before makes sure they are gathered over the
// replicas into the stage's weights in use; where PipelineOptions::reshard_after_forward is on,
// ParameterShards::after releases them once the worker's next action is on another virtual stage, or
// the step ends. The update makes them stale: apply_flush releases what is still held.
//
// Prefetch (where the communicator starts gathers: MpiCommunicator): as an action starts, the gather
// of the next virtual stage this worker will need and does not hold is started, into a host buffer
// (StageState::gathering), and runs while the action computes; that stage's next action finishes it.
// At most one gather is in flight, so a worker holds at most two stages' whole weights at once. A
// worker's first action of a step, and a communicator that cannot start gathers, wait for a gather.
//
// The replicas of a stage walk the same actions with the same weights held, so they start and finish
// the same gathers in the same order. Gathers travel through host memory (gather_shards, as ZeRO-1's
// gather of the updated shards does), on any backend.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <span>
#include <type_traits>
#include <vector>

#include "cupipe/comm/communicator.hpp"
#include "cupipe/core/error.hpp"
#include "cupipe/core/memory.hpp"
#include "cupipe/core/tensor.hpp"
#include "cupipe/pipeline/optimizer_step.hpp"
#include "cupipe/pipeline/stats.hpp"
#include "cupipe/schedule/action.hpp"

namespace cupipe::pipeline {

/// ZeRO-3: the stage's whole weights in use made from `all` (every replica's shard, param_count
/// values in host memory): with bf16 storage their rounding to nearest even, as ZeRO-1's publish
/// makes it.
template <class St>
void place_gathered(St& st, std::span<const typename St::G> all) {
  using B = std::remove_reference_t<decltype(*st.be)>;
  using G = typename St::G;
  constexpr index_t n = St::param_count;
  st.weights.hold();
  if constexpr (St::master_weights) {
    auto whole = st.be->template allocate<G>(n, MemoryTag::workspace);
    st.be->upload(all.first(std::size_t(n)), whole.data());
    if (n > 0) convert(*st.be, ConstViewOn<B, G>{whole.data(), Shape{n}}, ViewOn<B, typename St::T>{st.weights.latest_data(), Shape{n}});
    st.be->synchronize();  // the float copy goes back to the pool only once the kernel has read it
  } else {
    st.be->upload(all.first(std::size_t(n)), st.weights.latest_data());
  }
}

/// ZeRO-3: gathers the stage's whole weights over the replicas now, unless they are held.
template <class St>
void gather_parameters(comm::Communicator& comm, St& st) {
  if (st.weights.held()) return;
  const std::vector<typename St::G> all = gather_shards(comm, st, st.param_shard.data());
  place_gathered(st, std::span<const typename St::G>(all));
}

/// ZeRO-3 prefetch: starts the gather of the stage's whole weights into st.gathering
/// (comm.starts_gathers()); finish_gather completes it.
template <class St>
void start_gather(comm::Communicator& comm, St& st) {
  st.gathering.assign(static_cast<std::size_t>(st.shard.stride * st.shard.replicas), typename St::G(0));
  st.be->synchronize();
  if (st.shard.size() > 0)
    st.be->download(st.param_shard.data(), std::span<typename St::G>(st.gathering.data() + st.shard.begin, std::size_t(st.shard.size())));
  comm.start_all_gather_over_replicas(st.gathering.data(), std::size_t(st.shard.stride));
}
/// Waits for the started gather and makes the stage's whole weights from it.
template <class St>
void finish_gather(comm::Communicator& comm, St& st) {
  comm.finish_gathers();
  place_gathered(st, std::span<const typename St::G>(st.gathering));
  st.gathering = {};
}

/// Where a pipeline's workers gather, prefetch and release their stages' weights under ZeRO-3; off
/// (every call does nothing) without it or without replicas. With a communicator a process runs one
/// worker, so one thread calls the hooks.
template <class States>
class ParameterShards {
 public:
  /// `on`: ZeRO-3 shards the parameters over the replicas of `comm`; `reshard_after_forward` as
  /// PipelineOptions says. `plan` is the plan whose actions the hooks receive (by reference).
  ParameterShards(States& states, const schedule::Plan& plan, comm::Communicator* comm, bool on, bool reshard_after_forward)
      : states_(states), plan_(plan), comm_(comm), on_(on && comm != nullptr), reshard_(reshard_after_forward) {}

  bool on() const noexcept { return on_; }
  /// How many gathers ran since the pipeline was made (each a collective over one stage's replicas),
  /// and how many of them were prefetched.
  struct Count {
    std::int64_t gathers = 0, prefetched = 0;
  };
  Count count() const noexcept { return {gathers_.load(), prefetched_.load()}; }
  /// A step's gathers, those since `start` (count() before it), into its stats.
  void report(StepStats& stats, Count start) const noexcept {
    stats.parameter_gathers = gathers_.load() - start.gathers;
    stats.prefetched_parameter_gathers = prefetched_.load() - start.prefetched;
  }

  /// Before action `a` of worker `w` (one of plan.actions[w], on w's thread): a forward or
  /// backward's virtual stage has its whole weights (the prefetched gather finished, else gathered
  /// now); then the next stage the worker needs and does not hold starts its gather.
  void before(int w, const schedule::Action& a) {
    if (!on_) return;
    const std::size_t at = index_of(w, a);
    const int v = plan_.virtual_stage(w, a);
    if (a.kind != schedule::ActionKind::W) {
      if (pending_ == v) finish_pending();
      else states_.visit(v, [&](auto, auto& st) { gather(st); });
    }
    if (pending_ >= 0 || !comm_->starts_gathers()) return;
    const int next = next_stage_[std::size_t(w)][at];
    if (next < 0) return;
    states_.visit(next, [&](auto, auto& st) {
      if (st.weights.held()) return;
      start_gather(*comm_, st);
      pending_ = next;
    });
  }
  /// After action `a` of worker `w`: with reshard_after_forward, its virtual stage releases its
  /// whole weights unless the worker's next action is on the same virtual stage.
  void after(int w, const schedule::Action& a) {
    if (!on_ || !reshard_) return;
    const std::vector<schedule::Action>& actions = plan_.actions[std::size_t(w)];
    const std::size_t at = index_of(w, a);
    const int v = plan_.virtual_stage(w, a);
    if (at + 1 < actions.size() && plan_.virtual_stage(w, actions[at + 1]) == v) return;
    states_.visit(v, [](auto, auto& st) { st.drop_weights(); });
  }
  /// After a failed step: a prefetched gather still in flight is finished (MPI writes into its
  /// buffer until then; the other replicas start theirs whatever happened here).
  void abandon() noexcept {
    if (pending_ < 0) return;
    try {
      comm_->finish_gathers();
    } catch (...) {
    }
    states_.visit(pending_, [](auto, auto& st) { st.gathering = {}; });
    pending_ = -1;
  }

  /// Runs `predict` (through every local stage) with their whole weights gathered; with
  /// reshard_after_forward they are released after it.
  template <class Predict>
  auto gathered(Predict&& predict) {
    if (on_) states_.for_each([&](auto, auto& st) { gather(st); });
    auto out = predict();
    if (on_ && reshard_) states_.for_each([](auto, auto& st) { st.drop_weights(); });
    return out;
  }

 private:
  /// Where `a` is in worker w's actions; finds, once, each action's next stage to prefetch.
  std::size_t index_of(int w, const schedule::Action& a) {
    const std::vector<schedule::Action>& actions = plan_.actions[std::size_t(w)];
    const std::ptrdiff_t at = &a - actions.data();
    CUPIPE_REQUIRE(at >= 0 && std::size_t(at) < actions.size(), "ParameterShards: the action is not one of worker ", w,
                   "'s plan");
    if (next_stage_.empty()) next_stage_.resize(plan_.actions.size());
    if (next_stage_[std::size_t(w)].size() != actions.size()) next_stage_[std::size_t(w)] = next_stages(w);
    return std::size_t(at);
  }
  /// [i]: the virtual stage of worker w's first forward or backward after action i on another
  /// virtual stage than action i's; -1 where there is none.
  std::vector<int> next_stages(int w) const {
    const std::vector<schedule::Action>& actions = plan_.actions[std::size_t(w)];
    std::vector<int> next(actions.size(), -1);
    // Of the forwards and backwards after action i: the first one's stage, and the first one's on
    // another stage than that.
    int first = -1, other = -1;
    for (std::size_t i = actions.size(); i-- > 0;) {
      const int v = plan_.virtual_stage(w, actions[i]);
      next[i] = first != v ? first : other;
      if (actions[i].kind == schedule::ActionKind::W) continue;
      if (first != v) other = first;
      first = v;
    }
    return next;
  }

  template <class St>
  void gather(St& st) {
    if (st.weights.held()) return;
    gather_parameters(*comm_, st);
    ++gathers_;
  }
  void finish_pending() {
    states_.visit(pending_, [&](auto, auto& st) { finish_gather(*comm_, st); });
    pending_ = -1;
    ++gathers_;
    ++prefetched_;
  }

  States& states_;
  const schedule::Plan& plan_;
  comm::Communicator* comm_;
  bool on_;
  bool reshard_;
  int pending_ = -1;  ///< the virtual stage whose prefetched gather is in flight; -1: none
  std::vector<std::vector<int>> next_stage_;  ///< [worker][action]: next_stages, made at first use
  std::atomic<std::int64_t> gathers_{0}, prefetched_{0};
};

}  // namespace cupipe::pipeline
