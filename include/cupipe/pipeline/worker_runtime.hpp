// SPDX-License-Identifier: Apache-2.0
// WorkerRuntime: one thread per local worker (WorkerThreads: made at the first step, kept for the
// pipeline's life), each walking its action list; the first failure is kept with the action that
// failed, and every other worker is woken (through the transport's abort) and stops. Where the
// pipeline measures actions (PipelineOptions::measure_actions), it also times each action: from when
// its input arrived (waiting is idle, not busy) to its end, on the host clock, or on the backend's
// own clock where it has one (CUDA events); otherwise it records nothing per action and only the
// step's makespan is measured. Each worker's actions and waits also go to the flight recorder
// (flight_recorder.hpp), which says what a hung rank was doing.
#pragma once

#include <array>
#include <atomic>
#include <chrono>
#include <exception>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "cupipe/backend/capabilities.hpp"
#include "cupipe/core/error.hpp"
#include "cupipe/pipeline/flight_recorder.hpp"
#include "cupipe/pipeline/mailbox.hpp"
#include "cupipe/pipeline/paired_turns.hpp"
#include "cupipe/pipeline/stats.hpp"
#include "cupipe/pipeline/worker_threads.hpp"
#include "cupipe/schedule/action.hpp"

namespace cupipe::pipeline {

/// How an error names action `a` of worker `w`: "worker 1 (virtual stage 3), step 2, action B0" (the
/// virtual stage where workers hold several, the step where a flush plan runs several, the first
/// of them `first_step`).
inline std::string action_where(const schedule::Plan& plan, int w, const schedule::Action& a, int first_step = 0) {
  std::string where = "worker " + std::to_string(w);
  if (plan.config.chunks > 1) where += " (virtual stage " + std::to_string(plan.virtual_stage(w, a)) + ")";
  int microbatch = a.microbatch;
  if (plan.update == schedule::UpdateRule::flush && plan.config.batches > 1) {
    where += ", step " + std::to_string(first_step + microbatch / plan.config.microbatches);
    microbatch %= plan.config.microbatches;
  }
  return where + ", action " + schedule::kind_letter(a.kind) + std::to_string(microbatch);
}

/// `Workers` holds each worker's context (pipeline/workers.hpp); workers of other processes have none.
template <class Workers>
class WorkerRuntime {
  template <class B>
  using caps_of = backend::capabilities<std::remove_cvref_t<B>>;

 public:
  /// `measure`: time every action (records, busy and idle per worker, device events); otherwise
  /// only the step's makespan, on the host clock. `pin`: each local worker's thread on a share of
  /// the CPUs of its own (WorkerThreads).
  explicit WorkerRuntime(const Workers& contexts, int count, bool measure = true, FlightSetup flight = {}, bool pin = false)
      : contexts_(contexts),
        workers_(std::size_t(count)),
        measure_(measure),
        flight_(local_workers(contexts, count), std::move(flight)),
        threads_(local_indices(contexts), pin) {}

  /// Runs every local worker's list of `plan` on its own thread; execute(w, action) does the work
  /// and abort() wakes every waiter after a failure. An execute that throws Aborted stops its worker
  /// quietly. Host-clock times count from `origin` (default: now). A flush plan of several batches
  /// is several steps back to back (schedule::repeat_steps), the first of them `first_step`: a
  /// failure names the step and the action's microbatch in it.
  template <class Execute, class Abort>
  std::exception_ptr run(const schedule::Plan& plan, Execute&& execute, Abort&& abort,
                         std::optional<std::chrono::steady_clock::time_point> origin = std::nullopt, int first_step = 0) {
    first_step_ = first_step;
    failure_ = nullptr;
    failed_.store(false, std::memory_order_relaxed);
    for (Worker& worker : workers_) {  // keeps the vectors' capacity: no allocation after the first step
      worker.records.clear();
      worker.marks.clear();
    }
    if (measure_) contexts_.for_each([](int, auto& be) { caps_of<decltype(be)>::timeline_start(be); });
    start_ = origin.value_or(std::chrono::steady_clock::now());
    flight_.step_started(start_);
    auto job = [&](int w) { contexts_.visit(w, [&](auto& be) { walk(be, plan, w, execute, abort); }); };
    threads_.run(job);  // returns when every worker is done, also when one failed
    flight_.step_ended();
    if (!failure_ && measure_) device_times();
    return failure_;
  }

  /// The running action of worker w has its input: its measured time starts now.
  void input_arrived(int w) {
    Worker& worker = workers_[std::size_t(w)];
    worker.action_start = now();
    flight_.arrived(w, worker.action_start);
    if (measure_)
      worker.action_mark = contexts_.visit(w, [](auto& be) { return caps_of<decltype(be)>::timeline_mark(be); });
  }

  /// Worker w's running action waits for `key` from worker `peer` (until input_arrived).
  void awaiting(int w, int peer, const MessageKey& key) noexcept { flight_.awaiting(w, peer, key); }
  const FlightRecorder& flight() const noexcept { return flight_; }

  /// Every action worker w ran in the last step, in order, with measured times (none where actions
  /// are not measured).
  const std::vector<ActionRecord>& records(int w) const { return workers_[std::size_t(w)].records; }
  bool measures_actions() const noexcept { return measure_; }

 private:
  struct Worker {
    std::vector<ActionRecord> records;
    std::vector<std::pair<int, int>> marks;  // backend clock marks of each record (device timelines)
    double action_start = 0;
    int action_mark = 0;
    std::unique_ptr<PairedTurns> turns;  // made at the first overlapped pair that takes turns
  };

  static std::vector<int> local_indices(const Workers& contexts) {
    std::vector<int> local;
    contexts.for_each([&](int w, auto&) { local.push_back(w); });
    return local;
  }
  static std::vector<bool> local_workers(const Workers& contexts, int count) {
    std::vector<bool> local(std::size_t(count), false);
    contexts.for_each([&](int w, auto&) { local[std::size_t(w)] = true; });
    return local;
  }

  double now() const { return std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count(); }

  template <class Backend, class Execute, class Abort>
  void walk(Backend& be, const schedule::Plan& plan, int w, Execute& execute, Abort& abort) {
    using caps = backend::capabilities<Backend>;
    Worker& worker = workers_[std::size_t(w)];
    const auto& actions = plan.actions[std::size_t(w)];
    if (measure_) {
      worker.records.reserve(actions.size());
      worker.marks.reserve(actions.size());
    }
    struct CloseOverlap {  // an action that fails inside an overlapped pair leaves no overlap open
      Backend& be;
      ~CloseOverlap() {
        try {
          caps::overlap_join(be);
        } catch (...) {
        }
      }
    } close_overlap{be};
    for (std::size_t i = 0; i < actions.size(); ++i) {
      const schedule::Action& a = actions[i];
      if (failed_.load(std::memory_order_acquire)) return;
      if constexpr (can_take_turns<Backend>) {
        if (a.overlap && i + 1 < actions.size() && actions[i + 1].kind == schedule::ActionKind::B &&
            takes_turns(be)) {  // see paired_turns.hpp
          if (!run_pair(be, plan, w, a, actions[++i], execute, abort)) return;
          continue;
        }
      }
      input_arrived(w);  // moved on by a receive, once the input is there
      flight_.begin(w, a, worker.action_start);
      try {
        // Named like the trace's labels ("F3", "B3a"), so a profiler shows the schedule. A label fits
        // in the string's own storage: no heap allocation.
        [[maybe_unused]] const auto range = caps::annotate(be, label(a, plan.config.chunks > 1).c_str());
        execute(w, a);
        if (measure_) worker.marks.emplace_back(worker.action_mark, caps::timeline_mark(be));
        // An overlapped F's mark is on the second stream (its own work); its partner B runs on the
        // main stream beside it, and the stream joins after the B (see StageExecutor).
        if (a.overlap) caps::overlap_end(be);
        else caps::overlap_join(be);
      } catch (const std::exception&) {
        failed_with(plan, w, a, std::current_exception(), abort);
        return;
      }
      const double end = now();
      if (measure_) worker.records.push_back({w, a.kind, a.microbatch, a.chunk, worker.action_start, end, a.overlap});
      flight_.end(w, end);
    }
  }

  /// An overlapped F (`f`) and the B after it (`b`) on a context that takes turns (paired_turns.hpp):
  /// the F on a second thread, the two handing the turn over at each all-to-all (on a device, each on
  /// its own stream, joined after the pair). Each is measured from the pair's start (once the F's
  /// input is in) to its own end (on a device timeline, its stream's); the flight recorder holds the
  /// pair as its F. False where one failed (the first to fail, F before B, is the step's failure).
  template <class Backend, class Execute, class Abort>
  bool run_pair(Backend& be, const schedule::Plan& plan, int w, const schedule::Action& f, const schedule::Action& b,
                Execute& execute, Abort& abort) {
    using caps = backend::capabilities<Backend>;
    Worker& worker = workers_[std::size_t(w)];
    input_arrived(w);
    flight_.begin(w, f, worker.action_start);
    double f_end = 0;
    int f_mark = worker.action_mark, b_mark = worker.action_mark;
    if (!worker.turns) worker.turns = std::make_unique<PairedTurns>();
    const bool chunks = plan.config.chunks > 1;
    const std::array<std::exception_ptr, 2> errors = take_turns(
        be, *worker.turns,
        [&] {
          [[maybe_unused]] const auto range = caps::annotate(be, label(f, chunks).c_str());
          execute(w, f);
          if (measure_) f_mark = caps::timeline_mark(be);  // on the F's stream: its turn is still on
          f_end = now();
        },
        [&] {
          [[maybe_unused]] const auto range = caps::annotate(be, label(b, chunks).c_str());
          execute(w, b);
          if (measure_) b_mark = caps::timeline_mark(be);
        });
    for (int i = 0; i < 2; ++i)
      if (errors[std::size_t(i)]) {  // walk's CloseOverlap joins the streams
        failed_with(plan, w, i == 0 ? f : b, errors[std::size_t(i)], abort);
        return false;
      }
    try {
      caps::overlap_join(be);  // a device's main stream waits for the F's (no overlap on the host)
    } catch (const std::exception&) {
      failed_with(plan, w, b, std::current_exception(), abort);
      return false;
    }
    const double end = now();
    if (measure_) {
      worker.marks.emplace_back(worker.action_mark, f_mark);
      worker.marks.emplace_back(worker.action_mark, b_mark);
      worker.records.push_back({w, f.kind, f.microbatch, f.chunk, worker.action_start, f_end, true});
      worker.records.push_back({w, b.kind, b.microbatch, b.chunk, worker.action_start, end, false});
    }
    flight_.end(w, end);
    return true;
  }

  static std::string label(const schedule::Action& a, bool with_chunk) {
    return schedule::detail::event_label({0, a.kind, a.microbatch, a.chunk, 0, 0}, with_chunk);
  }

  /// Action `a` of worker w threw `thrown`: the step's failure, named by the action (one that was
  /// Aborted, woken by another's failure, adds nothing).
  template <class Abort>
  void failed_with(const schedule::Plan& plan, int w, const schedule::Action& a, std::exception_ptr thrown, Abort& abort) {
    try {
      std::rethrow_exception(thrown);
    } catch (const Aborted&) {
    } catch (const error& e) {
      fail(plan, w, a, e.message(), e.call(), e.file(), e.line(), abort);
    } catch (const std::exception& e) {
      fail(plan, w, a, e.what(), "", __FILE__, __LINE__, abort);
    }
  }

  template <class Abort>
  void fail(const schedule::Plan& plan, int w, const schedule::Action& a, const std::string& message,
            const std::string& call, const std::string& file, int line, Abort& abort) {
    const std::string where = action_where(plan, w, a, first_step_);
    flight_.failed(w, where + ": " + message);  // before the abort: the other workers as they were
    {
      std::lock_guard lock(failure_mutex_);
      if (!failure_) failure_ = std::make_exception_ptr(error(where + ": " + message, call, file, line));
    }
    failed_.store(true, std::memory_order_release);
    abort();
  }

  /// Device timelines: from each worker's origin event (all recorded together just before the
  /// workers started) to its action marks, so the records show kernels, not enqueueing.
  void device_times() {
    contexts_.for_each([&](int w, auto& be) {
      using caps = caps_of<decltype(be)>;
      if constexpr (caps::device_timeline) {
        Worker& worker = workers_[std::size_t(w)];
        for (std::size_t i = 0; i < worker.records.size(); ++i) {
          worker.records[i].start = caps::timeline_seconds(be, worker.marks[i].first);
          worker.records[i].end = caps::timeline_seconds(be, worker.marks[i].second);
        }
      }
    });
  }

  const Workers& contexts_;
  std::vector<Worker> workers_;
  std::chrono::steady_clock::time_point start_;
  std::mutex failure_mutex_;
  std::exception_ptr failure_;
  std::atomic<bool> failed_{false};
  int first_step_ = 0;
  bool measure_ = true;
  FlightRecorder flight_;
  WorkerThreads threads_;  // last: its threads are joined before the members they use go
};

}  // namespace cupipe::pipeline
