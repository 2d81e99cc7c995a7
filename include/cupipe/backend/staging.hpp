// SPDX-License-Identifier: Apache-2.0
// Staging<Backend, U>: hands an array in host memory to a backend as a view of its own memory space.
// HostMirror<Backend, U>: the other way, a backend's memory as host memory, for work the host does on
// a device's tensors (the mixture of experts' routing, layers/moe.hpp).
// Where the host can read the backend's memory (backend::Host) the view is the host array itself, with
// no copy; otherwise (backend::Cuda) the array is uploaded into a buffer the Staging keeps and reuses,
// growing it when a larger array comes. The pipeline stages a batch's inputs to the worker that runs
// the first stage and its labels to the one that runs the last, so trainers pass host arrays on any
// backend.
#pragma once

#include <cstddef>
#include <span>
#include <vector>

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

/// `count` values of a backend's memory at `data`, as host memory. Where the host can read the
/// backend's memory it is that memory, with no copy; otherwise a host copy, downloaded from the
/// device when made with `read` (after the work enqueued before it) and written back by put().
template <class Backend, class U>
class HostMirror {
 public:
  HostMirror(Backend& be, U* data, index_t count, bool read) : be_(&be), device_(data), count_(count) {
    if constexpr (!host_accessible<typename Backend::space>) {
      copy_.resize(static_cast<std::size_t>(count));
      if (read && count > 0) be.download(data, std::span<U>(copy_));
    }
  }
  U* data() {
    if constexpr (host_accessible<typename Backend::space>) return device_;
    else return copy_.data();
  }
  /// Writes the host copy back into the backend's memory (nothing where the two are one).
  void put() {
    if constexpr (!host_accessible<typename Backend::space>)
      if (count_ > 0) be_->upload(std::span<const U>(copy_), device_);
  }

 private:
  Backend* be_;
  U* device_;
  index_t count_;
  std::vector<U> copy_;
};

}  // namespace cupipe::backend
