// SPDX-License-Identifier: Apache-2.0
// PairedTurns: DualPipeV's overlapped F&B pair, where the two actions' mixture-of-experts layers send
// their tokens round an expert-parallel group. DeepSeek-V3 pairs a forward chunk with a backward
// chunk so that one's all-to-all runs while the other computes. The F runs on a second thread (the
// worker's, kept for the pipeline's life) and the two take turns: each runs until it has started an
// all-to-all and is about to wait for it (comm::let_partner_run, called by moe::Transfer::finish),
// then the other runs until it does the same or ends. The F goes first, as the pair's F is first in
// the plan.
// - On the host (one thread of compute) the communicator's progress thread moves the tokens while
//   the other action computes.
// - On CUDA the pair also runs on two streams (backend::capabilities::overlap_begin): the F's ops on
//   the side stream, the B's on the main one, and each action's turn restores its stream. Without
//   turns the one thread that drives the context waits on the host for the F's routing, counts and
//   all-to-all before it queues any of the B's kernels; with them the B's kernels are queued, and
//   run, while the F's tokens travel on the expert group's stream (NCCL's), and the other way round.
//
// Only one of the two runs (computes, or queues work) at any time, so they share the worker's
// context, its tables and its tally without locks (each turn is handed over under a mutex, which
// orders the two threads' memory). What a context holds for the action running now (the
// microbatch's document borders, the loss normalizer, the expert group, a device's stream) is each
// action's own: saved when it hands over its turn, restored when it takes it back (take_turns). The arithmetic of each action is unchanged and in the same
// order, so the numbers are bitwise those of the two run back to back.
//
// The turns are the same on every rank of an expert-parallel group: each rank runs the same pair of
// the same schedule through the same layers, so each hands over at the same points and starts the
// two actions' all-to-alls in the same order. The F's go round a group of their own
// (Communicator::paired_expert_group, the context's paired_expert_group): each group then has one
// all-to-all in flight at a time, as moe::ExpertGroup requires. (On NCCL the two groups' transfers
// are then in flight at once on two communicators, issued in the same order on every rank.)
//
// PipelineOptions::paired_turns turns it on (off by default: where the ranks have no spare cores the
// all-to-all is CPU work and each hand-over waits for the scheduler, so the turns cost time; the
// 2-core VM's figures are in docs/benchmarks.md. On CUDA it has not run on a GPU yet:
// docs/gpu_notes.md).
//
// A wait for the turn ends when the other action hands it back or ends; that action's own waits
// (a message, a collective) have their deadlines, so this wait has theirs.
#pragma once

#include <array>
#include <condition_variable>
#include <exception>
#include <functional>
#include <mutex>
#include <thread>
#include <utility>

#include "cupipe/comm/turns.hpp"
#include "cupipe/core/documents.hpp"
#include "cupipe/core/shape.hpp"
#include "cupipe/moe/expert_group.hpp"

namespace cupipe::pipeline {

class PairedTurns {
 public:
  /// Starts the thread that runs each pair's first action; it waits for pairs until the object goes.
  /// (A thread per pair made the turns 17-23% slower than the pair back to back on the 2-core VM,
  /// likely the host BLAS setting up its buffers in each new thread: docs/benchmarks.md.)
  PairedTurns() { helper_ = std::thread([this] { serve(); }); }
  ~PairedTurns() {
    {
      const std::lock_guard lock(mutex_);
      stopping_ = true;
    }
    changed_.notify_all();
    helper_.join();
  }
  PairedTurns(const PairedTurns&) = delete;
  PairedTurns& operator=(const PairedTurns&) = delete;

  /// Runs `first` on this object's thread and `second` on the caller's, taking turns, `first` first.
  /// `enter(i)` runs on action i's thread each time it takes its turn (the first time too), and
  /// `leave(i)` each time it hands the turn over and when it ends; action 0 is the first. Returns
  /// each one's exception (null where it ended normally): an action that throws ends its turns
  /// there, and the other runs on to its end. One pair at a time.
  std::array<std::exception_ptr, 2> run(const std::function<void()>& first, const std::function<void()>& second,
                                        std::function<void(int)> enter, std::function<void(int)> leave) {
    {
      const std::lock_guard lock(mutex_);
      enter_ = std::move(enter);
      leave_ = std::move(leave);
      first_ = &first;
      turn_ = 0;
      done_ = {false, false};
      errors_ = {};
      posted_ = true;
    }
    changed_.notify_all();
    take_part(1, second);
    std::unique_lock lock(mutex_);
    changed_.wait(lock, [&] { return done_[0]; });
    first_ = nullptr;
    return errors_;
  }

  /// Turns handed from one action to the other while both ran, over every run.
  long hand_overs() const noexcept { return hand_overs_; }

 private:
  class Party final : public comm::TurnPartner {
   public:
    void set(PairedTurns* turns, int me) {
      turns_ = turns;
      me_ = me;
    }
    bool hand_over() override { return turns_->hand_over(me_); }

   private:
    PairedTurns* turns_ = nullptr;
    int me_ = 0;
  };

  void serve() {
    for (;;) {
      const std::function<void()>* job = nullptr;
      {
        std::unique_lock lock(mutex_);
        changed_.wait(lock, [&] { return posted_ || stopping_; });
        if (!posted_) return;
        posted_ = false;
        job = first_;
      }
      take_part(0, *job);
    }
  }

  void take_part(int me, const std::function<void()>& action) {
    await(me);
    Party& party = parties_[std::size_t(me)];
    party.set(this, me);
    comm::detail::turn_partner = &party;
    try {
      enter_(me);
      action();
    } catch (...) {
      errors_[std::size_t(me)] = std::current_exception();
    }
    try {
      leave_(me);
    } catch (...) {
      if (!errors_[std::size_t(me)]) errors_[std::size_t(me)] = std::current_exception();
    }
    comm::detail::turn_partner = nullptr;
    const std::lock_guard lock(mutex_);
    done_[std::size_t(me)] = true;
    turn_ = 1 - me;
    changed_.notify_all();
  }

  bool hand_over(int me) {
    {
      const std::lock_guard lock(mutex_);
      if (done_[std::size_t(1 - me)]) return false;
    }
    leave_(me);
    {
      std::unique_lock lock(mutex_);
      turn_ = 1 - me;
      ++hand_overs_;
      changed_.notify_all();
      changed_.wait(lock, [&] { return turn_ == me; });
    }
    enter_(me);
    return true;
  }

  void await(int me) {
    std::unique_lock lock(mutex_);
    changed_.wait(lock, [&] { return turn_ == me; });
  }

  std::mutex mutex_;
  std::condition_variable changed_;
  std::function<void(int)> enter_, leave_;
  const std::function<void()>* first_ = nullptr;  ///< the pair's first action, posted to the thread
  bool posted_ = false, stopping_ = false;
  int turn_ = 0;
  std::array<bool, 2> done_{};
  std::array<std::exception_ptr, 2> errors_{};
  std::array<Party, 2> parties_{};
  long hand_overs_ = 0;
  std::thread helper_;  // started last, in the constructor's body: every member above is ready
};

/// A context whose overlapped pairs can take turns: one with the fields take_turns gives each
/// action (a host context, or a CUDA one, whose actions also each keep their own stream).
template <class B>
concept can_take_turns = requires(B& be) {
  be.documents;
  be.aux_loss_normalizer;
  be.expert_group;
  be.paired_expert_group;
};

/// Whether an overlapped pair on context `be` takes turns: a context whose mixture-of-experts layers
/// have an expert-parallel group, and a second one for the pair's F.
template <class B>
bool takes_turns(const B& be) {
  if constexpr (can_take_turns<B>) return be.paired_expert_group != nullptr && be.expert_group != nullptr;
  else return false;
}

/// Runs the pair's F (`first`) and B (`second`) on context `be` taking turns (takes_turns(be)) with
/// `turns` (the worker's), each with its own document borders, loss normalizer and expert group: the
/// F's is be.paired_expert_group. On a device context each also keeps its own stream: the F opens the
/// overlap (the side stream) and the B runs on the main stream; the caller joins them afterwards.
/// Returns each one's exception, as PairedTurns::run.
template <can_take_turns B>
std::array<std::exception_ptr, 2> take_turns(B& be, PairedTurns& turns, const std::function<void()>& first,
                                             const std::function<void()>& second) {
  constexpr bool streams = requires { be.side_stream(); };
  struct Fields {
    DocumentStarts documents{};
    index_t normalizer = 0;
    moe::ExpertGroup* experts = nullptr;
    bool side = false;  ///< a device context's: the action's ops go to the side stream
  };
  moe::ExpertGroup* const own = be.expert_group;
  std::array<Fields, 2> fields{Fields{{}, 0, be.paired_expert_group, false}, Fields{{}, 0, own, false}};
  const auto enter = [&](int i) {
    const Fields& f = fields[std::size_t(i)];
    be.documents = f.documents;
    be.aux_loss_normalizer = f.normalizer;
    be.expert_group = f.experts;
    if constexpr (streams) be.side_stream(f.side);
  };
  const auto leave = [&](int i) {
    bool side = false;
    if constexpr (streams) side = be.side_stream();
    fields[std::size_t(i)] = {be.documents, be.aux_loss_normalizer, be.expert_group, side};
  };
  std::array<std::exception_ptr, 2> errors = turns.run(first, second, enter, leave);
  be.documents = {};
  be.aux_loss_normalizer = 0;
  be.expert_group = own;
  if constexpr (streams) be.side_stream(false);
  return errors;
}

}  // namespace cupipe::pipeline
