// SPDX-License-Identifier: Apache-2.0
// NormLedger: what the workers of a post-validated run (PipelineOptions::post_validation) tell each
// other at their step boundaries, without waiting for one another.
//
// Optimizer post-validation (Qi et al., "Zero Bubble Pipeline Parallelism", section 4): a flush
// update needs the global gradient norm (for clipping, and to see a non-finite gradient), which is a
// barrier across every stage between two steps. Instead, each worker, when its last action of step t
// is done, reports its stages' sums of squares here, saves what it needs to undo, updates its stages
// as if the norm did not clip (factor 1), and goes straight on to step t + 1. At its next boundary it
// checks step t's norm: by then every worker has reported it, because any backward of step t + 1 on
// this worker needed that microbatch's forward through every virtual stage, and each worker starts
// its step t + 1 forwards only after its step t report. If the update should have clipped, or the
// norm is not finite, every worker reaches the same verdict at the same boundary and stops there; the
// pipeline restores every stage, redoes step t's update exactly as the flush would have, and reruns
// step t + 1. The pipeline itself checks the second-to-last step once the workers have joined, and
// makes the last step's update as the flush does. The results are bitwise those of a flush after
// every step.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <limits>
#include <mutex>
#include <span>
#include <utility>
#include <vector>

#include "cupipe/core/error.hpp"

namespace cupipe::pipeline {

class NormLedger {
 public:
  /// A run of `steps` steps over `virtual_stages` stages on `workers` workers; `tied`: the model's
  /// tied copies are summed (so one worker reports a share to leave out).
  NormLedger(int steps, int virtual_stages, int workers, bool tied)
      : steps_(steps),
        virtual_stages_(virtual_stages),
        workers_(workers),
        tied_(tied),
        sums_(std::size_t(steps) * std::size_t(virtual_stages), std::numeric_limits<double>::quiet_NaN()),
        excluded_(std::size_t(steps), 0.0),
        reported_(std::size_t(steps), 0),
        passed_(std::size_t(workers), -1) {}

  /// Worker w's boundary after step t: the sums of squares of its virtual stages' gradients, as
  /// (virtual stage, sum) pairs, and the tied copy's share to leave out (0 unless it holds both).
  void report(int w, int t, std::span<const std::pair<int, double>> sums, double excluded) {
    std::lock_guard lock(mutex_);
    CUPIPE_REQUIRE(t >= 0 && t < steps_ && w >= 0 && w < workers_ && passed_[std::size_t(w)] == t - 1,
                   "post-validation: worker ", w, " reported step ", t, " out of order (last reported: ",
                   passed_[std::size_t(w)], ")");
    for (const auto& [k, sum] : sums) sums_[std::size_t(t) * std::size_t(virtual_stages_) + std::size_t(k)] = sum;
    excluded_[std::size_t(t)] += excluded;
    ++reported_[std::size_t(t)];
    passed_[std::size_t(w)] = t;
  }

  /// Step t's global gradient norm, summed in the flush update's order (tied share first, then the
  /// stages in order), so it is bitwise the flush's. Every worker must have reported step t; the
  /// boundary argument above says they have, so a missing report is a runtime bug and throws.
  double norm(int t) const {
    std::lock_guard lock(mutex_);
    CUPIPE_REQUIRE(t >= 0 && t < steps_ && reported_[std::size_t(t)] == workers_, "post-validation: step ", t,
                   "'s gradient norm was read before every worker reported it (", t >= 0 && t < steps_ ? reported_[std::size_t(t)] : 0,
                   " of ", workers_, "); the runtime broke its ordering");
    double sum = 0;
    if (tied_) sum -= excluded_[std::size_t(t)];
    for (int k = 0; k < virtual_stages_; ++k) sum += sums_[std::size_t(t) * std::size_t(virtual_stages_) + std::size_t(k)];
    return std::sqrt(sum);
  }

  /// The last step whose boundary worker w passed (reported and updated); -1 for none.
  int passed(int w) const {
    std::lock_guard lock(mutex_);
    return passed_[std::size_t(w)];
  }
  /// The lowest step every worker passed; -1 for none.
  int passed_by_all() const {
    std::lock_guard lock(mutex_);
    return *std::min_element(passed_.begin(), passed_.end());
  }

  /// Step t's update did not stand; every worker says so at its boundary after step t + 1.
  void roll_back(int t) {
    std::lock_guard lock(mutex_);
    rollback_ = t;
  }
  /// The step whose update must be redone, or -1.
  int rollback() const {
    std::lock_guard lock(mutex_);
    return rollback_;
  }

 private:
  mutable std::mutex mutex_;
  int steps_, virtual_stages_, workers_;
  bool tied_;
  std::vector<double> sums_;      ///< [step][virtual stage]
  std::vector<double> excluded_;  ///< [step]
  std::vector<int> reported_;     ///< [step] workers that reported
  std::vector<int> passed_;       ///< [worker]
  int rollback_ = -1;
};

}  // namespace cupipe::pipeline
