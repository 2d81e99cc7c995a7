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
//
// NcclGroups: the communicator's sub-groups (the expert groups above, the ring below), made,
// connected and kept for it.
//
// NcclRing: a context-parallel ring (cp::ContextGroup) of device ranks, for the ranks of one stage
// that share a data-parallel replica and a tensor-parallel place, as comm::MpiRing is for host ranks.
// A pass is one ncclSend to the next rank and one ncclRecv from the previous, grouped, on the ring's
// own stream, after the caller's stream's work so far (an event the ring's stream waits for: a
// compute stream never waits for NCCL). start_pass returns once it is enqueued; finish_pass waits
// for its event on the host under the collective timeout, polling NCCL's errors, as the expert
// group's all-to-all does. The sums (held-out losses, host memory) are the owner's all-reduce. A
// pass can be in flight beside another communicator's kernels (a stage's gradient sum started in
// the step): safe, as for the expert groups, only because every rank issues both in the same order.
#pragma once

#include <cuda_runtime_api.h>
#include <nccl.h>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
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
#include "cupipe/cp/context_group.hpp"
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

/// What a group (NcclExpertGroup, NcclRing) takes from its communicator.
struct NcclGroupOwner {
  int device = 0;
  /// The group's communicator (`holders` false) or the holders' of its experts (true); throws once
  /// the communicators were aborted.
  std::function<ncclComm_t(bool holders)> comm;
  /// In place, host or device memory: the sum over `comm(holders)`, waited for.
  std::function<void(void* data, std::size_t n, ncclDataType_t type, bool holders)> allreduce;
  /// Waits for `event` under the collective timeout, polling NCCL's errors; `what` names the wait.
  std::function<void(const backend::cuda::Event& event, const std::string& what)> wait;
};

class NcclExpertGroup final : public moe::ExpertGroup {
 public:
  using Owner = NcclGroupOwner;

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
    detail::nccl_grouped([&] {
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
    detail::nccl_grouped([&] {
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

class NcclRing final : public cp::ContextGroup {
 public:
  /// `owner`: the ring's communicator is its comm(false).
  NcclRing(NcclGroupOwner owner, int size, int rank, std::string name)
      : owner_(std::move(owner)), size_(size), rank_(rank), name_(std::move(name)) {}
  NcclRing(const NcclRing&) = delete;
  NcclRing& operator=(const NcclRing&) = delete;

  int size() const override { return size_; }
  int rank() const override { return rank_; }
  bool device_memory() const override { return true; }
  /// Whether a pass was started and not finished.
  bool open() const { return open_; }

  void start_pass(const void* send, void* receive, std::size_t bytes, void* stream) override {
    CUPIPE_REQUIRE(!open_, name_, ": a pass started while another is in flight (finish_pass first)");
    const backend::cuda::DeviceGuard guard(owner_.device);
    CUPIPE_REQUIRE(bytes == 0 || (detail::on_device(send) && detail::on_device(receive)), name_, ": a pass moves device "
                   "memory, but was given host memory (host rings are MPI's)");
    if (stream) {
      ready_.record(static_cast<cudaStream_t>(stream));
      CUPIPE_CHECK_CUDA(cudaStreamWaitEvent(stream_, ready_, 0));
    }
    ncclComm_t comm = owner_.comm(false);
    const int next = (rank_ + 1) % size_, previous = (rank_ + size_ - 1) % size_;
    detail::nccl_grouped([&] {
      CUPIPE_COMM_CHECK_NCCL(ncclSend(send, bytes, ncclUint8, next, comm, stream_));
      CUPIPE_COMM_CHECK_NCCL(ncclRecv(receive, bytes, ncclUint8, previous, comm, stream_));
    });
    done_.record(stream_);
    open_ = true;
  }
  void finish_pass() override {
    CUPIPE_REQUIRE(open_, name_, ": finish_pass without a pass in flight");
    open_ = false;
    const backend::cuda::DeviceGuard guard(owner_.device);
    owner_.wait(done_, "a pass of keys and values round " + name_);
  }
  void sum(double* data, std::size_t count) override {
    CUPIPE_REQUIRE(!open_, name_, ": a sum while a pass is in flight");
    owner_.allreduce(data, count, ncclFloat64, false);
  }

  /// NCCL connects the ring's neighbours at their first transfer: one pass of a byte here, and a
  /// sum, while every rank makes its communicator, so that the first pass of a step does not.
  void connect() {
    const backend::cuda::DeviceGuard guard(owner_.device);
    std::byte* bytes = nullptr;
    CUPIPE_CHECK_CUDA(cudaMalloc(&bytes, 2));  // once, before any step
    try {
      start_pass(bytes, bytes + 1, 1, nullptr);
      finish_pass();
    } catch (...) {
      (void)cudaFree(bytes);
      throw;
    }
    CUPIPE_CHECK_CUDA(cudaFree(bytes));
    double one = 1;
    sum(&one, 1);
  }

 private:
  NcclGroupOwner owner_;
  int size_, rank_;
  std::string name_;
  backend::cuda::Stream stream_;  ///< the passes, in the order every rank of the ring issues them
  backend::cuda::Event ready_{false}, done_{false};
  bool open_ = false;
};

/// The groups of an NcclCommunicator beside its pipeline, replicas and tensor-parallel ranks: the
/// expert-parallel group, the holders of this rank's experts and, at first use, the overlapped F's
/// twin of the group; and the context-parallel ring. Their communicators are split from the world
/// (collective: every rank makes them in the same order); the owner aborts or frees them with its
/// others (add_communicators, forget).
class NcclGroups {
 public:
  /// What the groups take from their owner.
  struct Parent {
    int device = 0;
    /// A communicator of the world's ranks with the same `color`, ordered by `key` (NcclCommunicator::group).
    std::function<ncclComm_t(const std::string& name, int color, int key, int size)> split;
    std::function<void()> check_alive;  ///< throws once the communicators were aborted
    std::function<void(void* data, std::size_t n, ncclDataType_t type, ncclComm_t comm)> allreduce;
    std::function<void(const backend::cuda::Event& event, const std::string& what)> wait;
  };
  NcclGroups(const Topology& t, Parent parent) : t_(t), parent_(std::move(parent)) {}

  /// Splits the groups the topology asks for (split as MpiCommunicator's), then connect() them.
  void make() {
    if (t_.experts > 1) {
      const int groups = t_.replicas / t_.experts, base = t_.stage() * t_.tensor + t_.tensor_rank();
      experts_comm_ = parent_.split("experts", expert_group_color(t_), t_.expert_rank(), t_.experts);
      if (groups > 1) holders_comm_ = parent_.split("holders", base * t_.experts + t_.expert_rank(), t_.expert_group_index(), groups);
      experts_ = make_experts(&NcclGroups::experts_comm_, expert_group_name(t_));
    }
    if (t_.context > 1) {
      ring_comm_ = parent_.split("ring", t_.ring_color(), t_.context_rank(), t_.context);
      ring_ = std::make_unique<NcclRing>(owner(&NcclGroups::ring_comm_), t_.context, t_.context_rank(), t_.ring_name());
    }
  }
  void connect() {
    if (experts_) experts_->connect();
    if (ring_) ring_->connect();
  }

  moe::ExpertGroup* experts() { return experts_.get(); }
  cp::ContextGroup* ring() { return ring_.get(); }
  /// The overlapped F's group (null without experts): the same ranks, its own communicator and
  /// stream, made at the first call, collective over the world (every rank's Pipeline with
  /// PipelineOptions::paired_turns).
  moe::ExpertGroup* paired_experts() {
    if (experts_ && !paired_experts_) {
      parent_.check_alive();
      paired_comm_ = parent_.split("experts-paired", expert_group_color(t_), t_.expert_rank(), t_.experts);
      const std::string name = expert_group_name(t_);  // "... replicas 2..3)"
      paired_experts_ = make_experts(&NcclGroups::paired_comm_, name.substr(0, name.size() - 1) + "; an overlapped F's)");
      paired_experts_->connect();
    }
    return paired_experts_.get();
  }
  /// Whether a group has a transfer in flight (then the owner aborts rather than frees).
  bool open() const {
    return (experts_ && experts_->open()) || (paired_experts_ && paired_experts_->open()) || (ring_ && ring_->open());
  }
  void add_communicators(std::vector<ncclComm_t>& out) const {
    for (ncclComm_t c : {experts_comm_, paired_comm_, holders_comm_, ring_comm_})
      if (c) out.push_back(c);
  }
  /// After the owner aborted or freed the communicators.
  void forget() noexcept { experts_comm_ = paired_comm_ = holders_comm_ = ring_comm_ = nullptr; }

 private:
  /// What a group whose own communicator is `own` takes: that (or the holders'), sums over it, and waits.
  NcclGroupOwner owner(ncclComm_t NcclGroups::*own) {
    const auto comm = [this, own](bool holders) {
      parent_.check_alive();
      return holders ? holders_comm_ : this->*own;
    };
    const auto sum = [this, comm](void* data, std::size_t n, ncclDataType_t type, bool h) { parent_.allreduce(data, n, type, comm(h)); };
    return {parent_.device, comm, sum, parent_.wait};
  }
  std::unique_ptr<NcclExpertGroup> make_experts(ncclComm_t NcclGroups::*own, std::string name) {
    return std::make_unique<NcclExpertGroup>(owner(own), t_.experts, t_.expert_rank(), t_.replicas / t_.experts, std::move(name));
  }

  Topology t_;
  Parent parent_;
  ncclComm_t experts_comm_ = nullptr;  ///< with expert parallelism: this rank's expert-parallel group
  ncclComm_t paired_comm_ = nullptr;   ///< the same ranks, for the overlapped F's all-to-alls
  ncclComm_t holders_comm_ = nullptr;  ///< and the holders of its experts (null: one group per stage)
  ncclComm_t ring_comm_ = nullptr;     ///< with context parallelism: this rank's ring
  std::unique_ptr<NcclExpertGroup> experts_, paired_experts_;
  std::unique_ptr<NcclRing> ring_;
};

}  // namespace cupipe::comm
