// SPDX-License-Identifier: Apache-2.0
// The device timer of the benchmark harness (harness.hpp): CUDA events around work enqueued on one
// stream, with L2 evicted before every timed run so each run starts from device memory.
#pragma once

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstddef>
#include <string>

#include "cupipe/backend/cuda/check.cuh"
#include "cupipe/backend/cuda/stream.cuh"

namespace cupipe::bench {

class CudaTimer {
 public:
  CudaTimer(cudaStream_t stream, std::size_t l2_bytes)
      : stream_(stream), flush_bytes_(std::max<std::size_t>(2 * l2_bytes, std::size_t(64) << 20)), start_(true), stop_(true) {
    CUPIPE_CHECK_CUDA(cudaMalloc(&flush_, flush_bytes_));
  }
  CudaTimer(const CudaTimer&) = delete;
  CudaTimer& operator=(const CudaTimer&) = delete;
  ~CudaTimer() { (void)cudaFree(flush_); }

  std::string description() const {
    return "cudaEventElapsedTime, L2 flushed by a " + std::to_string(flush_bytes_ >> 20) + " MiB memset before each run";
  }

  /// Evicts L2 by writing a buffer twice its size.
  void flush_l2() { CUPIPE_CHECK_CUDA(cudaMemsetAsync(flush_, ++flush_value_ & 0xff, flush_bytes_, stream_)); }

  /// `work` enqueues on the timer's stream; both calls return when it has finished.
  template <class F>
  void untimed(F&& work) {
    work();
    CUPIPE_CHECK_CUDA(cudaStreamSynchronize(stream_));
  }
  template <class F>
  double seconds(F&& work) {
    flush_l2();
    start_.record(stream_);
    work();
    stop_.record(stream_);
    stop_.synchronize();
    return stop_.elapsed_ms_since(start_) * 1e-3;
  }

 private:
  cudaStream_t stream_;
  std::size_t flush_bytes_;
  backend::cuda::Event start_, stop_;
  void* flush_ = nullptr;
  int flush_value_ = 0;
};

}  // namespace cupipe::bench
