// SPDX-License-Identifier: Apache-2.0
// Staging<Backend, U>: hands an array in host memory to a backend as a view of its own memory space.
// Where the host can read the backend's memory (backend::Host) the view is the host array itself, with
// no copy; otherwise (backend::Cuda) the array is uploaded into a buffer the Staging keeps and reuses,
// growing it when a larger array comes. The pipeline stages a batch's inputs to the worker that runs
// the first stage and its labels to the one that runs the last, so trainers pass host arrays on any
// backend.
#pragma once

#include <cstddef>
#include <span>

#include "cupipe/core/error.hpp"
#include "cupipe/core/memory.hpp"
#include "cupipe/core/tensor.hpp"

namespace cupipe::backend {

template <class Backend, class U>
class Staging {
 public:
  /// `host` (already checked by the caller) as a view in `be`'s memory, valid until the next call.
  ConstViewOn<Backend, U> operator()(Backend& be, ConstView<U> host) {
    if constexpr (host_accessible<typename Backend::space>) {
      return {host.data(), host.shape()};
    } else {
      const index_t n = host.numel();
      if (n == 0) return {nullptr, host.shape()};
      CUPIPE_REQUIRE(host.data() != nullptr, "staging: a host array of shape ", host.shape(), " is a null pointer");
      if (buffer_.size() < n) {
        buffer_ = {};  // free the old buffer before allocating a larger one
        buffer_ = be.template allocate<U>(n, MemoryTag::workspace);
      }
      be.upload(std::span<const U>(host.data(), std::size_t(n)), buffer_.data());
      return {buffer_.data(), host.shape()};
    }
  }

 private:
  typename Backend::template buffer<U> buffer_;
};

}  // namespace cupipe::backend
