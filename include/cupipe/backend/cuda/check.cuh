// SPDX-License-Identifier: Apache-2.0
// Checked calls into CUDA and its libraries. Each macro throws cupipe::error carrying the call's text,
// the file:line of the call and the library's own error string, so a failure names what failed.
#pragma once

#include <cublasLt.h>
#include <cuda_runtime_api.h>

#include <string>

#include "cupipe/core/error.hpp"

#if defined(CUPIPE_HAS_CUDNN)
#include <cudnn.h>
#endif
#if defined(CUPIPE_HAS_NCCL)
#include <nccl.h>
#endif

namespace cupipe::gpu::detail {

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

#if defined(CUPIPE_HAS_CUDNN)
[[noreturn]] inline void throw_cudnn(cudnnStatus_t status, const char* call, const char* file, int line) {
  ::cupipe::detail::throw_error(std::string("cuDNN: ") + cudnnGetErrorString(status), call, file, line);
}
#endif

#if defined(CUPIPE_HAS_NCCL)
[[noreturn]] inline void throw_nccl(ncclResult_t status, const char* call, const char* file, int line) {
  ::cupipe::detail::throw_error(std::string("NCCL: ") + ncclGetErrorString(status), call, file, line);
}
#endif

}  // namespace cupipe::gpu::detail

/// Throws cupipe::error when a CUDA runtime call does not return cudaSuccess.
#define CUPIPE_CHECK_CUDA(call)                                                                           \
  do {                                                                                                    \
    const cudaError_t cupipe_status_ = (call);                                                            \
    if (cupipe_status_ != cudaSuccess) [[unlikely]]                                                       \
      ::cupipe::gpu::detail::throw_cuda(cupipe_status_, #call, __FILE__, __LINE__);                      \
  } while (0)

/// Checks the launch just made (bad configuration, missing kernel image) through cudaGetLastError.
#define CUPIPE_CHECK_LAUNCH()                                                                             \
  do {                                                                                                    \
    const cudaError_t cupipe_status_ = cudaGetLastError();                                                \
    if (cupipe_status_ != cudaSuccess) [[unlikely]]                                                       \
      ::cupipe::gpu::detail::throw_cuda(cupipe_status_, "kernel launch", __FILE__, __LINE__);            \
  } while (0)

/// Throws cupipe::error when a cuBLAS / cuBLASLt call does not return CUBLAS_STATUS_SUCCESS.
#define CUPIPE_CHECK_CUBLAS(call)                                                                         \
  do {                                                                                                    \
    const cublasStatus_t cupipe_status_ = (call);                                                         \
    if (cupipe_status_ != CUBLAS_STATUS_SUCCESS) [[unlikely]]                                             \
      ::cupipe::gpu::detail::throw_cublas(cupipe_status_, #call, __FILE__, __LINE__);                    \
  } while (0)

#if defined(CUPIPE_HAS_CUDNN)
/// Throws cupipe::error when a cuDNN call does not return CUDNN_STATUS_SUCCESS.
#define CUPIPE_CHECK_CUDNN(call)                                                                          \
  do {                                                                                                    \
    const cudnnStatus_t cupipe_status_ = (call);                                                          \
    if (cupipe_status_ != CUDNN_STATUS_SUCCESS) [[unlikely]]                                              \
      ::cupipe::gpu::detail::throw_cudnn(cupipe_status_, #call, __FILE__, __LINE__);                     \
  } while (0)
#endif

#if defined(CUPIPE_HAS_NCCL)
/// Throws cupipe::error when an NCCL call does not return ncclSuccess.
#define CUPIPE_CHECK_NCCL(call)                                                                           \
  do {                                                                                                    \
    const ncclResult_t cupipe_status_ = (call);                                                           \
    if (cupipe_status_ != ncclSuccess) [[unlikely]]                                                       \
      ::cupipe::gpu::detail::throw_nccl(cupipe_status_, #call, __FILE__, __LINE__);                      \
  } while (0)
#endif
