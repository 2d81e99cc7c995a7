// SPDX-License-Identifier: Apache-2.0
// What a sub-group of comm::MpiCommunicator (a context-parallel ring, comm/mpi_ring.hpp; an
// expert-parallel group, comm/mpi_experts.hpp) shares with the communicator that made it, and the
// wait both do on their own requests: tested under the communicator's mutex until they complete or
// the collective timeout passes, sleeping between polls (comm/wait.hpp); past the timeout the
// communicator is marked broken and the error names what did not finish.
#pragma once

#include <mpi.h>

#include <condition_variable>
#include <functional>
#include <mutex>
#include <string>
#include <vector>

#include "cupipe/comm/mpi_check.hpp"
#include "cupipe/comm/wait.hpp"
#include "cupipe/core/error.hpp"

namespace cupipe::comm {

struct MpiGroupOwner {
  std::mutex& mutex;                                ///< held by every MPI call of the process's communicator
  std::vector<MPI_Request*>& progressed;            ///< under mutex: requests the progress thread tests
  std::condition_variable& wake;                    ///< wakes the progress thread
  std::function<double()> timeout;                  ///< the collective timeout (0: none)
  std::function<void()> check_usable;               ///< throws once the communicator is broken
  std::function<void(const std::string&)> expired;  ///< a wait ran out: mark broken, tell the observers

  /// Tests `count` requests until all complete (true) or the collective timeout passes (false),
  /// polling back to back for as long as their `bytes` take (poll_window).
  bool completes(MPI_Request* requests, int count, double bytes = 0) const {
    return wait_until(
        [&] {
          const std::lock_guard lock(mutex);
          int flag = 0;
          for (int i = 0; i < 64 && !flag; ++i) CUPIPE_CHECK_MPI(MPI_Testall(count, requests, &flag, MPI_STATUSES_IGNORE));
          return flag != 0;
        },
        timeout(), poll_window(bytes));
  }
  /// Past the timeout: marks the communicator broken (a collective cannot be cancelled) and throws,
  /// naming `what` and the kind of group (`ring`, `group`) whose rank stalled.
  [[noreturn]] void expire(const std::string& what, const char* kind) const {
    const std::string error = ::cupipe::detail::str(what, " did not finish within ", timeout(),
                                                    " s (collective timeout): a rank of the ", kind, " stalled or died");
    expired(error);
    CUPIPE_THROW(error);
  }
};

}  // namespace cupipe::comm
