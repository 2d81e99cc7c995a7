// SPDX-License-Identifier: Apache-2.0
// Move-only owners of a CUDA stream and a CUDA event. DeviceGuard comes with them, since every user
// of a stream also needs its device current.
#pragma once

#include <cuda_runtime_api.h>

#include <utility>

#include "cupipe/backend/cuda/check.cuh"
#include "cupipe/backend/cuda/device_guard.cuh"

namespace cupipe::backend::cuda {

/// A non-blocking stream (it does not synchronise with the legacy default stream).
class Stream {
 public:
  Stream() { CUPIPE_CHECK_CUDA(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking)); }
  Stream(Stream&& other) noexcept : stream_(std::exchange(other.stream_, nullptr)) {}
  Stream& operator=(Stream&& other) noexcept {
    if (this != &other) {
      reset();
      stream_ = std::exchange(other.stream_, nullptr);
    }
    return *this;
  }
  Stream(const Stream&) = delete;
  Stream& operator=(const Stream&) = delete;
  ~Stream() { reset(); }

  cudaStream_t get() const noexcept { return stream_; }
  operator cudaStream_t() const noexcept { return stream_; }
  void synchronize() const { CUPIPE_CHECK_CUDA(cudaStreamSynchronize(stream_)); }
  /// Later work on this stream waits for `event` (recorded on any stream, any device).
  void wait(cudaEvent_t event) const { CUPIPE_CHECK_CUDA(cudaStreamWaitEvent(stream_, event, 0)); }

 private:
  void reset() noexcept {
    if (stream_) (void)cudaStreamDestroy(stream_);
    stream_ = nullptr;
  }
  cudaStream_t stream_ = nullptr;
};

/// An event; timing is off by default because it makes record and wait cheaper.
class Event {
 public:
  explicit Event(bool timing = false) {
    CUPIPE_CHECK_CUDA(cudaEventCreateWithFlags(&event_, timing ? cudaEventDefault : cudaEventDisableTiming));
  }
  Event(Event&& other) noexcept : event_(std::exchange(other.event_, nullptr)) {}
  Event& operator=(Event&& other) noexcept {
    if (this != &other) {
      reset();
      event_ = std::exchange(other.event_, nullptr);
    }
    return *this;
  }
  Event(const Event&) = delete;
  Event& operator=(const Event&) = delete;
  ~Event() { reset(); }

  cudaEvent_t get() const noexcept { return event_; }
  operator cudaEvent_t() const noexcept { return event_; }
  void record(cudaStream_t stream) const { CUPIPE_CHECK_CUDA(cudaEventRecord(event_, stream)); }
  void synchronize() const { CUPIPE_CHECK_CUDA(cudaEventSynchronize(event_)); }
  /// True when the work recorded before it has finished.
  bool ready() const {
    const cudaError_t status = cudaEventQuery(event_);
    if (status == cudaErrorNotReady) {
      (void)cudaGetLastError();
      return false;
    }
    CUPIPE_CHECK_CUDA(status);
    return true;
  }
  /// Milliseconds from `start` to this event; both must have been created with timing on.
  float elapsed_ms_since(const Event& start) const {
    float ms = 0;
    CUPIPE_CHECK_CUDA(cudaEventElapsedTime(&ms, start.event_, event_));
    return ms;
  }

 private:
  void reset() noexcept {
    if (event_) (void)cudaEventDestroy(event_);
    event_ = nullptr;
  }
  cudaEvent_t event_ = nullptr;
};

}  // namespace cupipe::backend::cuda
