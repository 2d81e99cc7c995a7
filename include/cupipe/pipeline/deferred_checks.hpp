// SPDX-License-Identifier: Apache-2.0
// DeferredChecks: for one flush step, the device-side input checks of every context of this process
// are deferred (see backend::capabilities::defer_input_checks), so that a step's ops do not each wait
// for their verdict; report() restores them after the actions and throws the first that failed,
// naming its stage as the runtime names a failed action's worker.
#pragma once

#include <array>
#include <cstddef>
#include <exception>
#include <string>

#include "cupipe/backend/capabilities.hpp"
#include "cupipe/core/error.hpp"

namespace cupipe::pipeline {

/// The device-side input checks of every context of this process, deferred for one step (see
/// backend::capabilities::defer_input_checks): report() restores them and throws what the step's
/// ops found; leaving without report() (a failed step) only restores them. N: the pipeline's workers.
template <class Contexts, int N>
class DeferredChecks {
 public:
  DeferredChecks(const Contexts& contexts, bool defer) : contexts_(contexts), defer_(defer) {
    if (!defer_) return;
    contexts_.for_each([&](int w, auto& be) {
      previous_[std::size_t(w)] = backend::defer_input_checks(be);
    });
  }
  DeferredChecks(const DeferredChecks&) = delete;
  DeferredChecks& operator=(const DeferredChecks&) = delete;
  ~DeferredChecks() {
    try {
      resume(false);
    } catch (...) {  // restoring a flag does not throw; nothing may leave a destructor
    }
  }
  void report() { resume(true); }

 private:
  void resume(bool report) {
    if (!defer_) return;
    defer_ = false;
    std::exception_ptr first;
    contexts_.for_each([&](int w, auto& be) {
      try {
        backend::resume_input_checks(be, previous_[std::size_t(w)], report);
      } catch (const error& e) {  // named as the runtime names a failed action's worker
        if (!first)
          first = std::make_exception_ptr(
              error("worker " + std::to_string(w) + ", after the step's actions: " + e.message(), e.call(), e.file(), e.line()));
      } catch (...) {
        if (!first) first = std::current_exception();
      }
    });
    if (first) std::rethrow_exception(first);
  }
  const Contexts& contexts_;
  bool defer_;
  std::array<bool, std::size_t(N)> previous_{};  ///< [worker]: whether its checks were deferred before
};

}  // namespace cupipe::pipeline
