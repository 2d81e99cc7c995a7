// SPDX-License-Identifier: Apache-2.0
// Waiting on another process without spinning for long: poll a condition, yielding the core between
// polls for the first millisecond, then with a growing sleep, until it holds or a deadline passes.
// Used by every wait of the communicators (MPI requests, NCCL events, the NCCL id file), so a rank
// waiting for a stalled peer uses next to no CPU while it waits.
//
// Why the first millisecond polls: MPI moves a large message in fragments, and only while one of
// the two ranks is inside an MPI call, so a wait that sleeps between single tests caps the bandwidth
// at a few fragments per sleep. Measured on the 2-core VM (OpenMPI 4, shared memory, 2 ranks): a
// 4 MB hand-over at 0.54 GB/s and a 4 KB one in 130 us when every poll sleeps, 6.8 GB/s and 2 us
// with this first millisecond (MPI_Wait, which spins: 8.1 GB/s and 2.6 us); docs/benchmarks.md.
// A collective's wait for more data than a millisecond moves polls for as long as the data take at
// polled_bytes_per_second (poll_window): an 11 MB gradient sum of 2 ranks took 63-90 ms when it
// slept after its first millisecond, against 2.5 ms for a blocking MPI_Allreduce (AMD EPYC VM).
// The window starts with the wait: a peer that arrives later than it meets the sleeping pace again.
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

/// How long a wait polls, yielding between polls, before it starts sleeping.
inline constexpr double poll_seconds = 1e-3;

/// The pace at which back-to-back polls keep a transfer moving, at least: the shared-memory rate
/// of a polled MPI collective is 2-3 GB/s on the 2-core VM (11 MB summed over 2 ranks in 3.8 ms),
/// and about a tenth of that when every poll sleeps 100 us.
inline constexpr double polled_bytes_per_second = 1e9;

/// How long a wait for `bytes` of data polls back to back before it sleeps: poll_seconds, or as long
/// as the data take at polled_bytes_per_second where that is longer, at most a second. Bounded by
/// the data, so a wait for a stalled peer still sleeps soon.
inline double poll_window(double bytes) {
  return std::clamp(bytes / polled_bytes_per_second, poll_seconds, 1.0);
}

/// Calls `ready()` until it returns true (then returns true): back to back for the first `poll_for`
/// seconds (yielding the core between calls; poll_window for a wait that moves data), then sleeping
/// between calls with Backoff; returns false once `timeout_seconds` have passed (0 or less: no
/// deadline). `ready` may throw.
template <class Ready>
bool wait_until(Ready&& ready, double timeout_seconds, double poll_for = poll_seconds) {
  Backoff backoff;
  for (;;) {
    if (ready()) return true;
    const double waited = backoff.waited();
    if (timeout_seconds > 0 && waited > timeout_seconds) return false;
    if (waited < poll_for) std::this_thread::yield();
    else backoff.sleep();
  }
}

}  // namespace cupipe::comm
