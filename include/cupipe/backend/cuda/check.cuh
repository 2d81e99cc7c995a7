// SPDX-License-Identifier: Apache-2.0
// Checked calls into CUDA and its libraries. Each macro throws cupipe::error carrying the call's text,
// the file:line of the call and the library's own error string, so a failure names what failed.
#pragma once

#include <cublasLt.h>
#include <cuda_runtime_api.h>

#include <string>

#include "cupipe/core/error.hpp"

namespace cupipe::backend::cuda::detail {

[[noreturn]] inline void throw_cuda(cudaError_t status, const char* call, const char* file, int line) {
  // A failed runtime call also sets the thread's last error; clear it so that the next launch check
  // does not report this failure a second time.
  (void)cudaGetLastError();
  ::cupipe::detail::throw_error(std::string(cudaGetErrorName(status)) + ": " + cudaGetErrorString(status), call,
                                file, line);
}

[[noreturn]] inline void throw_cublas(cublasStatus_t status, const char* call, const char* file, int line) {
  ::cupipe::detail::throw_error(std::string("cuBLAS status ") + std::to_string(int(status)) + ": " +
                                    cublasLtGetStatusString(status),
                                call, file, line);
}

}  // namespace cupipe::backend::cuda::detail

/// Throws cupipe::error when a CUDA runtime call does not return cudaSuccess.
#define CUPIPE_CHECK_CUDA(call)                                                                           \
  do {                                                                                                    \
    const cudaError_t cupipe_status_ = (call);                                                            \
    if (cupipe_status_ != cudaSuccess) [[unlikely]]                                                       \
      ::cupipe::backend::cuda::detail::throw_cuda(cupipe_status_, #call, __FILE__, __LINE__);                      \
  } while (0)

/// Checks the launch just made (bad configuration, missing kernel image) through cudaGetLastError.
#define CUPIPE_CHECK_LAUNCH()                                                                             \
  do {                                                                                                    \
    const cudaError_t cupipe_status_ = cudaGetLastError();                                                \
    if (cupipe_status_ != cudaSuccess) [[unlikely]]                                                       \
      ::cupipe::backend::cuda::detail::throw_cuda(cupipe_status_, "kernel launch", __FILE__, __LINE__);            \
  } while (0)

/// Throws cupipe::error when a cuBLAS / cuBLASLt call does not return CUBLAS_STATUS_SUCCESS.
#define CUPIPE_CHECK_CUBLAS(call)                                                                         \
  do {                                                                                                    \
    const cublasStatus_t cupipe_status_ = (call);                                                         \
    if (cupipe_status_ != CUBLAS_STATUS_SUCCESS) [[unlikely]]                                             \
      ::cupipe::backend::cuda::detail::throw_cublas(cupipe_status_, #call, __FILE__, __LINE__);                    \
  } while (0)
