// SPDX-License-Identifier: Apache-2.0
// DeviceGuard: the one way cupipe changes the calling thread's current device. It restores the
// previous device when it goes, so a library call never leaves the caller on another GPU.
#pragma once

#include <cuda_runtime_api.h>

#include <new>

#include "cupipe/backend/cuda/check.cuh"

namespace cupipe::backend::cuda {

/// Makes `device` current for this thread while it lives, and restores the previous one after.
class DeviceGuard {
 public:
  /// Throws when the device cannot be made current.
  explicit DeviceGuard(int device) {
    CUPIPE_CHECK_CUDA(cudaGetDevice(&previous_));
    if (previous_ != device) {
      CUPIPE_CHECK_CUDA(cudaSetDevice(device));
      changed_ = true;
    }
    current_ = true;
  }
  /// For noexcept paths (destructors, releases): tries, clears the error it met, and reports
  /// through is_current() whether `device` is current.
  DeviceGuard(int device, std::nothrow_t) noexcept {
    if (cudaGetDevice(&previous_) != cudaSuccess) {
      (void)cudaGetLastError();
      return;
    }
    if (previous_ != device) {
      if (cudaSetDevice(device) != cudaSuccess) {
        (void)cudaGetLastError();
        return;
      }
      changed_ = true;
    }
    current_ = true;
  }
  ~DeviceGuard() {
    if (changed_) (void)cudaSetDevice(previous_);
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

  bool is_current() const noexcept { return current_; }

 private:
  int previous_ = 0;
  bool changed_ = false;
  bool current_ = false;
};

}  // namespace cupipe::backend::cuda
