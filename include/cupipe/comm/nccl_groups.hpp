// SPDX-License-Identifier: Apache-2.0
// The groups an NcclCommunicator (comm/nccl.hpp) hands the layers, each on communicators the owner
// keeps (it aborts and frees them with its others) and reaches through callables, so that an aborted
// communicator is never used. Built only with CUPIPE_HAS_NCCL.
//
// NcclTensorGroup: the tensor-parallel group's in-place sum (TensorGroup), host or device memory.
//
// NcclExpertGroup: an expert-parallel group (moe::ExpertGroup) of device ranks, for `experts`
// consecutive data-parallel replicas of one stage, as comm::MpiExpertGroup is for host ranks (the same
// two communicators: the group's, and the holders' of this rank's experts).
// - The all-to-all is NCCL's grouped point-to-point form (as in NCCL's documentation and DeepSpeed's
//   and Megatron-LM's expert layers): one ncclSend and one ncclRecv per peer with values to move,
//   between ncclGroupStart and ncclGroupEnd, on the group's own stream, in device memory where the
//   layer's rows are (device_memory() is true; the layer synchronises its context first, since
//   this stream does not see that context's queue). start_all_to_all returns once it is enqueued, so
//   the rank computes while it runs; finish_all_to_all waits for its event on the host, under the
//   collective timeout, polling NCCL's asynchronous errors: no stream ever waits on an NCCL kernel
//   (comm/nccl.hpp's rule), and a dead peer fails the wait, aborting the communicators. Like every
//   collective's, that wait does not stop early on Communicator::interrupt_waits. It refuses host
//   memory, naming it (NCCL would fault on it).
// - The counts (a few int64 per peer, in host memory) travel the same way through a small device
//   buffer and pinned host memory, and are waited for at once.
// - The sums (the experts' gradients over their holders, the split tensors' norms and values over
//   the group) are the owner's all-reduce, which takes host or device memory.
#pragma once

#include <cuda_runtime_api.h>
#include <nccl.h>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>
#include <new>
#include <string>
#include <utility>
#include <vector>

#include "cupipe/backend/cuda/check.cuh"
#include "cupipe/backend/cuda/device_guard.cuh"
#include "cupipe/backend/cuda/stream.cuh"
#include "cupipe/comm/nccl_check.hpp"
#include "cupipe/comm/nccl_pinned.hpp"
#include "cupipe/comm/topology.hpp"
#include "cupipe/core/error.hpp"
#include "cupipe/core/tensor_group.hpp"
#include "cupipe/moe/expert_group.hpp"

namespace cupipe::comm {

/// The tensor-parallel group of an NcclCommunicator: `allreduce(data, n, type)` sums over its
/// communicator, in place, host or device memory, and returns when done.
class NcclTensorGroup final : public TensorGroup {
 public:
  using AllReduce = std::function<void(void* data, std::size_t n, ncclDataType_t type)>;
  NcclTensorGroup(int size, int rank, AllReduce allreduce) : size_(size), rank_(rank), allreduce_(std::move(allreduce)) {}
  int size() const override { return size_; }
  int rank() const override { return rank_; }
  bool device_memory() const override { return true; }
  void sum(float* data, std::size_t n) override { allreduce_(data, n, ncclFloat32); }
  void sum(double* data, std::size_t n) override { allreduce_(data, n, ncclFloat64); }

 private:
  int size_, rank_;
  AllReduce allreduce_;
};

/// The split color of this rank's expert-parallel group (its stage, tensor place and group of replicas).
inline int expert_group_color(const Topology& t) {
  return (t.stage() * t.tensor + t.tensor_rank()) * (t.replicas / t.experts) + t.expert_group_index();
}

/// "the expert-parallel group of 2 ranks (stage 0, replicas 2..3)": this rank's, for errors.
inline std::string expert_group_name(const Topology& t) {
  const int first = t.expert_group_index() * t.experts;
  return "the expert-parallel group of " + std::to_string(t.experts) + " ranks (stage " + std::to_string(t.stage()) +
         ", replicas " + std::to_string(first) + ".." + std::to_string(first + t.experts - 1) + ")";
}

class NcclExpertGroup final : public moe::ExpertGroup {
 public:
  /// What the group takes from its communicator.
  struct Owner {
    int device = 0;
    /// The group's communicator (`holders` false) or the holders' (true); throws once aborted.
    std::function<ncclComm_t(bool holders)> comm;
    /// In place, host or device memory: the sum over `comm(holders)`, waited for.
    std::function<void(void* data, std::size_t n, ncclDataType_t type, bool holders)> allreduce;
    /// Waits for `event` under the collective timeout, polling NCCL's errors; `what` names the wait.
    std::function<void(const backend::cuda::Event& event, const std::string& what)> wait;
  };

  NcclExpertGroup(Owner owner, int size, int rank, int holders_size, std::string name)
      : owner_(std::move(owner)), size_(size), rank_(rank), holders_size_(holders_size), name_(std::move(name)) {}
  NcclExpertGroup(const NcclExpertGroup&) = delete;
  NcclExpertGroup& operator=(const NcclExpertGroup&) = delete;
  ~NcclExpertGroup() override { release(); }

  int size() const override { return size_; }
  int rank() const override { return rank_; }
  int holders() const override { return holders_size_; }
  const char* name() const override { return name_.c_str(); }
  bool device_memory() const override { return true; }

  // The sums run on the communicator's collective stream: never while an all-to-all is in flight
  // on this group's. Another group's may be (a DualPipeV pair taking turns: the F's all-to-all on the
  // paired group while the B exchanges counts, or a stage's gradient sum starts): NCCL then runs two
  // communicators' kernels at once, which is safe only because every rank issues them in the same
  // order (the turns are the same on every rank); not yet run on GPUs (docs/gpu_notes.md).
  void sum(float* data, std::size_t n) override { summed(data, n, ncclFloat32, false); }
  void sum(double* data, std::size_t n) override { summed(data, n, ncclFloat64, false); }
  void sum_over_holders(float* data, std::size_t n) override { summed(data, n, ncclFloat32, true); }
  void sum_over_holders(double* data, std::size_t n) override { summed(data, n, ncclFloat64, true); }
  /// Whether an all-to-all was started and not finished.
  bool open() const { return open_; }

  void exchange_counts(const std::int64_t* send, std::int64_t* receive, std::size_t per_rank) override {
    CUPIPE_REQUIRE(!open_, "the counts' exchange over ", name_, ": an all-to-all is still open");
    const backend::cuda::DeviceGuard guard(owner_.device);
    const std::size_t values = per_rank * std::size_t(size_), bytes = values * sizeof(std::int64_t);
    reserve(2 * bytes);
    auto* device = static_cast<std::int64_t*>(device_);
    std::memcpy(pinned_, send, bytes);
    CUPIPE_CHECK_CUDA(cudaMemcpyAsync(device, pinned_, bytes, cudaMemcpyHostToDevice, stream_));
    ncclComm_t comm = owner_.comm(false);
    grouped([&] {
      for (int q = 0; q < size_; ++q) {
        CUPIPE_COMM_CHECK_NCCL(ncclSend(device + per_rank * std::size_t(q), per_rank, ncclInt64, q, comm, stream_));
        CUPIPE_COMM_CHECK_NCCL(ncclRecv(device + values + per_rank * std::size_t(q), per_rank, ncclInt64, q, comm, stream_));
      }
    });
    CUPIPE_CHECK_CUDA(cudaMemcpyAsync(pinned_, device + values, bytes, cudaMemcpyDeviceToHost, stream_));
    done_.record(stream_);
    owner_.wait(done_, "the counts' exchange before an all-to-all over " + name_);
    std::memcpy(receive, pinned_, bytes);
  }

  void start_all_to_all(const float* send, const std::int64_t* send_counts, float* receive,
                        const std::int64_t* receive_counts) override {
    start(send, send_counts, receive, receive_counts, ncclFloat32);
  }
  void start_all_to_all(const double* send, const std::int64_t* send_counts, double* receive,
                        const std::int64_t* receive_counts) override {
    start(send, send_counts, receive, receive_counts, ncclFloat64);
  }
  /// NCCL connects a group's peers at their first transfer: one count per pair here (the all-to-alls'
  /// point-to-point connections), and a sum over the holders, while every rank makes its communicator.
  /// The counts' buffers are made here too, large enough for any layer's exchange (cudaFree inside a
  /// step would wait for the whole device, pipeline sends included).
  void connect() {
    reserve(counts_bytes);
    std::vector<std::int64_t> send(std::size_t(size_), rank_), receive(send.size());
    exchange_counts(send.data(), receive.data(), 1);
    double one = 1;
    sum_over_holders(&one, 1);
  }

  void finish_all_to_all() override {
    CUPIPE_REQUIRE(open_, "finish_all_to_all over ", name_, ": no all-to-all was started");
    open_ = false;
    const backend::cuda::DeviceGuard guard(owner_.device);
    owner_.wait(done_, "an all-to-all over " + name_);
  }

 private:
  /// Bytes of the counts' device and pinned buffers made by connect(): a layer's exchange needs
  /// 2 x ranks x (4 + experts / ranks) int64 values, 4.6 KiB for 256 experts over 8 ranks.
  static constexpr std::size_t counts_bytes = std::size_t(64) << 10;

  template <class T>
  void start(const T* send, const std::int64_t* send_counts, T* receive, const std::int64_t* receive_counts,
             ncclDataType_t type) {
    CUPIPE_REQUIRE(!open_, "an all-to-all over ", name_, ": the previous one is still open (finish it first)");
    std::int64_t sending = 0, receiving = 0;
    for (int q = 0; q < size_; ++q) {
      CUPIPE_REQUIRE(send_counts[q] >= 0 && receive_counts[q] >= 0, "an all-to-all over ", name_,
                     ": negative counts for rank ", q);
      sending += send_counts[q];
      receiving += receive_counts[q];
    }
    const backend::cuda::DeviceGuard guard(owner_.device);
    CUPIPE_REQUIRE((sending == 0 || detail::on_device(send)) && (receiving == 0 || detail::on_device(receive)),
                   "an all-to-all over ", name_, " moves device memory, but was given host memory (a device backend's "
                   "layers hand it their rows; host buffers go through a group of host memory, such as MPI's)");
    ncclComm_t comm = owner_.comm(false);
    grouped([&] {
      std::int64_t sent = 0, received = 0;
      for (int q = 0; q < size_; ++q) {
        if (send_counts[q] > 0)
          CUPIPE_COMM_CHECK_NCCL(ncclSend(send + sent, std::size_t(send_counts[q]), type, q, comm, stream_));
        if (receive_counts[q] > 0)
          CUPIPE_COMM_CHECK_NCCL(ncclRecv(receive + received, std::size_t(receive_counts[q]), type, q, comm, stream_));
        sent += send_counts[q];
        received += receive_counts[q];
      }
    });
    done_.record(stream_);
    open_ = true;
  }

  /// `calls` (NCCL point-to-point calls) between ncclGroupStart and ncclGroupEnd; the group is ended
  /// even when a call fails, so that it does not swallow this thread's later NCCL calls.
  template <class Calls>
  static void grouped(Calls&& calls) {
    CUPIPE_COMM_CHECK_NCCL(ncclGroupStart());
    try {
      calls();
    } catch (...) {
      (void)ncclGroupEnd();
      throw;
    }
    CUPIPE_COMM_CHECK_NCCL(ncclGroupEnd());
  }

  void summed(void* data, std::size_t n, ncclDataType_t type, bool holders) {
    CUPIPE_REQUIRE(!open_, "a sum over ", holders ? "the holders of " : "", name_, ": an all-to-all is still open");
    if (!holders || holders_size_ > 1) owner_.allreduce(data, n, type, holders);
  }

  /// At least `bytes` of device memory and as many of pinned host memory for the counts.
  void reserve(std::size_t bytes) {
    if (bytes <= reserved_) return;
    release();
    CUPIPE_CHECK_CUDA(cudaMalloc(&device_, bytes));
    CUPIPE_CHECK_CUDA(cudaMallocHost(&pinned_, bytes));
    reserved_ = bytes;
  }
  void release() noexcept {
    const backend::cuda::DeviceGuard guard(owner_.device, std::nothrow);
    if (device_) (void)cudaFree(device_);
    if (pinned_) (void)cudaFreeHost(pinned_);
    device_ = pinned_ = nullptr;
    reserved_ = 0;
  }

  Owner owner_;
  int size_, rank_, holders_size_;
  std::string name_;
  backend::cuda::Stream stream_;  ///< the all-to-alls and the counts, in the order every rank issues them
  backend::cuda::Event done_{false};
  void* device_ = nullptr;
  void* pinned_ = nullptr;
  std::size_t reserved_ = 0;
  bool open_ = false;
};

}  // namespace cupipe::comm
