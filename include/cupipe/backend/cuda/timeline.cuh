// SPDX-License-Identifier: Apache-2.0
// backend::cuda::ActionTimer: device-side timestamps of a pipeline step on one stream. The pipeline marks each
// action's start and end on the worker's stream; after the step it reads every mark as seconds
// since the step's origin event. Host clocks would time the enqueueing, not the kernels.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <memory>
#include <vector>

#include "cupipe/backend/cuda/check.cuh"
#include "cupipe/backend/cuda/stream.cuh"
#include "cupipe/core/error.hpp"

namespace cupipe::backend::cuda {

class ActionTimer {
 public:
  /// Records the origin on `stream` and forgets earlier marks (their events are reused). Call with
  /// the stream's device current.
  void start(cudaStream_t stream) {
    if (!origin_) origin_ = std::make_unique<Event>(true);
    origin_->record(stream);
    used_ = 0;
  }

  /// Records a timing event on `stream` (after the work enqueued so far) and returns its index.
  int mark(cudaStream_t stream) {
    CUPIPE_REQUIRE(origin_ != nullptr, "ActionTimer: mark() before start()");
    if (used_ == events_.size()) events_.emplace_back(true);
    events_[used_].record(stream);
    return int(used_++);
  }

  /// Seconds from the origin to mark `index`; waits for that mark to be reached.
  double seconds(int index) const {
    CUPIPE_REQUIRE(index >= 0 && std::size_t(index) < used_, "ActionTimer: no mark ", index, " in this step (", used_,
                   " recorded)");
    const Event& event = events_[std::size_t(index)];
    event.synchronize();
    return double(event.elapsed_ms_since(*origin_)) * 1e-3;
  }

 private:
  std::unique_ptr<Event> origin_;
  std::vector<Event> events_;
  std::size_t used_ = 0;
};

}  // namespace cupipe::backend::cuda
