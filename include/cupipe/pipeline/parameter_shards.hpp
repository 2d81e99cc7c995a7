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
#include "cupipe/schedule/weight_readers.hpp"

namespace cupipe::pipeline {

/// ZeRO-3: the stage's whole weights in use made from `all` (every replica's shard, param_count
/// values in host memory): with bf16 storage their rounding to nearest even, made on the host as
/// the backends' convert makes it (ZeRO-1's publish), so that no float copy of the stage is held
/// in the backend's memory. A failure leaves the weights released, never held unfilled.
template <class St>
void place_gathered(St& st, std::span<const typename St::G> all) {
  using T = typename St::T;
  constexpr index_t n = St::param_count;
  st.weights.hold();
  try {
    if constexpr (St::master_weights) {
      std::vector<T> rounded(static_cast<std::size_t>(n));
      for (std::size_t i = 0; i < rounded.size(); ++i) rounded[i] = T(all[i]);
      st.be->upload(std::span<const T>(rounded), st.weights.latest_data());
    } else {
      st.be->upload(all.first(std::size_t(n)), st.weights.latest_data());
    }
  } catch (...) {
    st.weights.release();
    throw;
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
  st.gathering = own_block(st, st.param_shard.data());
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
    const int next = walk_[std::size_t(w)].prefetch[at];
    if (next < 0) return;
    states_.visit(next, [&](auto, auto& st) {
      if (st.weights.held()) return;
      start_gather(*comm_, st);
      pending_ = next;
    });
  }
  /// After action `a` of worker `w`: with reshard_after_forward, its virtual stage releases its
  /// whole weights unless the worker's next forward or backward is on the same virtual stage. An
  /// overlapped F (DualPipeV's pairs) keeps them: its kernels run beside its partner B, and a
  /// release would wait for them; a later action of the stage, or the update, releases them.
  void after(int w, const schedule::Action& a) {
    if (!on_ || !reshard_ || a.overlap) return;
    const std::size_t at = index_of(w, a);
    const int v = plan_.virtual_stage(w, a);
    if (walk_[std::size_t(w)].next_reader[at] == v) return;
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
  /// Where `a` is in worker w's actions; walks them once first (schedule::weight_readers).
  std::size_t index_of(int w, const schedule::Action& a) {
    const std::vector<schedule::Action>& actions = plan_.actions[std::size_t(w)];
    const std::ptrdiff_t at = &a - actions.data();
    CUPIPE_REQUIRE(at >= 0 && std::size_t(at) < actions.size(), "ParameterShards: the action is not one of worker ", w,
                   "'s plan");
    if (walk_.empty()) walk_.resize(plan_.actions.size());
    if (walk_[std::size_t(w)].next_reader.size() != actions.size()) walk_[std::size_t(w)] = schedule::weight_readers(plan_, w);
    return std::size_t(at);
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
  std::vector<schedule::WeightReaders> walk_;  ///< [worker]: made at its first action
  std::atomic<std::int64_t> gathers_{0}, prefetched_{0};
};

}  // namespace cupipe::pipeline
