// SPDX-License-Identifier: Apache-2.0
// StepLoop: the one loop every training step runs through, the flush or asynchronous step
// (Pipeline::train_step, forward_backward: run_step) and the post-validated steps
// (post_validated_run.hpp) alike: reset the step's counters, open the transport for the step's
// messages, run each worker's actions on its thread (WorkerRuntime) with the caller's work per
// action, wait for the step's sends, and turn what was recorded into StepStats. The parts it drives
// are the Pipeline's, lent. Also plans a step's rows over the replicas and makes the transport.
#pragma once

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <memory>
#include <optional>
#include <vector>

#include "cupipe/comm/communicator.hpp"
#include "cupipe/pipeline/comm_transport.hpp"
#include "cupipe/pipeline/deferred_checks.hpp"
#include "cupipe/pipeline/local_transport.hpp"
#include "cupipe/pipeline/options.hpp"
#include "cupipe/pipeline/wire_transport.hpp"
#include "cupipe/pipeline/measure.hpp"
#include "cupipe/pipeline/step_plan.hpp"
#include "cupipe/pipeline/worker_runtime.hpp"

namespace cupipe::pipeline {

/// The transport of a pipeline whose workers are `workers`: with a backend per worker, hand-overs
/// that convert; else through the options' communicator across processes, or in this process,
/// inside a WireTransport where a link of `options.hand_over` packs.
template <class Executor>
std::unique_ptr<typename Executor::TransportType> make_transport(typename Executor::Contexts& workers,
                                                                 const PipelineOptions& options) {
  using Contexts = typename Executor::Contexts;
  const double timeout = options.transfer_timeout_seconds;
  if constexpr (Contexts::mixed) {
    return std::make_unique<typename Executor::TransportType>(workers, timeout);
  } else {
    using Uniform = typename Contexts::Backend;
    std::unique_ptr<Transport<Uniform>> inner;
    if (options.communicator) inner = std::make_unique<CommTransport<Uniform>>(options.communicator, workers.pointers(), timeout);
    else inner = std::make_unique<LocalTransport<Uniform>>(workers.pointers(), timeout);
    if (!WireTransport<Uniform>::needed(options.hand_over)) return inner;
    return std::make_unique<WireTransport<Uniform>>(std::move(inner), workers.pointers(),
                                                    HandOverWires(options.hand_over, Executor::virtual_stages));
  }
}

template <class Executor>
class StepLoop {
 public:
  using Contexts = typename Executor::Contexts;
  using States = typename Executor::States;
  using Step = typename Executor::Step;
  using Transport = typename Executor::TransportType;
  using Records = std::vector<const std::vector<ActionRecord>*>;

  StepLoop(const schedule::Plan& plan, Contexts& workers, States& states, Transport& transport,
           WorkerRuntime<Contexts>& runtime, Executor& executor, comm::Communicator* comm, int local_worker,
           std::size_t channel_capacity)
      : plan_(plan),
        workers_(workers),
        states_(states),
        transport_(transport),
        runtime_(runtime),
        executor_(executor),
        comm_(comm),
        local_worker_(local_worker),
        channel_capacity_(channel_capacity) {}

  int stages() const { return int(plan_.actions.size()); }
  bool local(int w) const noexcept { return local_worker_ < 0 || w == local_worker_; }

  /// Before a step of `microbatches` (in `batches` batches; 0: the done-in-batch flags stay as they
  /// are): memory and weight-version peaks reset, every stage's microbatches not done.
  void reset(int microbatches, int batches) {
    workers_.for_each([](int, auto& be) { be.memory.reset_peaks(); });
    states_.for_each([&](auto, auto& st) {
      st.done.assign(std::size_t(microbatches), 0);
      if (batches > 0) st.done_in_batch.assign(std::size_t(batches), 0);
      st.weights.reset_peak();
    });
  }

  /// Runs `plan`'s actions, act(w, action) on worker w's thread for each, with room for `steps`
  /// steps' messages in flight; then waits for the step's sends, which may fail too. Returns the
  /// first failure (null: none). Times count from `origin`; `first` numbers the steps in messages.
  template <class Act>
  std::exception_ptr run(const schedule::Plan& plan, int steps, Act&& act,
                         std::optional<std::chrono::steady_clock::time_point> origin = std::nullopt, int first = 0) {
    transport_.begin_step(std::size_t(steps) * capacity());
    std::exception_ptr failure = runtime_.run(plan, act, [&] { transport_.abort(); }, origin, first);
    if (failure) return failure;
    try {
      transport_.finish_step();
    } catch (...) {
      failure = std::current_exception();
    }
    return failure;
  }

  /// One flush or asynchronous step (Pipeline::train_step, forward_backward): the plan's actions,
  /// before(w, action) before each and after(w, action) after it, then the losses collected. A failure clears what was in flight,
  /// calls abandon() and is rethrown. A flush step commits nothing before it ends, so the losses stay
  /// where the last stage computed them and the device-side input checks report once, after the
  /// actions (asynchronous schedules update inside the step: they read each loss and check each op's
  /// input at once).
  template <class Before, class After, class Abandon>
  void run_step(Step& step, Before&& before, After&& after, Abandon&& abandon) {
    constexpr bool flush = Executor::update_rule == schedule::UpdateRule::flush;
    constexpr int last = Executor::worker_at(States::size - 1);
    executor_.prepare(step);  // first: an arena block that grows moves no peak
    reset(plan_.config.total_microbatches(), plan_.config.batches);
    DeferredChecks<Contexts, Executor::workers> deferred(workers_, flush);
    if constexpr (flush)
      if (local(last))
        step.loss_slots = workers_.template get<last>()->template allocate<grad_t<typename Executor::LastBackend>>(
            index_t(step.losses.size()), MemoryTag::workspace);
    std::exception_ptr failure = run(plan_, 1, [&](int w, const schedule::Action& a) {
      before(w, a);
      executor_.execute(w, a, step);
      after(w, a);
    });
    if (!failure) {
      try {
        deferred.report();
        if (local(last)) executor_.collect_losses(step, *workers_.template get<last>());
      } catch (...) {
        failure = std::current_exception();
      }
    }
    if (failure) {
      states_.for_each([](auto, auto& st) { st.in_flight.clear(); });
      abandon();
      std::rethrow_exception(failure);
    }
  }

  /// The step plan over this process's n rows (pipeline::make_step_plan); across replicas the
  /// normalizers count every replica's rows, which may differ. `samples` receives their total.
  StepPlan plan_step(const std::vector<int>& version_offsets, index_t n, int base, std::int64_t batches_done,
                     index_t rows_per_sample, index_t& samples) {
    StepPlan plan = make_step_plan(plan_, version_offsets, n, base, batches_done, rows_per_sample);
    samples = n;
    if (comm_ && comm_->topology().replicas > 1) {
      std::vector<double> counts(plan.normalizer.begin(), plan.normalizer.end());
      counts.push_back(double(n));
      comm_->sum_over_replicas(counts.data(), counts.size());
      for (std::size_t j = 0; j < plan.normalizer.size(); ++j) plan.normalizer[j] = index_t(counts[j]);
      samples = index_t(counts.back());
    }
    return plan;
  }

  /// Every local worker's records of the last run (null where another process runs the worker).
  Records records() const {
    Records out;
    for (int w = 0; w < stages(); ++w) out.push_back(local(w) ? &runtime_.records(w) : nullptr);
    return out;
  }
  /// The records of step t of a run of several that started at step `first`: its own actions only,
  /// renumbered to count microbatches from the call's first step. `kept` holds them.
  Records records_of_step(int t, int first, std::vector<std::vector<ActionRecord>>& kept) const {
    const int m = plan_.config.microbatches;
    kept.assign(std::size_t(stages()), {});
    Records out(std::size_t(stages()), nullptr);
    for (int w = 0; w < stages(); ++w) {
      if (!local(w)) continue;
      for (ActionRecord r : runtime_.records(w))
        if (r.microbatch / m == t) {
          r.microbatch += first * m;
          kept[std::size_t(w)].push_back(r);
        }
      out[std::size_t(w)] = &kept[std::size_t(w)];
    }
    return out;
  }

  /// StepStats from the records, the allocators' peaks and the step's losses over `samples` rows
  /// (every replica's). Across processes the loss is summed over the world: only the last stage's
  /// ranks hold losses, and of a tensor-parallel group the first counts.
  StepStats measure(const Step& step, const StepPlan& plan, const Records& records, index_t samples) {
    std::vector<int> peak_versions(std::size_t(stages()), 0);
    states_.for_each([&](auto k, auto& st) {
      int& peak = peak_versions[std::size_t(plan_.placement.worker_of(decltype(k)::value))];
      peak = std::max(peak, st.weights.peak_live());
    });
    std::vector<const MemoryTracker*> memory(std::size_t(stages()), nullptr);
    workers_.for_each([&](int w, auto& be) { memory[std::size_t(w)] = &be.memory; });
    StepStats stats = measure_step(records, memory, peak_versions, runtime_.measures_actions());
    stats.samples = samples;
    stats.sent_bytes.assign(step.sent_bytes.begin(), step.sent_bytes.end());
    for (std::size_t j = 0; j < step.losses.size(); ++j)
      stats.loss += step.losses[j] * double(plan.normalizer[j]) / double(samples);
    if (comm_) stats.loss = comm_->sum_over_world(comm_->topology().tensor_rank() == 0 ? stats.loss : 0.0);
    return stats;
  }

 private:
  /// Messages one step may have in flight on a channel.
  std::size_t capacity() const {
    if (channel_capacity_ > 0) return channel_capacity_;
    return std::size_t(2 * plan_.config.chunks * plan_.config.total_microbatches());
  }

  const schedule::Plan& plan_;
  Contexts& workers_;
  States& states_;
  Transport& transport_;
  WorkerRuntime<Contexts>& runtime_;
  Executor& executor_;
  comm::Communicator* comm_;
  int local_worker_;
  std::size_t channel_capacity_;
};

}  // namespace cupipe::pipeline
