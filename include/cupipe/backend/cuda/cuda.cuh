// SPDX-License-Identifier: Apache-2.0
// backend::Cuda<T>: the CUDA backend, the device twin of backend::Host<T>. One context per pipeline
// stage (per worker thread): it owns a stream, and every op on it is enqueued on that stream, in
// order. Its ops (backend/cuda/ops.cuh, gemm.cuh) have the host ops' names and signatures.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <memory>
#include <span>
#include <string_view>
#include <type_traits>

#include "cupipe/backend/capabilities.hpp"
#include "cupipe/backend/cuda/attention_path.cuh"
#include "cupipe/backend/cuda/check.cuh"
#include "cupipe/backend/cuda/context.cuh"
#include "cupipe/backend/cuda/device_guard.cuh"
#include "cupipe/backend/cuda/gemm_plan.cuh"
#include "cupipe/backend/cuda/memory_pool.cuh"
#include "cupipe/backend/cuda/nvtx.cuh"
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

/// Storage T (weights in use, activations, messages) and compute C (gradients, master weights,
/// optimizer state, statistics, the loss): Cuda<float>, Cuda<double>, or Cuda<bfloat16, float>,
/// whose kernels read bf16, compute in fp32 and round each stored value to the nearest bf16 (ties to
/// even), as backend::Host<bfloat16, float> does on the CPU.
template <class T, class C = T>
class Cuda : public ops::Dispatch {
  static_assert((std::is_same_v<T, float> || std::is_same_v<T, double>) ? std::is_same_v<C, T>
                                                                          : std::is_same_v<T, bfloat16> && std::is_same_v<C, float>,
                "backend::Cuda<Storage, Compute>: Cuda<float>, Cuda<double> or Cuda<bfloat16, float>");

 public:
  using value_type = T;
  using compute_type = C;
  using space = DeviceSpace;
  static constexpr std::string_view name = "cuda";

  template <class U>
  using buffer = backend::cuda::DeviceBuffer<U>;

  /// Bytes this context allocated, by purpose; peaks are measured here. Declared before the context,
  /// whose pool accounts into it.
  MemoryTracker memory;

  /// The tensor-parallel group the layers of layers/tensor_parallel.hpp sum over (null: none; such a
  /// layer then refuses to run). A group that takes device memory (NCCL's) sums in place; others
  /// stage through host memory. Not owned.
  TensorGroup* tensor_group = nullptr;

  /// The document borders of the rows the layers run now (packed sequences, core/documents.hpp;
  /// empty: one document per sequence), in host memory, set by whoever runs them (the pipeline,
  /// per action); the attention and position embedding layers read them. Not owned.
  DocumentStarts documents{};

  /// The step's loss normalizer and the mixture-of-experts tally, as on the host backend
  /// (backend/host/host.hpp).
  index_t aux_loss_normalizer = 0;
  moe::Tally* moe_tally = nullptr;

  /// The expert-parallel group this rank's mixture-of-experts layers send their tokens round (null:
  /// none; each layer holds all its experts), moe/expert_group.hpp. A group that takes device memory
  /// (NCCL's) moves the rows where they are; others through host copies (moe/backend_transfer.hpp).
  /// Not owned.
  moe::ExpertGroup* expert_group = nullptr;
  /// A second group of the same ranks (NCCL's: communicators and a stream of their own) for the F
  /// of an overlapped pair (DualPipeV) whose F and B take turns (pipeline/paired_turns.hpp): the F
  /// enqueues on the side stream and the B on the main stream, each handing the turn over while its
  /// all-to-all is in flight, so that the other's kernels are queued beside it. Null: the pair runs
  /// from one thread, the F's host waits (routing, counts, all-to-all) before the B is queued.
  /// The two actions share the context's device-error record: a bad input one meets may be reported
  /// by the other's next check, naming the wrong action.
  moe::ExpertGroup* paired_expert_group = nullptr;

  /// The context-parallel ring this rank's attention passes keys and values round (null: none; the
  /// rows are then whole sequences), cp/context_group.hpp: one of device memory (NCCL's), which
  /// ops::ring_attention_* (backend/cuda/ops_ring.cuh) takes. Not owned.
  cp::ContextGroup* context_group = nullptr;

  /// Float GEMMs on TF32 tensor cores (about 1e-3 relative; 8x the fp32 rate on an H100) or in exact
  /// fp32. From backend::cuda::default_math() when the context is made: TF32 unless the program changed it.
  /// Set MathMode::fp32 here (pipe.backend(k).math) or with backend::cuda::set_default_math for bitwise work.
  backend::cuda::MathMode math = backend::cuda::default_math();

  /// The causal-attention path (backend/cuda/attention_path.cuh): automatic (cuDNN's fused SDPA for
  /// bf16 where it runs, else the simple kernels), cudnn, tiled or simple. From CUPIPE_ATTENTION
  /// when the context is made, automatic when unset.
  backend::cuda::AttentionKernel attention = backend::cuda::default_attention();

  /// When true (the default), ops that can meet bad input on the device (a label or token id out of
  /// range) wait for their kernels and throw at once, naming the row. When false they only record
  /// it, and the next synchronize() throws.
  bool check_inputs = true;

  /// A context on device 0.
  Cuda() : Cuda(0) {}
  explicit Cuda(int device) : context_(device, memory) {}
  // Buffers point at the pool and `memory`, so a context stays where it was made.
  Cuda(const Cuda&) = delete;
  Cuda& operator=(const Cuda&) = delete;
  Cuda(Cuda&&) = delete;
  Cuda& operator=(Cuda&&) = delete;

  /// An uninitialised device array of `count` elements, accounted under `tag`.
  template <class U = T>
  buffer<U> allocate(index_t count, MemoryTag tag) {
    const backend::cuda::DeviceGuard guard(context_.device());
    return buffer<U>(context_.pool(), count, tag);
  }

  /// Copies host memory to the device. Returns when the copy is done, so `from` may be reused at once.
  template <class U>
  void upload(std::span<const U> from, U* to) {
    if (from.empty()) return;
    const backend::cuda::DeviceGuard guard(context_.device());
    CUPIPE_CHECK_CUDA(cudaMemcpyAsync(to, from.data(), from.size_bytes(), cudaMemcpyHostToDevice, context_.stream()));
    CUPIPE_CHECK_CUDA(cudaStreamSynchronize(context_.stream()));
  }

  /// Copies device memory to the host, after the work enqueued before it.
  template <class U>
  void download(const U* from, std::span<U> to) {
    if (to.empty()) return;
    const backend::cuda::DeviceGuard guard(context_.device());
    CUPIPE_CHECK_CUDA(cudaMemcpyAsync(to.data(), from, to.size_bytes(), cudaMemcpyDeviceToHost, context_.stream()));
    CUPIPE_CHECK_CUDA(cudaStreamSynchronize(context_.stream()));
  }

  /// Waits for all work enqueued on this context; throws if a kernel reported bad input since the
  /// last check, or if the work failed.
  void synchronize() {
    const backend::cuda::DeviceGuard guard(context_.device());
    const backend::cuda::DeviceError found = context_.take_device_error();
    if (found.code == backend::cuda::label_out_of_range)
      CUPIPE_THROW("a softmax cross-entropy kernel met label ", found.value, " at row ", found.row,
                   ", outside its class range");
    if (found.code == backend::cuda::token_id_out_of_range)
      CUPIPE_THROW("an embedding kernel met token id ", found.value, " at row ", found.row, ", outside the vocabulary");
    if (found.code == backend::cuda::moe_slot_out_of_range)
      CUPIPE_THROW("a mixture of experts' permutation kernel met slot ", found.value, " at choice ", found.row,
                   ", outside its expert-sorted rows");
  }

  // A pipeline step's device-side timeline (see backend::cuda::ActionTimer): the origin, a mark after the
  // work enqueued so far on this stream, and a mark's seconds since the origin (waits for it).
  void timeline_start() {
    const backend::cuda::DeviceGuard guard(context_.device());
    context_.timer().start(context_.stream());
  }
  int timeline_mark() {
    const backend::cuda::DeviceGuard guard(context_.device());
    return context_.timer().mark(context_.stream());
  }
  double timeline_seconds(int mark) {
    const backend::cuda::DeviceGuard guard(context_.device());
    return context_.timer().seconds(mark);
  }
  /// An NVTX range for as long as the returned object lives (the pipeline names its actions "F3").
  [[nodiscard]] backend::cuda::NvtxRange annotate(const char* name) const noexcept { return backend::cuda::NvtxRange(name); }

  // DualPipeV's overlapped F&B on two streams of this device (see backend::cuda::Context): the F's ops go to
  // the side stream, the B's to the main stream beside it, and the join orders what follows.
  void overlap_begin() {
    const backend::cuda::DeviceGuard guard(context_.device());
    context_.overlap_begin();
  }
  void overlap_end() noexcept { context_.overlap_end(); }
  /// Whether ops go to the side stream now, and sending them there (where an overlap is open) or
  /// back: each action of a pair that takes turns on its own stream (pipeline/paired_turns.hpp).
  bool side_stream() const noexcept { return context_.on_side(); }
  void side_stream(bool side) noexcept { context_.set_side(side); }
  void overlap_join() {
    if (!context_.overlapping()) return;  // the runtime calls it after every action
    // No throw before the context's join: a failed guard must not leave the overlap open for good.
    const backend::cuda::DeviceGuard guard(context_.device(), std::nothrow);
    context_.overlap_join();
  }

  backend::cuda::Context& context() noexcept { return context_; }
  cudaStream_t stream() const noexcept { return context_.stream(); }
  int device() const noexcept { return context_.device(); }
  /// cuDNN's attention state (handle, graphs), made on the first attention call that may use it.
  backend::cuda::CudnnAttention& cudnn_attention() noexcept { return cudnn_attention_; }

 private:
  backend::cuda::Context context_;
  backend::cuda::CudnnAttention cudnn_attention_;  // after the context: its handle goes first
};

}  // namespace cupipe::backend

namespace cupipe::backend {

/// The CUDA backend times actions with events on its stream, names them in NVTX and runs an
/// overlapped F&B pair on two streams.
template <class T, class C>
struct capabilities<Cuda<T, C>> {
  static std::unique_ptr<Cuda<T, C>> make(int device) { return std::make_unique<Cuda<T, C>>(device); }
  static constexpr bool device_timeline = true;
  static void timeline_start(Cuda<T, C>& be) { be.timeline_start(); }
  static int timeline_mark(Cuda<T, C>& be) { return be.timeline_mark(); }
  static double timeline_seconds(Cuda<T, C>& be, int mark) { return be.timeline_seconds(mark); }
  static backend::cuda::NvtxRange annotate(Cuda<T, C>& be, const char* label) { return be.annotate(label); }
  static void overlap_begin(Cuda<T, C>& be) { be.overlap_begin(); }
  static void overlap_end(Cuda<T, C>& be) { be.overlap_end(); }
  static void overlap_join(Cuda<T, C>& be) { be.overlap_join(); }
  static bool defer_input_checks(Cuda<T, C>& be) {
    const bool previous = be.check_inputs;
    be.check_inputs = false;
    return previous;
  }
  /// A program that turned check_inputs off gets what it asked for: the next synchronize() reports.
  /// Without `report` (the step failed for another reason) what the step's ops recorded is
  /// dropped, so the next step does not report this batch's bad input as its own.
  static void resume_input_checks(Cuda<T, C>& be, bool previous, bool report) {
    be.check_inputs = previous;
    if (!previous) return;
    if (report) {
      be.synchronize();
      return;
    }
    try {
      const backend::cuda::DeviceGuard guard(be.device());
      (void)be.context().take_device_error();
    } catch (...) {  // the step's own failure is what the caller sees
    }
  }
};

}  // namespace cupipe::backend
