// SPDX-License-Identifier: Apache-2.0
// backend::Host<T>: the CPU backend. It is the reference every other backend is checked against, and
// the training path for CI and GPU-less users. One context per pipeline stage (per worker thread).
#pragma once

#include <cblas.h>

#include <algorithm>
#include <cstring>
#include <span>
#include <string_view>

#include "cupipe/backend/op_checks.hpp"
#include "cupipe/backend/op_types.hpp"
#include "cupipe/core/memory.hpp"
#include "cupipe/core/tensor.hpp"
#include "cupipe/core/tensor_group.hpp"

namespace cupipe::backend {

template <class T>
struct Host : ops::Dispatch {
  using value_type = T;
  using space = HostSpace;
  static constexpr std::string_view name = "host";

  template <class U>
  using buffer = HostBuffer<U>;

  Host() = default;
  // Buffers point at `memory`, so a context stays where it was made.
  Host(const Host&) = delete;
  Host& operator=(const Host&) = delete;

  /// Bytes this context allocated, by purpose; peaks are measured here.
  MemoryTracker memory;

  /// The tensor-parallel group the layers of layers/tensor_parallel.hpp sum over (null: none; such a
  /// layer then refuses to run). Not owned.
  TensorGroup* tensor_group = nullptr;

  /// Sets how many threads the host BLAS uses per call (OpenBLAS; other BLAS libraries keep theirs).
  /// Process-wide: OpenBLAS has one setting for every context.
  static void set_blas_threads(int threads) {
#ifdef OPENBLAS_VERSION
    openblas_set_num_threads(threads);
#else
    (void)threads;
#endif
  }

  template <class U = T>
  buffer<U> allocate(index_t count, MemoryTag tag) {
    return buffer<U>(count, &memory, tag);
  }

  /// Copies host memory into this backend's memory (here: a plain copy).
  template <class U>
  void upload(std::span<const U> from, U* to) {
    if (!from.empty()) std::memcpy(to, from.data(), from.size_bytes());
  }
  /// Copies this backend's memory into host memory.
  template <class U>
  void download(const U* from, std::span<U> to) {
    if (!to.empty()) std::memcpy(to.data(), from, to.size_bytes());
  }
  /// Waits for all work issued on this context (host work is synchronous).
  void synchronize() {}
};

}  // namespace cupipe::backend

namespace cupipe::ops {

/// The pipeline's stage-to-stage hand-over: copies `src` (in `from`'s memory) into `dst` (in
/// `to`'s). Host memory is shared, so a plain copy; device backends overload it to copy without
/// waiting on the host (backend/cuda/transfer.cuh).
template <class T>
void transfer(backend::Host<T>&, backend::Host<T>&, ConstView<T> src, TensorView<T> dst) {
  checks::transfer(src, dst);
  std::copy_n(src.data(), src.numel(), dst.data());
}

}  // namespace cupipe::ops
