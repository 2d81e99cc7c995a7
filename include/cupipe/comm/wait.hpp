// SPDX-License-Identifier: Apache-2.0
// Waiting on another process without spinning: poll a condition with a growing sleep, until it holds
// or a deadline passes. Used by every wait of the communicators (MPI requests, NCCL events, the NCCL
// id file), so a rank waiting for a stalled peer uses next to no CPU while it waits.
#pragma once

#include <algorithm>
#include <chrono>
#include <thread>

namespace cupipe::comm {

/// The sleep between two polls. It starts at 1 us and doubles, capped by how long the wait has
/// lasted: 100 us in the first 10 ms (a message due any moment costs at most that much latency),
/// 1 ms up to a second, then 10 ms (a wait that long is a slow or failed peer: about 100 polls a
/// second, well under 1% of a core).
class Backoff {
 public:
  using clock = std::chrono::steady_clock;

  Backoff() : start_(clock::now()) {}

  /// Seconds since the wait began.
  double waited() const { return std::chrono::duration<double>(clock::now() - start_).count(); }

  void sleep() {
    const double w = waited();
    const auto cap = w < 0.01 ? std::chrono::microseconds(100)
                   : w < 1.0  ? std::chrono::microseconds(1000)
                              : std::chrono::microseconds(10000);
    next_ = std::min(next_ * 2, cap);
    std::this_thread::sleep_for(next_);
  }

 private:
  clock::time_point start_;
  std::chrono::microseconds next_{1};
};

/// Calls `ready()` until it returns true (then returns true), sleeping between calls with Backoff;
/// returns false once `timeout_seconds` have passed (0 or less: no deadline). `ready` may throw.
template <class Ready>
bool wait_until(Ready&& ready, double timeout_seconds) {
  Backoff backoff;
  for (;;) {
    if (ready()) return true;
    if (timeout_seconds > 0 && backoff.waited() > timeout_seconds) return false;
    backoff.sleep();
  }
}

}  // namespace cupipe::comm
