// SPDX-License-Identifier: Apache-2.0
// PostValidatedRun: Pipeline::train_steps with PipelineOptions::post_validation (Qi et al., zero
// bubble, section 4). The steps run back to back as one plan through the StepLoop; each worker, at
// the boundary between its part of step t and of step t+1, checks step t-1's global gradient norm
// (NormLedger, post_validation.hpp), reports its share of step t's, saves its stages and updates them
// as if the norm did not clip. An update that should have clipped, or saw a non-finite gradient,
// stops every worker at its next boundary; it is rolled back and redone as the flush does it
// (GradientSync::flush_update's arithmetic), and the steps after it run again. The results are
// bitwise those of a flush step per batch.
#pragma once

#include <chrono>
#include <cstddef>
#include <exception>
#include <map>
#include <span>
#include <string_view>
#include <utility>
#include <vector>

#include "cupipe/backend/staging.hpp"
#include "cupipe/pipeline/optimizer_step.hpp"
#include "cupipe/pipeline/post_validation.hpp"
#include "cupipe/pipeline/step_loop.hpp"
#include "cupipe/pipeline/step_plan.hpp"
#include "cupipe/schedule/steps.hpp"
#include "cupipe/schedule/verify.hpp"

namespace cupipe::pipeline {

template <class Executor, class Sync>
class PostValidatedRun {
  static constexpr bool tied = Sync::tied.count > 0;
  static constexpr int virtual_stages = Executor::virtual_stages;
  using States = typename Executor::States;
  using Contexts = typename Executor::Contexts;
  using Step = typename Executor::Step;

 public:
  /// `tied_worker`: the worker that holds both tied copies (-1: the model ties none).
  PostValidatedRun(const schedule::Plan& plan, std::string_view schedule, Contexts& workers, States& states,
                   Executor& executor, StepLoop<Executor>& loop, Sync& sync, int tied_worker, index_t rows_per_sample)
      : plan_(plan),
        schedule_(schedule),
        workers_(workers),
        states_(states),
        executor_(executor),
        loop_(loop),
        sync_(sync),
        tied_worker_(tied_worker),
        rows_per_sample_(rows_per_sample) {}

  /// One step per batch (x, labels in host memory), step t with optimizers[t]; the slots are
  /// prepared. Returns each step's StepStats.
  template <class Batch, class Optimizer>
  std::vector<StepStats> train(std::span<const Batch> batches, std::span<const Optimizer> optimizers) {
    const std::size_t count = batches.size();
    std::vector<backend::Staging<typename Executor::FirstBackend, typename Executor::input_type>> x_staging(count);
    std::vector<backend::Staging<typename Executor::LastBackend, std::int32_t>> label_staging(count);
    std::vector<StepPlan> plans(count);
    std::vector<Step> steps(count);
    int base = 0;
    states_.for_each([&](auto, auto& st) { base = st.weights.latest(); });
    auto& first = *workers_.template get<Executor::worker_at(0)>();
    auto& last = *workers_.template get<Executor::worker_at(virtual_stages - 1)>();
    for (std::size_t t = 0; t < count; ++t) {
      plans[t] = make_step_plan(plan_, executor_.version_offsets(), batches[t].x.rows(), base, 0, rows_per_sample_);
      steps[t].plan = &plans[t];
      steps[t].x = x_staging[t](first, batches[t].x);
      steps[t].labels = label_staging[t](last, batches[t].labels);
      steps[t].documents = batches[t].documents;  // checked by the Pipeline
      steps[t].losses.assign(std::size_t(plans[t].microbatches()), 0.0);
    }
    std::vector<StepStats> out(count);
    const auto origin = std::chrono::steady_clock::now();
    for (int next = 0; next < int(count);) next = run(steps, next, optimizers, out, origin);
    return out;
  }

 private:
  /// `steps` steps of the plan as one plan, verified once and kept.
  const schedule::Plan& repeated_plan(int steps) {
    if (auto found = repeated_.find(steps); found != repeated_.end()) return found->second;
    schedule::Plan plan = schedule::repeat_steps(plan_, steps);
    if (const auto verdict = schedule::verify(plan); !verdict)
      CUPIPE_THROW("Pipeline: ", steps, " steps of the ", schedule_, " plan back to back failed verification: ",
                   verdict.message());
    return repeated_.emplace(steps, std::move(plan)).first->second;
  }

  /// Runs steps[first..] back to back (see NormLedger). Returns the first step not yet final: the
  /// end, or the step after one whose update was redone (it reruns).
  template <class Optimizer>
  int run(std::vector<Step>& steps, int first, std::span<const Optimizer> optimizers, std::vector<StepStats>& out,
          std::chrono::steady_clock::time_point origin) {
    const int count = int(steps.size()) - first, m = plan_.config.microbatches, stages = loop_.stages();
    // Step t of this run (step first + t of the call) updates with its own optimizer.
    const auto optimizer = [&](int t) -> const Optimizer& { return optimizers[std::size_t(first + t)]; };
    const schedule::Plan& plan = repeated_plan(count);
    NormLedger ledger(count, virtual_stages, stages, tied);
    for (int t = first; t < int(steps.size()); ++t) steps[std::size_t(t)].sent_bytes.fill(0);  // a rerun counts afresh
    loop_.reset(m, 0);
    // The boundary of worker w after step t: check step t-1's norm, report step t's, save, update.
    auto boundary = [&](int w, int t) {
      if (t > 0 && !update_stands(optimizer(t - 1), ledger.norm(t - 1))) {
        ledger.roll_back(t - 1);
        throw Aborted{};  // every worker stops at this boundary; the caller redoes step t-1's update
      }
      double excluded = 0;
      if (tied && w == tied_worker_) excluded = sum_tied_gradients(states_, nullptr, Sync::tied);
      // The worker's sums, read back with one copy per context and reported before anything
      // changes (a failed read leaves the stages as they were); then save and update.
      GradientSquares squares{std::size_t(virtual_stages)};
      states_.for_each([&](auto k, auto& st) {
        if (Executor::worker_at(decltype(k)::value) == w) squares.add(st, std::size_t(decltype(k)::value));
      });
      std::vector<std::pair<int, double>> sums;
      for (const auto& [k, sum] : squares.read()) sums.emplace_back(int(k), sum);
      ledger.report(w, t, sums, excluded);
      states_.for_each([&](auto k, auto& st) {
        if (Executor::worker_at(decltype(k)::value) != w) return;
        save_for_rollback(st);
        update_stage(st, st.weights.latest_data(), optimizer(t), 1.0);
        st.done.assign(std::size_t(m), 0);
      });
    };
    std::vector<int> current(std::size_t(stages), 0);  // each written by its own worker only
    // Two adjacent steps' messages can be in flight.
    std::exception_ptr failure = loop_.run(
        plan, 2,
        [&](int w, const schedule::Action& a) {
          const int t = schedule::step_of(a, m);
          if (t != current[std::size_t(w)]) {
            boundary(w, current[std::size_t(w)]);
            current[std::size_t(w)] = t;
          }
          schedule::Action local = a;
          local.microbatch -= t * m;
          executor_.execute(w, local, steps[std::size_t(first + t)]);
        },
        origin, first);
    if (failure) {
      recover(ledger, optimizers.subspan(std::size_t(first)));
      std::rethrow_exception(failure);
    }
    // A worker checks the step before the one it just finished; the second-to-last step's check is
    // here (every worker reported it), and the last step's update is the flush below.
    int rollback = ledger.rollback();
    if (rollback < 0 && count >= 2 && !update_stands(optimizer(count - 2), ledger.norm(count - 2)))
      rollback = count - 2;
    const int done = rollback >= 0 ? rollback + 1 : count;  // steps of this run whose update is final
    double last_norm = 0;
    if (rollback >= 0) {
      // Every worker stopped after step rollback + 1 (or the run ended there) without updating: undo
      // rollback's update (and drop rollback + 1's gradients), then update as the flush does.
      states_.for_each([](auto, auto& st) { restore(st); });
      last_norm = ledger.norm(rollback);
      sync_.refuse_non_finite(last_norm);
      apply_flush(states_, optimizer(rollback), last_norm);
    } else {
      last_norm = sync_.flush_update(optimizer(count - 1));  // the last step has no boundary after it
    }
    for (int t = 0; t < done; ++t) {
      const Step& step = steps[std::size_t(first + t)];
      std::vector<std::vector<ActionRecord>> kept;
      index_t samples = 0;
      for (index_t rows : step.plan->rows) samples += rows;
      StepStats& stats = out[std::size_t(first + t)];
      stats = loop_.measure(step, *step.plan, loop_.records_of_step(t, first, kept), samples);
      stats.grad_norm = t + 1 == done ? last_norm : ledger.norm(t);
      stats.rolled_back = t == rollback;
    }
    return first + done;
  }

  /// After a failed run: every stage back to the weights after the last step every worker
  /// finished, gradients zeroed. Workers are at most one boundary apart (see NormLedger).
  template <class Optimizer>
  void recover(const NormLedger& ledger, std::span<const Optimizer> optimizers) {
    const int low = ledger.passed_by_all();
    const bool stands = low < 0 || update_stands(optimizers[std::size_t(low)], ledger.norm(low));
    states_.for_each([&](auto k, auto& st) {
      st.in_flight.clear();
      const int passed = ledger.passed(Executor::worker_at(decltype(k)::value));
      if (passed >= 0 && (!stands || passed == low + 1)) restore(st);
    });
    if (!stands) apply_flush(states_, optimizers[std::size_t(low)], ledger.norm(low));
    states_.for_each([](auto, auto& st) { st.zero_grads(); });
  }

  const schedule::Plan& plan_;
  std::string_view schedule_;
  Contexts& workers_;
  States& states_;
  Executor& executor_;
  StepLoop<Executor>& loop_;
  Sync& sync_;
  int tied_worker_;
  index_t rows_per_sample_;
  std::map<int, schedule::Plan> repeated_;  ///< plans of several steps, by step count
};

}  // namespace cupipe::pipeline
