// SPDX-License-Identifier: Apache-2.0
// backend::Host<Storage, Compute>: the CPU backend. It is the reference every other backend is checked
// against, and the training path for CI and GPU-less users. One context per pipeline stage (per
// worker thread).
//
// Storage is the element type of parameters in use, activations and messages; Compute that of
// gradients, master weights, optimizer state and reductions. Host<float> and Host<double> compute in
// their storage type. Host<bfloat16, float> stores bf16 and computes in fp32 the way a GPU does: every
// op reads bf16, computes in float and rounds its result to nearest even on the store
// (backend/host/ops_bf16.hpp): a reference for the device's bf16 path (the statistics layers save,
// LayerNorm's and attention's, are bf16 here: docs/architecture.md, "Precision is a type").
#pragma once

#include <cblas.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <span>
#include <string_view>
#include <type_traits>

#include "cupipe/backend/op_checks.hpp"
#include "cupipe/backend/op_types.hpp"
#include "cupipe/core/dtype.hpp"
#include "cupipe/core/error.hpp"
#include "cupipe/core/memory.hpp"
#include "cupipe/core/tensor.hpp"
#include "cupipe/core/documents.hpp"
#include "cupipe/core/tensor_group.hpp"
#include "cupipe/cp/context_group.hpp"
#include "cupipe/moe/expert_group.hpp"
#include "cupipe/moe/tally.hpp"

namespace cupipe::backend {

namespace detail {
inline std::atomic<int>& host_poison_state() {  // -1: CUPIPE_HOST_POISON not read yet
  static std::atomic<int> state{-1};
  return state;
}
}  // namespace detail

/// Whether backend::Host fills what allocate() returns with 0xFF bytes (see Host::allocate). The
/// first call reads CUPIPE_HOST_POISON (1: yes; 0 or unset: no; anything else throws, every call).
inline bool host_poison() {
  int state = detail::host_poison_state().load(std::memory_order_relaxed);
  if (state < 0) {
    const char* value = std::getenv("CUPIPE_HOST_POISON");
    const std::string_view v = value ? value : "";
    if (v.empty() || v == "0") state = 0;
    else if (v == "1") state = 1;
    else CUPIPE_THROW("CUPIPE_HOST_POISON=", v, ": expected 1 (fill the host backend's new buffers with 0xFF bytes) or 0");
    detail::host_poison_state().store(state, std::memory_order_relaxed);
  }
  return state == 1;
}
/// Turns the poison on or off for the whole process (CUPIPE_HOST_POISON is then not read).
inline void set_host_poison(bool on) noexcept { detail::host_poison_state().store(on ? 1 : 0, std::memory_order_relaxed); }

template <class S, class C = S>
struct Host : ops::Dispatch {
  static_assert((std::is_same_v<S, C> && (std::is_same_v<S, float> || std::is_same_v<S, double>)) ||
                    (std::is_same_v<S, bfloat16> && std::is_same_v<C, float>),
                "backend::Host<Storage, Compute>: the precisions are Host<float>, Host<double> and "
                "Host<bfloat16, float>");
  using value_type = S;    ///< storage: parameters in use, activations, messages
  using compute_type = C;  ///< gradients, master weights, optimizer state, reductions, the loss
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

  /// The document borders of the rows the layers run now (packed sequences, core/documents.hpp;
  /// empty: one document per sequence), in host memory, set by whoever runs them (the pipeline,
  /// per action); the attention and position embedding layers read them. Not owned.
  DocumentStarts documents{};

  /// The context-parallel ring this rank's attention runs round (null: none; the rows are then
  /// whole sequences), cp/context_group.hpp. Not owned.
  cp::ContextGroup* context_group = nullptr;

  /// The loss normalizer of the step whose microbatch the layers run now (the step's tokens, every
  /// microbatch and replica), set by whoever runs them (the pipeline, per action; Network): a layer's
  /// own auxiliary loss (layers/moe.hpp) divides by it, as the cross-entropy does. 0: the rows run now.
  index_t aux_loss_normalizer = 0;

  /// Where the mixture-of-experts layers count what they did (moe/tally.hpp; null: nothing is
  /// counted). Not owned.
  moe::Tally* moe_tally = nullptr;

  /// The expert-parallel group this rank's mixture-of-experts layers send their tokens round (null:
  /// none; each layer holds all its experts), moe/expert_group.hpp. Not owned.
  moe::ExpertGroup* expert_group = nullptr;
  /// A second group of the same ranks, on communicators of its own, for the F of an overlapped pair
  /// (DualPipeV) while it takes turns with its partner B (pipeline/paired_turns.hpp): the two
  /// actions' all-to-alls are then in flight at once, one in each group. Null: such a pair runs its F
  /// and then its B. Not owned.
  moe::ExpertGroup* paired_expert_group = nullptr;

  /// Sets how many threads the host BLAS uses per call (OpenBLAS; other BLAS libraries keep theirs).
  /// Process-wide: OpenBLAS has one setting for every context.
  static void set_blas_threads(int threads) {
#ifdef OPENBLAS_VERSION
    openblas_set_num_threads(threads);
#else
    (void)threads;
#endif
  }

  /// `count` elements whose contents are unspecified, as a device's are: the CUDA backend does not
  /// clear what it allocates, so the layers, the ops and the pipeline write every element before
  /// they read it, and this backend, the CUDA kernels' oracle, holds them to it. Not clearing also
  /// saves a pass over every activation (4.4% of the GPT's step on one core: docs/benchmarks.md). With host_poison()
  /// each buffer starts as 0xFF bytes, a NaN in every float type, so a read of an element nothing
  /// wrote turns into a NaN a test sees; the tests run with it (tests/CMakeLists.txt).
  template <class U = S>
  buffer<U> allocate(index_t count, MemoryTag tag) {
    return buffer<U>(count, &memory, tag, host_poison() ? BlockFill::poison : BlockFill::none);
  }

  /// Makes `count` values at `data`, memory reused without a new allocation (a pipeline stage's
  /// arena), look as allocate() would leave them: 0xFF bytes with host_poison(), else as they are.
  template <class U>
  void mark_unwritten(U* data, index_t count) {
    if (host_poison() && count > 0) std::memset(static_cast<void*>(data), 0xFF, std::size_t(count) * sizeof(U));
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

  /// A compute-precision context beside a reduced-precision one: the bf16 ops widen their inputs
  /// to float and run the float op through it (the float ops do not touch their context).
  Host<C>& widened() noexcept
    requires(!std::is_same_v<S, C>)
  {
    return wide_;
  }

 private:
  struct NoWide {};
  [[no_unique_address]] std::conditional_t<std::is_same_v<S, C>, NoWide, Host<C>> wide_;
};

}  // namespace cupipe::backend

namespace cupipe::ops {

/// The pipeline's stage-to-stage hand-over: copies `src` (in `from`'s memory) into `dst` (in
/// `to`'s). Host memory is shared, so a plain copy; device backends overload it to copy without
/// waiting on the host (backend/cuda/transfer.cuh).
template <class S, class C, class T>
void transfer(backend::Host<S, C>&, backend::Host<S, C>&, ConstView<T> src, TensorView<T> dst) {
  checks::transfer(src, dst);
  std::copy_n(src.data(), src.numel(), dst.data());
}

}  // namespace cupipe::ops
