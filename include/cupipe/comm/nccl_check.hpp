// SPDX-License-Identifier: Apache-2.0
// CUPIPE_COMM_CHECK_NCCL: every NCCL call of the communicator (comm/nccl.hpp) goes through it, so a
// failed call becomes a cupipe::error naming the call, its file and line, and NCCL's description of
// the error. detail::nccl_grouped: a group of point-to-point calls, ended even when one fails. Built
// only with CUPIPE_HAS_NCCL.
#pragma once

#include <nccl.h>

#include <string>

#include "cupipe/core/error.hpp"

namespace cupipe::comm {

namespace detail {
[[noreturn]] inline void throw_nccl(ncclResult_t status, const char* call, const char* file, int line) {
  ::cupipe::detail::throw_error(std::string("NCCL: ") + ncclGetErrorString(status), call, file, line);
}
}  // namespace detail

}  // namespace cupipe::comm

/// Throws cupipe::error naming the NCCL call and NCCL's description of the error.
#define CUPIPE_COMM_CHECK_NCCL(call)                                                              \
  do {                                                                                            \
    const ncclResult_t cupipe_nccl_rc_ = (call);                                                  \
    if (cupipe_nccl_rc_ != ncclSuccess) [[unlikely]]                                              \
      ::cupipe::comm::detail::throw_nccl(cupipe_nccl_rc_, #call, __FILE__, __LINE__);             \
  } while (0)

namespace cupipe::comm::detail {

/// `calls` (NCCL point-to-point calls) between ncclGroupStart and ncclGroupEnd; the group is ended
/// even when a call fails, so that it does not swallow this thread's later NCCL calls.
template <class Calls>
void nccl_grouped(Calls&& calls) {
  CUPIPE_COMM_CHECK_NCCL(ncclGroupStart());
  try {
    calls();
  } catch (...) {
    (void)ncclGroupEnd();
    throw;
  }
  CUPIPE_COMM_CHECK_NCCL(ncclGroupEnd());
}

}  // namespace cupipe::comm::detail
