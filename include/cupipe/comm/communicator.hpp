// SPDX-License-Identifier: Apache-2.0
// Communicator: what a pipeline needs from the processes around it. In one process no communicator
// is used (mailboxes carry everything); across processes an implementation (MPI for host ranks, NCCL
// for device ranks) moves the messages to other stages and sums gradients over replicas.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <functional>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "cupipe/comm/message.hpp"
#include "cupipe/comm/topology.hpp"
#include "cupipe/core/error.hpp"
#include "cupipe/core/tensor.hpp"
#include "cupipe/core/tensor_group.hpp"
#include "cupipe/cp/context_group.hpp"
#include "cupipe/moe/expert_group.hpp"

namespace cupipe::comm {

/// Thrown by a point-to-point wait that Communicator::interrupt_waits() stopped.
struct Interrupted : std::exception {
  const char* what() const noexcept override {
    return "a communicator wait was interrupted (Communicator::interrupt_waits: a failure elsewhere in this process)";
  }
};

class Communicator {
 public:
  virtual ~Communicator() = default;

  /// Stops this process's point-to-point waits (receive, complete_sends) at their next poll, within
  /// about 10 ms: each throws Interrupted instead of waiting out its deadline. Any thread may call it
  /// (the pipeline does when one of its workers fails; a watchdog or a signal-handling thread may).
  /// It holds until resume_waits(), which the pipeline calls at the start of each step. Collectives
  /// are not interrupted: every rank has to reach them, and they have their own deadline. An NCCL
  /// communicator is aborted by an interrupted wait (its enqueued transfer cannot be withdrawn).
  void interrupt_waits() noexcept { interrupted_.store(true, std::memory_order_release); }
  void resume_waits() noexcept { interrupted_.store(false, std::memory_order_release); }
  bool waits_interrupted() const noexcept { return interrupted_.load(std::memory_order_acquire); }

  virtual const Topology& topology() const = 0;
  /// Whether send/receive/all-reduce take device pointers (NCCL) rather than host pointers (MPI).
  virtual bool device_memory() const = 0;

  /// Sends `bytes` to stage `to_stage` of this replica's pipeline without waiting for the receiver:
  /// the data is copied (or its transfer enqueued) before this returns, so the caller may reuse it
  /// (given a `stream`: in work enqueued on that stream from now on).
  /// A send never blocks on its receiver, matching the model `schedule::verify` proves deadlock-free
  /// (each worker keeps its next receives posted). `describe` names the message for errors.
  ///
  /// `stream` (send and receive), for a device communicator: the caller's CUDA stream (a
  /// cudaStream_t) whose queued work produces `data` (send) or last used the memory `data` is written
  /// to (receive), on the communicator's device. The communicator orders its copy after that work,
  /// and the stream's later work after the copy, with events: a send returns without the host
  /// waiting for the caller's kernels, and a receive is posted without it (the host then waits for
  /// them and for the message). Null: the data is ready now (the caller synchronised). Host
  /// communicators ignore it.
  virtual void send(int to_stage, const MessageKey& key, const void* data, std::size_t bytes,
                    const std::function<std::string()>& describe, void* stream = nullptr) = 0;
  /// Waits until every send has been received; one still pending after `timeout_seconds` (0: wait)
  /// is an error naming it. Called at the end of each step.
  virtual void complete_sends(double timeout_seconds) = 0;
  /// Receives exactly `bytes` for `key` from stage `from_stage` of this replica's pipeline.
  virtual void receive(int from_stage, const MessageKey& key, void* data, std::size_t bytes, double timeout_seconds,
                       const std::function<std::string()>& describe, void* stream = nullptr) = 0;

  /// Observers of this communicator's deadlines: each is called on the waiting thread, with the
  /// error's text, just before a wait (a receive, a step's sends, a collective) throws its timeout
  /// error. The pipeline's flight recorder dumps there (pipeline/flight_recorder.hpp). Returns a
  /// handle for forget_timeout_observer, which must be called before the observer goes.
  int observe_timeouts(std::function<void(const std::string&)> observer) {
    const std::lock_guard lock(observers_mutex_);
    observers_.emplace_back(++last_observer_, std::move(observer));
    return last_observer_;
  }
  void forget_timeout_observer(int handle) {
    const std::lock_guard lock(observers_mutex_);
    std::erase_if(observers_, [&](const auto& o) { return o.first == handle; });
  }

  /// How long a collective (the sums below) may wait for the other ranks before it throws: a rank
  /// that stalled or died before a collective must not hang the others. 0 waits for ever. After a
  /// collective timed out the communicator is unusable (a collective cannot be cancelled): end the
  /// job (MPI_Abort, or exit; MPI_Finalize would wait for the missing rank too).
  static constexpr double default_collective_timeout_seconds = 300;
  void set_collective_timeout(double seconds) {
    CUPIPE_REQUIRE(seconds >= 0, "Communicator: the collective timeout must be 0 (none) or positive, got ", seconds);
    collective_timeout_ = seconds;
  }
  double collective_timeout() const noexcept { return collective_timeout_; }

  /// In place: sums over the replicas of this rank's stage (the data-parallel group).
  virtual void sum_over_replicas(float* data, std::size_t count) = 0;
  virtual void sum_over_replicas(double* data, std::size_t count) = 0;
  /// Sums a host scalar over this replica's pipeline stages, or over every rank.
  virtual double sum_over_stages(double value) = 0;
  virtual double sum_over_world(double value) = 0;
  /// Element-wise sum over every rank, in place (host memory).
  virtual void sum_over_world(double* data, std::size_t count) = 0;
  /// In place, host memory: sums over this replica's pipeline stages (used to gather stage slices).
  virtual void sum_over_stages(float* data, std::size_t count) = 0;
  virtual void sum_over_stages(double* data, std::size_t count) = 0;
  /// In place, host memory: `data` holds replicas x `count` values, this replica's block at
  /// replica() x count; on return every block holds its replica's values (ZeRO-1's gather of the
  /// updated parameter shards). Communicators that cannot do it say so with all_gathers().
  virtual bool all_gathers() const { return false; }
  virtual void all_gather_over_replicas(float*, std::size_t) { refuse_all_gather(); }
  virtual void all_gather_over_replicas(double*, std::size_t) { refuse_all_gather(); }
  /// This rank's tensor-parallel group (Topology::tensor ranks of one stage of one replica), or null
  /// without tensor parallelism. Valid as long as the communicator.
  virtual TensorGroup* tensor_group() { return nullptr; }
  /// This rank's context-parallel ring (Topology::context ranks of one stage that share a
  /// data-parallel replica), or null without context parallelism. Valid as long as the communicator.
  virtual cp::ContextGroup* context_group() { return nullptr; }
  /// This rank's expert-parallel group (Topology::experts consecutive replicas of one stage), or null
  /// without expert parallelism. Valid as long as the communicator.
  virtual moe::ExpertGroup* expert_group() { return nullptr; }
  /// The same ranks as expert_group(), on communicators of their own: the group an overlapped F
  /// sends its tokens round while it takes turns with its partner B (pipeline/paired_turns.hpp), so
  /// that each group has one all-to-all in flight at a time. Null where there is none (the pair then
  /// runs back to back).
  virtual moe::ExpertGroup* paired_expert_group() { return nullptr; }
  /// In place, host memory, the converse of the gather: `data` holds replicas x `count` values; on
  /// return this replica's block (at replica() x count) holds that block summed over the replicas,
  /// and the other blocks are unspecified (ZeRO-1's reduce-scatter of the gradients: each replica
  /// receives only the sums of the shard it updates). Communicators that cannot do it say so with
  /// reduce_scatters(); ZeRO-1 then sums the whole gradients.
  virtual bool reduce_scatters() const { return false; }
  /// Nonblocking sums over the replicas of this rank's stage, in place, in the memory send() takes:
  /// start_sum_over_replicas() starts one and returns, finish_sums() waits for every started sum
  /// (under the collective timeout). The pipeline starts a stage's gradient sum as soon as the
  /// stage's last backward of the step is done, so it runs while the worker does the backward of its
  /// other stages. Communicators that cannot say so with starts_sums(); the pipeline then sums at
  /// the update. Every replica starts the same sums in the same order.
  virtual bool starts_sums() const { return false; }
  virtual void start_sum_over_replicas(float*, std::size_t) { refuse_started_sum(); }
  virtual void start_sum_over_replicas(double*, std::size_t) { refuse_started_sum(); }
  virtual void finish_sums() {}
  virtual void reduce_scatter_over_replicas(float*, std::size_t) { refuse_reduce_scatter(); }
  virtual void reduce_scatter_over_replicas(double*, std::size_t) { refuse_reduce_scatter(); }
  /// The reduce-scatter started like a sum, in the memory send() takes: `data` holds replicas x
  /// `count` values; once finish_sums() returns, this replica's block (at replica() x count) holds
  /// its sum over the replicas and the other blocks are unspecified. ZeRO-2 starts a stage's as soon
  /// as its last backward of the step is done. Communicators that cannot say so with
  /// starts_reduce_scatters(); the pipeline then reduce-scatters at the update.
  virtual bool starts_reduce_scatters() const { return false; }
  virtual void start_reduce_scatter_over_replicas(float*, std::size_t) { refuse_started_sum(); }
  virtual void start_reduce_scatter_over_replicas(double*, std::size_t) { refuse_started_sum(); }
  /// all_gather_over_replicas started, in host memory: once finish_gathers() returns (it waits for
  /// every started gather, not for the sums), every block of `data` holds its replica's values.
  /// ZeRO-3 prefetches the next virtual stage's weights so while an action computes. Communicators
  /// that cannot say so with starts_gathers(); ZeRO-3 then gathers where the weights are needed.
  virtual bool starts_gathers() const { return false; }
  virtual void start_all_gather_over_replicas(float*, std::size_t) { refuse_started_sum(); }
  virtual void start_all_gather_over_replicas(double*, std::size_t) { refuse_started_sum(); }
  virtual void finish_gathers() {}

 protected:
  /// What an implementation calls just before it throws a timeout error `what`.
  void timed_out(const std::string& what) noexcept {
    const std::lock_guard lock(observers_mutex_);
    for (const auto& o : observers_) {
      try {
        o.second(what);
      } catch (...) {  // an observer must not replace the timeout error
      }
    }
  }

 private:
  [[noreturn]] static void refuse_all_gather() {
    CUPIPE_THROW("Communicator: this communicator does not gather over replicas (ZeRO-1 needs it; MpiCommunicator and NcclCommunicator do)");
  }
  [[noreturn]] static void refuse_started_sum() {
    CUPIPE_THROW("Communicator: this communicator does not start sums, reduce-scatters or gathers to finish later "
                 "(check starts_sums(), starts_reduce_scatters() and starts_gathers() first)");
  }
  [[noreturn]] static void refuse_reduce_scatter() {
    CUPIPE_THROW("Communicator: this communicator does not reduce-scatter over replicas (check reduce_scatters() "
                 "first; MpiCommunicator and NcclCommunicator do)");
  }
  double collective_timeout_ = default_collective_timeout_seconds;
  std::atomic<bool> interrupted_{false};
  std::mutex observers_mutex_;
  std::vector<std::pair<int, std::function<void(const std::string&)>>> observers_;
  int last_observer_ = 0;
};

/// Whether `comm` reads and writes a backend's buffers itself (host buffers under MPI, device buffers
/// under NCCL); otherwise they travel through host memory.
template <class Backend>
bool reads_backend_memory(const Communicator& comm) {
  return host_accessible<typename Backend::space> != comm.device_memory();
}

}  // namespace cupipe::comm
