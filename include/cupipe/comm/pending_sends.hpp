// SPDX-License-Identifier: Apache-2.0
// PendingSends<Send>: the sends a communicator has started and not yet seen complete. Each Send holds
// the copy of the data it transmits (so the caller may reuse its buffer as soon as send() returns) and
// whatever tells whether it has completed; MpiCommunicator and NcclCommunicator keep their sends here
// and differ only in how they test and wait for one.
#pragma once

#include <list>
#include <utility>

namespace cupipe::comm {

template <class Send>
class PendingSends {
 public:
  void add(Send send) { sends_.push_back(std::move(send)); }

  /// Frees every send for which `completed(send)` is true. Communicators call it before each new
  /// send, so the copies of received messages do not pile up.
  template <class Completed>
  void reap(Completed completed) {
    for (auto it = sends_.begin(); it != sends_.end();) it = completed(*it) ? sends_.erase(it) : std::next(it);
  }

  /// Waits for every send in the order they were started, freeing each once `wait(send)` returns;
  /// `wait` throws (naming the send) when its deadline passes, and the sends not yet waited for stay.
  template <class Wait>
  void complete(Wait wait) {
    while (!sends_.empty()) {
      wait(sends_.front());
      sends_.pop_front();
    }
  }

  bool empty() const noexcept { return sends_.empty(); }
  void clear() noexcept { sends_.clear(); }
  /// The sends still in flight (a communicator cancels them when it is destroyed after a failure).
  auto begin() noexcept { return sends_.begin(); }
  auto end() noexcept { return sends_.end(); }

 private:
  std::list<Send> sends_;
};

}  // namespace cupipe::comm
