// SPDX-License-Identifier: Apache-2.0
// What the MPI checks share: the largest difference relative to the reference's largest value, a
// number printed with all the digits a double comparison needs, the verdict over every rank, and
// the main body that prints it (or aborts the job on an exception).
#pragma once

#include <mpi.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <exception>
#include <string>
#include <vector>

namespace cupipe::testing {

/// max |a - b| / max |b| (max |a - b| when b is all zeros); infinite when the sizes differ.
inline double relative(const std::vector<double>& a, const std::vector<double>& b) {
  if (a.size() != b.size()) return INFINITY;
  double diff = 0, norm = 0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    diff = std::max(diff, std::abs(a[i] - b[i]));
    norm = std::max(norm, std::abs(b[i]));
  }
  return norm > 0 ? diff / norm : diff;
}

/// `v` with 15 significant digits.
inline std::string number(double v) {
  char text[32];
  std::snprintf(text, sizeof text, "%.15g", v);
  return text;
}

/// 0 when no rank counted a failure, else 1 (collective over MPI_COMM_WORLD).
inline int verdict_everywhere(int failures) {
  int total = failures;
  MPI_Allreduce(&failures, &total, 1, MPI_INT, MPI_SUM, MPI_COMM_WORLD);
  return total == 0 ? 0 : 1;
}

/// Runs `check` (0: passed) on this rank; rank 0 prints PASS or FAIL. An exception is printed with
/// the rank and ends the job (MPI_Abort: the other ranks may be waiting in a collective).
template <class Check>
int run_check(Check&& check) {
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  try {
    const int rc = check();
    if (rank == 0) std::printf("%s\n", rc == 0 ? "PASS" : "FAIL");
    return rc;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "rank %d: %s\n", rank, e.what());
    std::fflush(stderr);
    MPI_Abort(MPI_COMM_WORLD, 3);
    return 3;
  }
}

}  // namespace cupipe::testing
