// SPDX-License-Identifier: Apache-2.0
// CUPIPE_CHECK_MPI: every MPI return code becomes a cupipe::error naming the call and MPI's own
// description of the error (the communicators return errors, MPI_ERRORS_RETURN, instead of aborting).
#pragma once

#include <mpi.h>

#include <cstddef>
#include <string>

#include "cupipe/core/error.hpp"

namespace cupipe::comm {

namespace detail {
inline std::string mpi_error_text(int code) {
  char text[MPI_MAX_ERROR_STRING];
  int length = 0;
  if (MPI_Error_string(code, text, &length) != MPI_SUCCESS) return "MPI error " + std::to_string(code);
  return std::string(text, std::size_t(length));
}
/// Bytes of `n` values of `type` (float or double: the communicators' sums; 1 byte otherwise), for
/// a wait's poll_window (comm/wait.hpp).
inline double mpi_bytes(std::size_t n, MPI_Datatype type) {
  return double(n) * double(type == MPI_DOUBLE ? sizeof(double) : type == MPI_FLOAT ? sizeof(float) : 1);
}
}  // namespace detail

}  // namespace cupipe::comm

/// Throws cupipe::error naming the MPI call and MPI's own description of the error.
#define CUPIPE_CHECK_MPI(call)                                                                            \
  do {                                                                                                    \
    const int cupipe_mpi_rc_ = (call);                                                                    \
    if (cupipe_mpi_rc_ != MPI_SUCCESS)                                                                    \
      ::cupipe::detail::throw_error(::cupipe::comm::detail::mpi_error_text(cupipe_mpi_rc_), #call, __FILE__, \
                                    __LINE__);                                                            \
  } while (0)

