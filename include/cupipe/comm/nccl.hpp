// SPDX-License-Identifier: Apache-2.0
// NcclCommunicator: pipeline messages and gradient sums between device ranks over NCCL
// (device_memory() == true: every pointer it sends, receives or sums may be device memory).
// Built only with CUPIPE_HAS_NCCL (cupipe::cuda links NCCL when CMake finds it).
//
// Why it is shaped this way:
// - A send must never wait for its receiver (the model schedule::verify proves deadlock-free), but
//   an NCCL send occupies its stream until the peer posts the matching receive, and NCCL matches
//   point-to-point messages in issue order, without tags. So every directed channel
//   (sender stage -> receiver stage, activation or gradient) has its own two-rank communicator and
//   its own stream: a pending send holds up only later sends on the same channel, never a receive.
//   Each message is preceded by a small header carrying its key, checked on arrival, so a channel
//   consumed out of order is an error naming both messages rather than silently wrong data.
// - send() copies the data into a pooled device buffer the communicator owns (on a copy stream),
//   then enqueues header and payload as one NCCL group on the channel's stream, and returns.
//   complete_sends() polls the sends' events at step end. Given the caller's stream, the copy waits
//   for the caller's kernels and the caller's later kernels wait for the copy through events, so
//   the host waits for neither; a receive is posted behind the caller's queued work without a
//   host synchronisation, and the host then waits for that work and (with the deadline, counted
//   from the end of that work) for the message.
//   No caller stream ever waits on an NCCL kernel: a dead peer stalls only the host's wait, which
//   has a deadline, never a device synchronisation that has none.
// - receive(), complete_sends() and the sums poll (cudaEventQuery + ncclCommGetAsyncError, sleeping
//   between polls: comm/wait.hpp) with the transfer or the collective timeout; on expiry they abort
//   the communicators (ncclCommAbort), since a stuck NCCL kernel cannot be
//   cancelled otherwise, and throw naming the message and the peer stage.
// - Gradient sums run ncclAllReduce on the data-parallel communicator; host values (scalars, the
//   pipeline's host gathers) go through a device buffer. ZeRO-1's reduce-scatter and all-gather run
//   ncclReduceScatter / ncclAllGather in place on the same communicator; a started sum
//   (start_sum_over_replicas) is an all-reduce enqueued on the collective stream (one for every
//   collective, so they run in the order every rank issues them) that finish_sums() waits for.
//   Tensor parallelism sums over a third communicator (tensor_group()), host or device memory.
// - Expert parallelism (`experts` > 1): the expert group's communicator (the all-to-alls of rows in
//   device memory), the holders' (their gradient sums), and at first use a twin of the first for an
//   overlapped F (expert_group(), paired_expert_group()). Context parallelism (`context` > 1): a
//   ring's communicator, passing device memory (context_group()). All in comm/nccl_groups.hpp.
// - NCCL connects peers lazily, and a first transfer may wait for its peer: the constructor moves a
//   byte over every channel (connect_channels), so no pipeline send ever makes the first connection.
// - Point-to-point waits stop early on Communicator::interrupt_waits (the pipeline's abort), aborting
//   the communicators; collectives wait out the collective timeout (every rank must reach them).
// - Communicators come from ncclCommSplit of the world communicator (NCCL >= 2.18), else from
//   ncclCommInitRank per group with a unique id exchanged by the bootstrap (MPI or a shared file).
//
// Its parts: nccl_check.hpp (CUPIPE_COMM_CHECK_NCCL), nccl_bootstrap.hpp (unique ids, groups),
// nccl_channels.hpp (the ring's channels), nccl_pinned.hpp (message headers, host staging),
// nccl_groups.hpp (the tensor- and expert-parallel groups, the context-parallel ring).
//
// Threads: as with MPI, the stage's worker thread and the caller's thread never use it at once.
#pragma once

#include <cuda_runtime_api.h>
#include <nccl.h>

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#if defined(CUPIPE_HAS_MPI)
#include <mpi.h>
#endif

#include "cupipe/backend/cuda/check.cuh"
#include "cupipe/backend/cuda/device_guard.cuh"
#include "cupipe/backend/cuda/memory_pool.cuh"
#include "cupipe/backend/cuda/stream.cuh"
#include "cupipe/comm/communicator.hpp"
#include "cupipe/comm/pending_sends.hpp"
#include "cupipe/comm/wait.hpp"
#include "cupipe/comm/message.hpp"
#include "cupipe/comm/nccl_bootstrap.hpp"
#include "cupipe/comm/nccl_channels.hpp"
#include "cupipe/comm/nccl_check.hpp"
#include "cupipe/comm/nccl_groups.hpp"
#include "cupipe/comm/nccl_pinned.hpp"
#include "cupipe/comm/topology.hpp"
#include "cupipe/core/error.hpp"
#include "cupipe/core/memory.hpp"

namespace cupipe::comm {

class NcclCommunicator final : public Communicator {
 public:
  /// Splits a world of `world` ranks into pipelines of `stages` stages of `tensor` tensor-parallel
  /// ranks each, mapped by `order` (see Topology), every rank on `device`, from the world's unique
  /// id (made by rank 0 and shared by the bootstrap), with expert-parallel groups of `experts`
  /// consecutive replicas (expert_group()) and context-parallel rings of `context` (context_group()).
  /// `exchange` is needed only where NCCL cannot split communicators.
  NcclCommunicator(int world, int rank, int stages, int device, const ncclUniqueId& world_id, IdExchange exchange = {},
                   int tensor = 1, RankOrder order = RankOrder::stages_outermost, int experts = 1, int context = 1)
      : topology_(Topology::make(world, rank, stages, tensor, order, context, experts)),
        device_(detail::select_nccl_device(rank, device)),  // before the streams and events below are made
        exchange_(std::move(exchange)),
        tensor_sum_(topology_.tensor, topology_.tensor_rank(),
                    [this](void* data, std::size_t n, ncclDataType_t type) { allreduce(data, n, type, tensor_); }) {
    pool_.emplace(device_, memory_, copy_stream_.get());
    CUPIPE_COMM_CHECK_NCCL(ncclCommInitRank(&world_, world, world_id, rank));
    try {
      const Topology& t = topology_;
      // Every split is made by every rank, in this order (ncclCommSplit is collective over the world).
      replicas_ = group("replicas", t.stage() * t.tensor + t.tensor_rank(), t.replica(), t.replicas);
      pipeline_ = group("pipeline", t.replica() * t.tensor + t.tensor_rank(), t.stage(), t.stages);
      if (t.tensor > 1) tensor_ = group("tensor", t.stage() * t.replicas + t.replica(), t.tensor_rank(), t.tensor);
      groups_.make();
      CUPIPE_CHECK_CUDA(cudaMalloc(&scalar_, sizeof(double) * scalar_slots));
      CUPIPE_CHECK_CUDA(cudaMemset(scalar_, 0, sizeof(double) * scalar_slots));
      headers_.emplace();
      (void)pinned_.at_least(sizeof(double) * scalar_slots);  // the small host sums never pin memory in a step
      make_channels();
      connect_channels();
      connect_collectives();
      groups_.connect();
    } catch (...) {
      destroy(false);
      throw;
    }
  }
  NcclCommunicator(const NcclCommunicator&) = delete;
  NcclCommunicator& operator=(const NcclCommunicator&) = delete;
  ~NcclCommunicator() override {
    destroy(!pending_.empty() || aborted_ || sums_started_ || groups_.open());
  }

#if defined(CUPIPE_HAS_MPI)
  /// Every rank of `comm` calls this: rank 0 makes the world's unique id and MPI broadcasts it.
  static std::shared_ptr<NcclCommunicator> from_mpi(MPI_Comm comm, int stages, int device, int tensor = 1,
                                                    RankOrder order = RankOrder::stages_outermost, int experts = 1,
                                                    int context = 1) {
    detail::EnvironmentLaunch l = detail::mpi_launch(comm);
    return std::make_shared<NcclCommunicator>(l.world, l.rank, stages, device, l.id, std::move(l.exchange), tensor, order,
                                              experts, context);
  }
#endif

  /// For launchers without MPI (torchrun-style): RANK and WORLD_SIZE from the environment, and the
  /// unique id through a file every rank can read, named by CUPIPE_NCCL_ID_FILE. Rank 0 writes it
  /// atomically (remove a stale one before the launch); the others poll until it appears, for at
  /// most CUPIPE_NCCL_ID_TIMEOUT seconds (default 300).
  static std::shared_ptr<NcclCommunicator> from_environment(int stages, int device, int tensor = 1,
                                                            RankOrder order = RankOrder::stages_outermost, int experts = 1,
                                                            int context = 1) {
    detail::EnvironmentLaunch l = detail::environment_launch();
    return std::make_shared<NcclCommunicator>(l.world, l.rank, stages, device, l.id, std::move(l.exchange), tensor, order,
                                              experts, context);
  }

  const Topology& topology() const override { return topology_; }
  bool device_memory() const override { return true; }
  int device() const noexcept { return device_; }
  /// Bytes of the send copies in flight and their peak (tag workspace).
  const MemoryTracker& memory() const noexcept { return memory_; }

  void send(int to_stage, const MessageKey& key, const void* data, std::size_t bytes,
            const std::function<std::string()>& describe, void* stream = nullptr) override {
    check_alive();
    const backend::cuda::DeviceGuard guard(device_);
    reap();
    Channel& channel = channel_for(to_stage, Direction::send, key.flow, describe);
    Send out{backend::cuda::DeviceBuffer<std::byte>(*pool_, index_t(header_bytes + bytes), MemoryTag::workspace),
             backend::cuda::Event(false), describe(), to_stage};
    std::byte* buffer = out.buffer.data();
    const int slot = headers_->take();
    *headers_->at(slot) = Header{std::int32_t(key.flow), key.virtual_stage, key.microbatch, 0, std::int64_t(bytes)};
    // The copy runs on its own stream: behind a pending NCCL send it would wait for a receiver.
    // It starts after the caller's kernels that produce `data` (an event, not a host wait).
    const auto caller = static_cast<cudaStream_t>(stream);
    try {
      if (caller) {
        ready_.record(caller);  // fails (and says so) if the caller's stream is on another device
        copy_stream_.wait(ready_);
      }
      CUPIPE_CHECK_CUDA(cudaMemcpyAsync(buffer, headers_->at(slot), sizeof(Header), cudaMemcpyHostToDevice, copy_stream_));
      headers_->mark(slot, copy_stream_);
      if (bytes) CUPIPE_CHECK_CUDA(cudaMemcpyAsync(buffer + header_bytes, data, bytes, cudaMemcpyDefault, copy_stream_));
      copied_.record(copy_stream_);
      // The caller may reuse or free `data` once this returns: its later kernels wait for the copy
      // (or, without a stream, the host does; a local copy always finishes). The pooled copy travels.
      if (caller) CUPIPE_CHECK_CUDA(cudaStreamWaitEvent(caller, copied_, 0));
      else copied_.synchronize();
      channel.stream.wait(copied_);
    } catch (...) {
      // `out`'s block goes back to the pool as this unwinds: the copies into it must be done first.
      (void)cudaStreamSynchronize(copy_stream_);
      throw;
    }
    CUPIPE_COMM_CHECK_NCCL(ncclGroupStart());
    CUPIPE_COMM_CHECK_NCCL(ncclSend(buffer, header_bytes, ncclUint8, channel.peer, channel.comm, channel.stream));
    if (bytes) CUPIPE_COMM_CHECK_NCCL(ncclSend(buffer + header_bytes, bytes, ncclUint8, channel.peer, channel.comm, channel.stream));
    CUPIPE_COMM_CHECK_NCCL(ncclGroupEnd());
    out.done.record(channel.stream);
    pending_.add(std::move(out));
  }

  void complete_sends(double timeout_seconds) override {
    const backend::cuda::DeviceGuard guard(device_);
    pending_.complete([&](Send& s) { wait(s.done, timeout_seconds, [&] { return s.what; }, "not received", true); });
  }

  void receive(int from_stage, const MessageKey& key, void* data, std::size_t bytes, double timeout_seconds,
               const std::function<std::string()>& describe, void* stream = nullptr) override {
    check_alive();
    const backend::cuda::DeviceGuard guard(device_);
    Channel& channel = channel_for(from_stage, Direction::receive, key.flow, describe);
    backend::cuda::DeviceBuffer<std::byte> header_buffer(*pool_, index_t(header_bytes), MemoryTag::workspace);
    // `data` may have been in use by the caller's queued kernels: the receive starts after them
    // (an event on the device, not a host synchronisation before it is posted). The caller's
    // kernels that read `data` are enqueued after this returns, once the host saw it arrive.
    const auto caller = static_cast<cudaStream_t>(stream);
    if (caller) {
      ready_.record(caller);
      channel.stream.wait(ready_);
    }
    // The header tells the payload's size; a message of another size fails the header check, and
    // NCCL itself reports a truncated receive as an error.
    CUPIPE_COMM_CHECK_NCCL(ncclGroupStart());
    CUPIPE_COMM_CHECK_NCCL(ncclRecv(header_buffer.data(), header_bytes, ncclUint8, channel.peer, channel.comm, channel.stream));
    if (bytes) CUPIPE_COMM_CHECK_NCCL(ncclRecv(data, bytes, ncclUint8, channel.peer, channel.comm, channel.stream));
    CUPIPE_COMM_CHECK_NCCL(ncclGroupEnd());
    // Pinned, so this copy is asynchronous too: the host must only ever wait in wait(), with the timeout.
    CUPIPE_CHECK_CUDA(cudaMemcpyAsync(headers_->received(), header_buffer.data(), sizeof(Header), cudaMemcpyDeviceToHost,
                                      channel.stream));
    channel.received.record(channel.stream);
    // The deadline is the peer's: it starts once this rank's own queued work is done (that work
    // never waits on NCCL, so it ends; the wait still stops on interrupt_waits).
    if (caller) wait(ready_, 0, describe, "not started", true);
    wait(channel.received, timeout_seconds, describe, "not matched", true);
    const Header header = *headers_->received();
    if (header.flow != std::int32_t(key.flow) || header.virtual_stage != key.virtual_stage ||
        header.microbatch != key.microbatch || header.bytes != std::int64_t(bytes))
      CUPIPE_THROW(describe(), ": stage ", from_stage, " sent the ", header.flow == 0 ? "activation" : "gradient",
                   " of microbatch ", header.microbatch, " for virtual stage ", header.virtual_stage, " (", header.bytes,
                   " bytes) first, but ", bytes, " bytes were expected; the two stages disagree on the order of "
                   "their messages");
  }

  void sum_over_replicas(float* data, std::size_t n) override { allreduce(data, n, ncclFloat32, replicas_); }
  void sum_over_replicas(double* data, std::size_t n) override { allreduce(data, n, ncclFloat64, replicas_); }

  bool all_gathers() const override { return true; }
  void all_gather_over_replicas(float* data, std::size_t n) override { gather_or_scatter(data, n, ncclFloat32, true); }
  void all_gather_over_replicas(double* data, std::size_t n) override { gather_or_scatter(data, n, ncclFloat64, true); }
  bool reduce_scatters() const override { return true; }
  void reduce_scatter_over_replicas(float* data, std::size_t n) override { gather_or_scatter(data, n, ncclFloat32, false); }
  void reduce_scatter_over_replicas(double* data, std::size_t n) override {
    gather_or_scatter(data, n, ncclFloat64, false);
  }

  /// Started sums take device memory only (the pipeline starts them only where the communicator
  /// reads the backend's memory); the caller has synchronised the kernels that wrote it.
  bool starts_sums() const override { return true; }
  void start_sum_over_replicas(float* data, std::size_t n) override { start_collective(data, n, ncclFloat32, false); }
  void start_sum_over_replicas(double* data, std::size_t n) override { start_collective(data, n, ncclFloat64, false); }
  bool starts_reduce_scatters() const override { return true; }  // ZeRO-2's, the same way
  void start_reduce_scatter_over_replicas(float* data, std::size_t n) override { start_collective(data, n, ncclFloat32, true); }
  void start_reduce_scatter_over_replicas(double* data, std::size_t n) override { start_collective(data, n, ncclFloat64, true); }
  void finish_sums() override {
    if (!sums_started_) return;
    sums_started_ = false;
    const backend::cuda::DeviceGuard guard(device_);
    summed_.record(collective_stream_);
    wait(summed_, collective_timeout(), [&] { return "rank " + std::to_string(topology_.rank) + ": started NCCL sums"; },
         "not finished", false, "collective timeout: another rank stalled or died before reaching them");
  }

  TensorGroup* tensor_group() override { return topology_.tensor > 1 ? &tensor_sum_ : nullptr; }
  moe::ExpertGroup* expert_group() override { return groups_.experts(); }
  cp::ContextGroup* context_group() override { return groups_.ring(); }
  /// The overlapped F's group (null without experts), made at the first call (NcclGroups::paired_experts).
  moe::ExpertGroup* paired_expert_group() override { return groups_.paired_experts(); }
  void sum_over_stages(float* data, std::size_t n) override { allreduce(data, n, ncclFloat32, pipeline_); }
  void sum_over_stages(double* data, std::size_t n) override { allreduce(data, n, ncclFloat64, pipeline_); }
  double sum_over_stages(double value) override {
    allreduce(&value, 1, ncclFloat64, pipeline_);
    return value;
  }
  double sum_over_world(double value) override {
    allreduce(&value, 1, ncclFloat64, world_);
    return value;
  }
  void sum_over_world(double* data, std::size_t n) override { allreduce(data, n, ncclFloat64, world_); }

 private:
  enum class Direction { send, receive };
  static constexpr std::size_t header_bytes = 256;  // keeps the payload 256-byte aligned
  static constexpr std::size_t scalar_slots = 64;    // doubles in the device buffer for host sums

  using Header = detail::NcclHeader;
  using Channel = detail::NcclChannel;
  using HeaderRing = detail::NcclHeaderRing;

  /// A send in flight: the pooled copy it transmits, its header's slot and the event that marks it done.
  struct Send {
    backend::cuda::DeviceBuffer<std::byte> buffer;
    backend::cuda::Event done;
    std::string what;
    int to_stage;
  };

  /// A communicator of the world's ranks with the same `color` (ordered by `key`; null for a negative color).
  ncclComm_t group(const std::string& name, int color, int key, int size) {
    return detail::split_group(world_, exchange_, name, color, key, size);
  }

  /// The two-rank channels to this rank's neighbours in the pipeline ring (ring: interleaved
  /// schedules send from the last stage to the first).
  void make_channels() {
    const int p = topology_.stages;
    const int s = topology_.stage();
    const int links = detail::ring_links(p);
    for (int l = 0; l < links; ++l) {
      const int a = l, b = (l + 1) % p;
      const bool member = s == a || s == b;
      for (int c = 0; c < 4; ++c) {
        const auto [sender, receiver, flow] = detail::link_channel(a, b, c);
        // The pair's rank order: the sender first (key 0), so the peer is 1 - own index.
        const int own = s == sender ? 0 : 1;
        const std::string name = "link" + std::to_string(l) + "c" + std::to_string(c);
        const int color = topology_.replica() * topology_.tensor + topology_.tensor_rank();  // one pipeline's ranks
        ncclComm_t comm = group(name, member ? color : -1, member ? own : 0, 2);
        if (!member) continue;
        Channel& channel = channels_[{s == sender ? receiver : sender, s == sender ? Direction::send : Direction::receive, flow}];
        channel.comm = comm;
        channel.peer = 1 - own;
      }
    }
  }

  /// NCCL connects the two ranks of a communicator lazily, inside the first ncclGroupEnd that moves
  /// data between them, and that call may wait for the peer: a pipeline send would then wait for
  /// its receiver, which the schedules' deadlock-freedom argument rules out (Megatron-LM saw such
  /// hangs with lazily connected P2P). So every channel moves one byte here, while every rank is in
  /// the constructor: link by link in the same order on every rank, the four channels of a link in
  /// one group. A rank takes part in at most two links (s - 1 and s of the ring) and finishes the
  /// lower first, so the chain completes: link 0's ranks connect, then link 1's, and so on.
  void connect_channels() {
    const int p = topology_.stages;
    const int s = topology_.stage();
    const int links = detail::ring_links(p);
    auto* bytes = static_cast<std::uint8_t*>(scalar_);
    for (int l = 0; l < links; ++l) {
      const int a = l, b = (l + 1) % p;
      if (s != a && s != b) continue;
      std::vector<Channel*> used;
      CUPIPE_COMM_CHECK_NCCL(ncclGroupStart());
      for (int c = 0; c < 4; ++c) {
        const auto [sender, receiver, flow] = detail::link_channel(a, b, c);
        const bool sends = s == sender;
        Channel& channel = channels_.at({sends ? receiver : sender, sends ? Direction::send : Direction::receive, flow});
        if (sends) CUPIPE_COMM_CHECK_NCCL(ncclSend(bytes + c, 1, ncclUint8, channel.peer, channel.comm, channel.stream));
        else CUPIPE_COMM_CHECK_NCCL(ncclRecv(bytes + 4 + c, 1, ncclUint8, channel.peer, channel.comm, channel.stream));
        used.push_back(&channel);
      }
      CUPIPE_COMM_CHECK_NCCL(ncclGroupEnd());
      for (Channel* channel : used) {
        channel->received.record(channel->stream);
        wait(channel->received, collective_timeout(),
             [&] { return "rank " + std::to_string(topology_.rank) + ": connecting the channels between stages " +
                          std::to_string(a) + " and " + std::to_string(b); },
             "not connected", false, "collective timeout: is every rank constructing its NcclCommunicator?");
      }
    }
  }

  /// NCCL may also connect a collective communicator's ranks at its first collective: each sums one
  /// value here, under the collective timeout, so the first inside a step (a tensor-parallel sum in
  /// the first forward) does not make the connection.
  void connect_collectives() {
    for (ncclComm_t comm : {replicas_, pipeline_, tensor_})
      if (comm) allreduce(scalar_, 1, ncclFloat64, comm);
  }

  Channel& channel_for(int stage, Direction direction, Flow flow, const std::function<std::string()>& describe) {
    const auto it = channels_.find({stage, direction, flow});
    if (it == channels_.end())
      CUPIPE_THROW(describe(), ": stage ", stage, " is not a neighbour of stage ", topology_.stage(),
                   " in a pipeline of ", topology_.stages, " stages");
    return it->second;
  }

  /// Frees the copies of sends that have completed.
  void reap() {
    pending_.reap([](Send& s) { return s.done.ready(); });
  }

  void check_alive() const {
    if (aborted_) CUPIPE_THROW("NcclCommunicator: the communicators were aborted after an earlier failure");
  }

  /// Polls `event` and every communicator's asynchronous error; past the timeout (0: none) aborts
  /// the communicators and throws. An `interruptible` wait (point-to-point) also stops when
  /// interrupt_waits() was called: it aborts the communicators too (the enqueued transfer cannot be
  /// withdrawn) and throws Interrupted.
  void wait(const backend::cuda::Event& event, double timeout_seconds, const std::function<std::string()>& describe,
            const char* what, bool interruptible, const char* timeout_name = "transfer timeout; is the peer rank alive?") {
    const bool done = wait_until(
        [&] {
          if (event.ready()) return true;
          if (interruptible && waits_interrupted()) {
            abort_all();
            throw Interrupted{};
          }
          for (ncclComm_t comm : communicators()) {
            ncclResult_t async = ncclSuccess;
            CUPIPE_COMM_CHECK_NCCL(ncclCommGetAsyncError(comm, &async));
            if (async != ncclSuccess && async != ncclInProgress) {
              abort_all();
              CUPIPE_THROW(describe(), ": NCCL reported an asynchronous error: ", ncclGetErrorString(async));
            }
          }
          return false;
        },
        timeout_seconds);
    if (!done) {
      abort_all();
      const std::string error = ::cupipe::detail::str(describe(), ": ", what, " after ", timeout_seconds, " s (",
                                                      timeout_name, "); the NCCL communicators were aborted");
      timed_out(error);
      CUPIPE_THROW(error);
    }
  }

  /// Runs `enqueue(device pointer, stream)` on the collective stream over the `bytes` at `data`
  /// (device memory, or host memory staged through pinned and device buffers both ways) and waits
  /// for it under the collective timeout. `what` names the collective in errors. Host memory goes
  /// through pinned memory because a copy into pageable memory blocks the host until the stream
  /// gets there, outside any deadline.
  template <class Enqueue>
  void collective(void* data, std::size_t bytes, const char* what, Enqueue enqueue) {
    check_alive();
    if (bytes == 0) return;
    // Started sums may still be pending: this collective queues behind them on the one collective
    // stream (every rank issues its collectives in the same order) and the wait below covers them.
    const backend::cuda::DeviceGuard guard(device_);
    const cudaStream_t stream = collective_stream_;
    const bool device = detail::on_device(data);
    void* target = data;
    std::byte* host = nullptr;
    backend::cuda::DeviceBuffer<std::byte> staging;
    if (!device) {
      host = pinned_.at_least(bytes);
      std::memcpy(host, data, bytes);
      if (bytes <= sizeof(double) * scalar_slots) {
        target = scalar_;
      } else {
        staging = backend::cuda::DeviceBuffer<std::byte>(*pool_, index_t(bytes), MemoryTag::workspace);
        target = staging.data();
      }
      CUPIPE_CHECK_CUDA(cudaMemcpyAsync(target, host, bytes, cudaMemcpyHostToDevice, stream));
    }
    enqueue(static_cast<std::byte*>(target), stream);
    if (!device) CUPIPE_CHECK_CUDA(cudaMemcpyAsync(host, target, bytes, cudaMemcpyDeviceToHost, stream));
    summed_.record(stream);
    wait(summed_, collective_timeout(), [&] { return "rank " + std::to_string(topology_.rank) + ": an NCCL " + what; },
         "not finished", false, "collective timeout: another rank stalled or died before reaching it");
    if (!device) std::memcpy(data, host, bytes);
  }

  /// In-place sum of `n` values over `comm`, from device or host memory; returns when done.
  void allreduce(void* data, std::size_t n, ncclDataType_t type, ncclComm_t comm) {
    collective(data, n * detail::nccl_size_of(type), "all-reduce",
               [&](std::byte* p, cudaStream_t stream) {
                 CUPIPE_COMM_CHECK_NCCL(ncclAllReduce(p, p, n, type, ncclSum, comm, stream));
               });
  }

  /// ZeRO-1's in-place collectives over the replicas: `data` holds replicas x `n` values, this
  /// replica's block at replica() x n (NCCL's in-place layout, the replica being the rank within
  /// the replicas' communicator). Gather: every block from its replica; scatter: this block summed.
  void gather_or_scatter(void* data, std::size_t n, ncclDataType_t type, bool gather) {
    const std::size_t block = n * detail::nccl_size_of(type);
    const std::size_t mine = std::size_t(topology_.replica()) * block;
    collective(data, block * std::size_t(topology_.replicas), gather ? "all-gather" : "reduce-scatter",
               [&](std::byte* p, cudaStream_t stream) {
                 if (gather) CUPIPE_COMM_CHECK_NCCL(ncclAllGather(p + mine, p, n, type, replicas_, stream));
                 else CUPIPE_COMM_CHECK_NCCL(ncclReduceScatter(p, p + mine, n, type, ncclSum, replicas_, stream));
               });
  }

  /// A started all-reduce (`scatter`: reduce-scatter) over the replicas, on the collective stream.
  void start_collective(void* data, std::size_t n, ncclDataType_t type, bool scatter) {
    check_alive();
    if (n == 0) return;
    const backend::cuda::DeviceGuard guard(device_);
    CUPIPE_REQUIRE(detail::on_device(data), "NcclCommunicator: a started ", scatter ? "reduce-scatter" : "sum", " takes device memory "
                   "(the pipeline starts them only on memory the communicator reads)");
    std::byte* p = static_cast<std::byte*>(data);
    const std::size_t mine = std::size_t(topology_.replica()) * n * detail::nccl_size_of(type);
    if (scatter) {
      CUPIPE_COMM_CHECK_NCCL(ncclReduceScatter(p, p + mine, n, type, ncclSum, replicas_, collective_stream_));
    } else {
      CUPIPE_COMM_CHECK_NCCL(ncclAllReduce(p, p, n, type, ncclSum, replicas_, collective_stream_));
    }
    sums_started_ = true;
  }

  std::vector<ncclComm_t> communicators() const {
    std::vector<ncclComm_t> out;
    for (ncclComm_t c : {world_, pipeline_, replicas_, tensor_})
      if (c) out.push_back(c);
    groups_.add_communicators(out);
    for (const auto& [key, channel] : channels_)
      if (channel.comm) out.push_back(channel.comm);
    return out;
  }

  void abort_all() noexcept {
    if (aborted_) return;
    aborted_ = true;
    for (ncclComm_t c : communicators()) (void)ncclCommAbort(c);
    world_ = pipeline_ = replicas_ = tensor_ = nullptr;
    groups_.forget();
    for (auto& [key, channel] : channels_) channel.comm = nullptr;
  }

  /// Frees everything; after a failure (`abort`) aborts the communicators instead of waiting for
  /// their pending work.
  void destroy(bool abort) noexcept {
    const backend::cuda::DeviceGuard guard(device_, std::nothrow);
    if (abort) {
      abort_all();
    } else {
      for (ncclComm_t c : communicators()) {
#if NCCL_VERSION_CODE >= NCCL_VERSION(2, 14, 0)
        (void)ncclCommFinalize(c);
#endif
        (void)ncclCommDestroy(c);
      }
    }
    pending_.clear();
    channels_.clear();
    if (scalar_) (void)cudaFree(scalar_);
    scalar_ = nullptr;
    pinned_.release();
    headers_.reset();
  }

  Topology topology_;
  int device_;
  IdExchange exchange_;
  MemoryTracker memory_;
  backend::cuda::Stream copy_stream_;        // send copies
  backend::cuda::Stream collective_stream_;  // every collective, in the order this rank issues them
  backend::cuda::Event summed_{false};
  backend::cuda::Event ready_{false};   // the caller's stream's work so far (send and receive order after it)
  backend::cuda::Event copied_{false};
  std::optional<backend::cuda::DevicePool> pool_;
  ncclComm_t world_ = nullptr;
  ncclComm_t pipeline_ = nullptr;
  ncclComm_t replicas_ = nullptr;
  ncclComm_t tensor_ = nullptr;  ///< with tensor parallelism: this stage's tensor-parallel ranks
  NcclTensorGroup tensor_sum_;
  /// The expert-parallel groups and the context-parallel ring (after world_ and the waits they use).
  NcclGroups groups_{topology_, NcclGroups::Parent{
      device_, [this](const std::string& name, int color, int key, int size) { return group(name, color, key, size); },
      [this] { check_alive(); },
      [this](void* data, std::size_t n, ncclDataType_t type, ncclComm_t comm) { allreduce(data, n, type, comm); },
      [this](const backend::cuda::Event& event, const std::string& what) {
        wait(event, collective_timeout(), [&] { return "rank " + std::to_string(topology_.rank) + ": " + what; },
             "not finished", false, "collective timeout: another rank of the group stalled or died before reaching it");
      }}};
  bool sums_started_ = false;
  std::map<std::tuple<int, Direction, Flow>, Channel> channels_;
  std::optional<HeaderRing> headers_;  // made on the device, after select_device
  PendingSends<Send> pending_;
  void* scalar_ = nullptr;
  detail::PinnedStaging pinned_;  ///< host staging for collectives on host memory
  bool aborted_ = false;
};

}  // namespace cupipe::comm
