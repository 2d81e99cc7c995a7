// SPDX-License-Identifier: Apache-2.0
// MpiCommunicator: pipeline messages and gradient sums between host ranks over MPI (OpenMPI from
// Debian, launched with mpirun or srun). Every MPI return code is checked and becomes a
// cupipe::error naming the call: the communicators it creates return errors (MPI_ERRORS_RETURN)
// instead of MPI's default of aborting the job from inside the call.
//
// Every wait has a deadline and sleeps between polls (comm/wait.hpp): a receive or the sends of a
// step wait at most the transfer timeout the pipeline passes; a collective (MPI_Iallreduce) waits
// at most collective_timeout(), then throws naming the group. After a collective timed out the
// communicator refuses further calls and is not freed (the collective is still pending). Before a
// wait throws its timeout it tells the observers (Communicator::observe_timeouts: the flight recorder).
//
// Threads: a rank runs its stage's worker on its own thread, the caller's thread does the collectives
// after the step, and the communicator's own progress thread tests its sends in flight. Every MPI call
// of the communicator holds one mutex, so no two threads are ever inside MPI at once and
// MPI_THREAD_SERIALIZED is enough. The constructor checks the level the program initialised MPI with.
//
// Why a progress thread: MPI moves a large message only while its sender or receiver is inside an MPI
// call, and over shared memory without single-copy (CMA off, as in containers and in CI) the sender's
// calls copy its fragments. A stage sends, then computes its next action without calling MPI, so its
// receiver waited for that whole computation (measured: a 4 MiB hand-over took 453 ms while the sender
// computed for 400 ms; tests/comm/mpi_progress_check). While sends are in flight the thread tests them
// as comm/wait.hpp's waits poll: back to back for a millisecond, then sleeping with a growing backoff;
// with nothing in flight it sleeps on a condition variable.
#pragma once

#include <mpi.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstring>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "cupipe/comm/communicator.hpp"
#include "cupipe/comm/mpi_check.hpp"
#include "cupipe/comm/mpi_experts.hpp"
#include "cupipe/comm/mpi_ring.hpp"
#include "cupipe/comm/pending_sends.hpp"
#include "cupipe/comm/wait.hpp"
#include "cupipe/core/error.hpp"

namespace cupipe::comm {

/// Initialises MPI for the lifetime of the object (MPI_THREAD_SERIALIZED at least) unless the
/// program already did, and finalises it if it initialised it. MPI_Finalize waits for every rank:
/// after a communication failure end the job with MPI_Abort instead (as the trainers do).
class MpiSession {
 public:
  MpiSession(int* argc, char*** argv) {
    int initialised = 0;
    CUPIPE_CHECK_MPI(MPI_Initialized(&initialised));
    if (!initialised) {
      int provided = 0;
      CUPIPE_CHECK_MPI(MPI_Init_thread(argc, argv, MPI_THREAD_SERIALIZED, &provided));
      owns_ = true;
      if (provided < MPI_THREAD_SERIALIZED)
        CUPIPE_THROW("MPI provides thread level ", provided, " but cupipe needs MPI_THREAD_SERIALIZED (",
                     MPI_THREAD_SERIALIZED, "): a worker thread sends while the main thread waits");
    }
  }
  MpiSession(const MpiSession&) = delete;
  MpiSession& operator=(const MpiSession&) = delete;
  ~MpiSession() {
    int finalised = 0;
    if (owns_ && MPI_Finalized(&finalised) == MPI_SUCCESS && !finalised) MPI_Finalize();
  }

 private:
  bool owns_ = false;
};

class MpiCommunicator final : public Communicator {
 public:
  /// Splits `world` into pipelines of `stages` stages, each stage `tensor_parallel` ranks, the
  /// ranks mapped in `order` (see Topology), a stage's replicas in context-parallel rings of
  /// `context_parallel` (context_group()) or expert-parallel groups of `expert_parallel`
  /// (expert_group()).
  MpiCommunicator(MPI_Comm world, int stages, double collective_timeout_seconds = default_collective_timeout_seconds,
                  int tensor_parallel = 1, RankOrder order = RankOrder::stages_outermost, int context_parallel = 1,
                  int expert_parallel = 1)
      : tensor_sum_(*this) {
    set_collective_timeout(collective_timeout_seconds);
    int level = 0;
    CUPIPE_CHECK_MPI(MPI_Query_thread(&level));
    if (level < MPI_THREAD_SERIALIZED)
      CUPIPE_THROW("MPI was initialised with thread level ", level, "; cupipe needs MPI_THREAD_SERIALIZED (use MPI_Init_thread or MpiSession)");
    int size = 0, rank = 0;
    CUPIPE_CHECK_MPI(MPI_Comm_size(world, &size));
    CUPIPE_CHECK_MPI(MPI_Comm_rank(world, &rank));
    topology_ = Topology::make(size, rank, stages, tensor_parallel, order, context_parallel, expert_parallel);
    const Topology& t = topology_;
    CUPIPE_CHECK_MPI(MPI_Comm_dup(world, &world_));
    CUPIPE_CHECK_MPI(MPI_Comm_set_errhandler(world_, MPI_ERRORS_RETURN));
    // A pipeline joins the stages of one replica at one tensor-parallel place; the replicas of a
    // stage likewise; a tensor-parallel group, the ranks of one stage of one replica.
    CUPIPE_CHECK_MPI(MPI_Comm_split(world_, t.replica() * t.tensor + t.tensor_rank(), t.stage(), &pipeline_));
    CUPIPE_CHECK_MPI(MPI_Comm_split(world_, t.stage() * t.tensor + t.tensor_rank(), t.replica(), &replicas_));
    CUPIPE_CHECK_MPI(MPI_Comm_split(world_, t.replica() * t.stages + t.stage(), t.tensor_rank(), &tensor_));
    CUPIPE_CHECK_MPI(MPI_Comm_set_errhandler(pipeline_, MPI_ERRORS_RETURN));
    CUPIPE_CHECK_MPI(MPI_Comm_set_errhandler(replicas_, MPI_ERRORS_RETURN));
    CUPIPE_CHECK_MPI(MPI_Comm_set_errhandler(tensor_, MPI_ERRORS_RETURN));
    if (t.context > 1) make_ring();
    if (t.experts > 1) make_expert_group();
    int* upper = nullptr;
    int found = 0;
    CUPIPE_CHECK_MPI(MPI_Comm_get_attr(world_, MPI_TAG_UB, &upper, &found));
    tag_limit_ = found && upper ? *upper : 32767;
    progress_ = std::thread([this] { progress_loop(); });
  }
  MpiCommunicator(const MpiCommunicator&) = delete;
  MpiCommunicator& operator=(const MpiCommunicator&) = delete;
  ~MpiCommunicator() override {
    {
      const std::lock_guard lock(mutex_);
      stopping_ = true;
    }
    in_flight_.notify_all();
    if (progress_.joinable()) progress_.join();
    int finalised = 0;
    if (MPI_Finalized(&finalised) != MPI_SUCCESS || finalised || broken_) return;
    for (Send& p : pending_) {  // after a failure: give up on what was never received
      MPI_Cancel(&p.request);
      MPI_Request_free(&p.request);
    }
    if (ring_) {
      MPI_Comm ring = ring_->communicator();
      MPI_Comm_free(&ring);
    }
    for (const auto* group : {experts_.get(), paired_experts_.get()})
      if (group)
        for (MPI_Comm c : group->communicators()) MPI_Comm_free(&c);
    MPI_Comm_free(&tensor_);
    MPI_Comm_free(&replicas_);
    MPI_Comm_free(&pipeline_);
    MPI_Comm_free(&world_);
  }

  const Topology& topology() const override { return topology_; }
  bool device_memory() const override { return false; }

  void send(int to_stage, const MessageKey& key, const void* data, std::size_t bytes,
            const std::function<std::string()>& describe, void* /*stream: host memory*/ = nullptr) override {
    check_usable();
    Send out{MPI_REQUEST_NULL, std::vector<std::byte>(bytes), describe()};
    if (bytes) std::memcpy(out.data.data(), data, bytes);
    {
      const std::lock_guard lock(mutex_);
      reap();
      CUPIPE_CHECK_MPI(MPI_Isend(out.data.data(), count(bytes), MPI_BYTE, to_stage, tag(key), pipeline_, &out.request));
      pending_.add(std::move(out));
    }
    in_flight_.notify_one();
  }

  /// Waits until every send has completed (the progress thread may complete some meanwhile); past
  /// the timeout throws naming the oldest send still in flight.
  void complete_sends(double timeout_seconds) override {
    const bool done = wait_until(
        [&] {
          const std::lock_guard lock(mutex_);
          reap();
          if (!pending_.empty() && waits_interrupted()) throw Interrupted{};
          return pending_.empty();
        },
        timeout_seconds);
    if (!done) {
      std::string what;
      {
        const std::lock_guard lock(mutex_);
        if (pending_.empty()) return;  // the progress thread saw the last one complete meanwhile
        what = ::cupipe::detail::str(pending_.begin()->what, ": not matched after ", timeout_seconds,
                           " s (transfer timeout; is the peer rank alive?)");
      }
      timed_out(what);
      CUPIPE_THROW(what);
    }
  }

  void receive(int from_stage, const MessageKey& key, void* data, std::size_t bytes, double timeout_seconds,
               const std::function<std::string()>& describe, void* /*stream: host memory*/ = nullptr) override {
    check_usable();
    MPI_Request request;
    {
      const std::lock_guard lock(mutex_);
      CUPIPE_CHECK_MPI(MPI_Irecv(data, count(bytes), MPI_BYTE, from_stage, tag(key), pipeline_, &request));
    }
    MPI_Status status = wait(request, timeout_seconds, describe);
    int received = 0;
    {
      const std::lock_guard lock(mutex_);
      CUPIPE_CHECK_MPI(MPI_Get_count(&status, MPI_BYTE, &received));
    }
    if (std::size_t(received) != bytes)
      CUPIPE_THROW(describe(), ": received ", received, " bytes but expected ", bytes);
  }

  void sum_over_replicas(float* data, std::size_t n) override { allreduce(data, n, MPI_FLOAT, Group::replicas); }
  void sum_over_replicas(double* data, std::size_t n) override { allreduce(data, n, MPI_DOUBLE, Group::replicas); }
  void sum_over_stages(float* data, std::size_t n) override { allreduce(data, n, MPI_FLOAT, Group::pipeline); }
  void sum_over_stages(double* data, std::size_t n) override { allreduce(data, n, MPI_DOUBLE, Group::pipeline); }
  double sum_over_stages(double value) override {
    allreduce(&value, 1, MPI_DOUBLE, Group::pipeline);
    return value;
  }
  double sum_over_world(double value) override {
    allreduce(&value, 1, MPI_DOUBLE, Group::world);
    return value;
  }
  void sum_over_world(double* data, std::size_t n) override { allreduce(data, n, MPI_DOUBLE, Group::world); }
  bool all_gathers() const override { return true; }
  bool starts_sums() const override { return true; }
  void start_sum_over_replicas(float* data, std::size_t n) override { start_sum(data, n, MPI_FLOAT); }
  void start_sum_over_replicas(double* data, std::size_t n) override { start_sum(data, n, MPI_DOUBLE); }
  /// Waits for every started sum under the collective timeout (the progress thread drives them
  /// meanwhile, as it drives the sends).
  void finish_sums() override {
    std::vector<MPI_Request> started;
    std::vector<std::function<void()>> then;
    std::vector<double> bytes;
    {
      const std::lock_guard lock(mutex_);
      started.swap(started_sums_);
      then.swap(after_sums_);
      bytes.swap(started_bytes_[0]);
    }
    for (std::size_t i = 0; i < started.size(); ++i)
      finish_collective(started[i], "a gradient sum over " + describe(Group::replicas), bytes[i]);
    for (const auto& f : then) f();
  }
  bool starts_reduce_scatters() const override { return true; }
  void start_reduce_scatter_over_replicas(float* data, std::size_t n) override { start_reduce_scatter(data, n, MPI_FLOAT); }
  void start_reduce_scatter_over_replicas(double* data, std::size_t n) override { start_reduce_scatter(data, n, MPI_DOUBLE); }
  bool starts_gathers() const override { return true; }
  void start_all_gather_over_replicas(float* data, std::size_t n) override { start_gather(data, n, MPI_FLOAT); }
  void start_all_gather_over_replicas(double* data, std::size_t n) override { start_gather(data, n, MPI_DOUBLE); }
  /// Waits for every started gather under the collective timeout (the progress thread drives them).
  void finish_gathers() override {
    std::vector<MPI_Request> started;
    std::vector<double> bytes;
    {
      const std::lock_guard lock(mutex_);
      started.swap(started_gathers_);
      bytes.swap(started_bytes_[1]);
    }
    for (std::size_t i = 0; i < started.size(); ++i)
      finish_collective(started[i], "a gather over " + describe(Group::replicas), bytes[i]);
  }
  void all_gather_over_replicas(float* data, std::size_t n) override { allgather(data, n, MPI_FLOAT); }
  void all_gather_over_replicas(double* data, std::size_t n) override { allgather(data, n, MPI_DOUBLE); }
  TensorGroup* tensor_group() override { return topology_.tensor > 1 ? &tensor_sum_ : nullptr; }
  cp::ContextGroup* context_group() override { return ring_.get(); }
  moe::ExpertGroup* expert_group() override { return experts_.get(); }
  moe::ExpertGroup* paired_expert_group() override { return paired_experts_.get(); }
  bool reduce_scatters() const override { return true; }
  void reduce_scatter_over_replicas(float* data, std::size_t n) override {
    reduce_scatter(data, n, MPI_FLOAT);
    place_own_block(data, n);
  }
  void reduce_scatter_over_replicas(double* data, std::size_t n) override {
    reduce_scatter(data, n, MPI_DOUBLE);
    place_own_block(data, n);
  }

 private:
  /// MPI_Test calls per poll of a wait or of the progress thread: each test moves a few fragments of
  /// a large message, and costs well under a microsecond when there is nothing to move.
  static constexpr int progress_burst = 64;

  /// A send in flight: the request and the copy of the data it reads.
  struct Send {
    MPI_Request request;
    std::vector<std::byte> data;
    std::string what;
  };

  /// Frees the copies of sends that have completed. The caller holds mutex_.
  void reap() {
    pending_.reap([](Send& s) {
      int done = 0;
      CUPIPE_CHECK_MPI(MPI_Test(&s.request, &done, MPI_STATUS_IGNORE));
      return done != 0;
    });
  }

  static int count(std::size_t bytes) {
    if (bytes > std::size_t(INT32_MAX)) CUPIPE_THROW("MPI message of ", bytes, " bytes exceeds 2 GiB; use smaller microbatches");
    return int(bytes);
  }
  /// (microbatch, virtual stage, flow) packed into one tag.
  int tag(const MessageKey& key) const {
    const long long t = message_tag(key);
    if (key.virtual_stage >= 1024 || t > tag_limit_)
      CUPIPE_THROW("MPI tag for microbatch ", key.microbatch, " of virtual stage ", key.virtual_stage,
                   " exceeds this MPI's MPI_TAG_UB (", tag_limit_, ")");
    return int(t);
  }
  /// Tests `request` until it completes (true) or `timeout_seconds` pass (false; 0: no deadline),
  /// back to back for `poll_for` seconds, then sleeping between tests (comm/wait.hpp), each test
  /// under mutex_. With `interrupted`, also stops (false, setting it) once interrupt_waits() was called.
  bool completes_within(MPI_Request& request, MPI_Status* status, double timeout_seconds, bool* interrupted = nullptr,
                        double poll_for = poll_seconds) {
    bool completed = false;
    wait_until(
        [&] {
          const std::lock_guard lock(mutex_);
          int flag = 0;
          for (int i = 0; i < progress_burst && !flag; ++i) CUPIPE_CHECK_MPI(MPI_Test(&request, &flag, status));
          completed = flag != 0;
          if (!completed && interrupted && waits_interrupted()) *interrupted = true;
          return completed || (interrupted && *interrupted);
        },
        timeout_seconds, poll_for);
    return completed;
  }

  /// Polls the request until it completes (sleeping between polls); past the timeout, or when
  /// interrupt_waits() was called, cancels it and throws.
  /// A receive waits mostly for its sender's compute, not its data, so it polls back to back only
  /// for poll_seconds (the sender's progress thread pushes the data meanwhile).
  MPI_Status wait(MPI_Request& request, double timeout_seconds, const std::function<std::string()>& describe) {
    MPI_Status status{};
    bool interrupted = false;
    if (!completes_within(request, &status, timeout_seconds, &interrupted)) {
      {
        const std::lock_guard lock(mutex_);
        MPI_Cancel(&request);
        MPI_Request_free(&request);
      }
      if (interrupted) throw Interrupted{};
      const std::string what =
          ::cupipe::detail::str(describe(), ": not matched after ", timeout_seconds, " s (transfer timeout; is the peer rank alive?)");
      timed_out(what);
      CUPIPE_THROW(what);
    }
    return status;
  }

  enum class Group { world, pipeline, replicas, tensor };

  /// The tensor-parallel group as the layers see it: sums under the same mutex and collective
  /// timeout as every other collective here.
  class TensorSum final : public TensorGroup {
   public:
    explicit TensorSum(MpiCommunicator& owner) : owner_(owner) {}
    int size() const override { return owner_.topology_.tensor; }
    int rank() const override { return owner_.topology_.tensor_rank(); }
    void sum(float* data, std::size_t n) override { owner_.allreduce(data, n, MPI_FLOAT, Group::tensor); }
    void sum(double* data, std::size_t n) override { owner_.allreduce(data, n, MPI_DOUBLE, Group::tensor); }

   private:
    MpiCommunicator& owner_;
  };

  /// In-place sum over `group`, waiting at most collective_timeout().
  void allreduce(void* data, std::size_t n, MPI_Datatype type, Group group) {
    check_usable();
    MPI_Comm comm = group == Group::world ? world_ : group == Group::pipeline ? pipeline_ : group == Group::replicas ? replicas_ : tensor_;
    MPI_Request request = MPI_REQUEST_NULL;
    {
      const std::lock_guard lock(mutex_);
      CUPIPE_CHECK_MPI(MPI_Iallreduce(MPI_IN_PLACE, data, count(n), type, MPI_SUM, comm, &request));
    }
    finish_collective(request, "a sum over " + describe(group), 2 * detail::mpi_bytes(n, type));
  }

  /// In-place gather over the replicas of this stage: n values from each, in replica order.
  void allgather(void* data, std::size_t n, MPI_Datatype type) {
    check_usable();
    MPI_Request request = MPI_REQUEST_NULL;
    {
      const std::lock_guard lock(mutex_);
      CUPIPE_CHECK_MPI(MPI_Iallgather(MPI_IN_PLACE, 0, MPI_DATATYPE_NULL, data, count(n), type, replicas_, &request));
    }
    finish_collective(request, "a gather over " + describe(Group::replicas), detail::mpi_bytes(n, type) * topology_.replicas);
  }

  /// In-place reduce-scatter over the replicas of this stage: `data` holds replicas x n values; with
  /// MPI_IN_PLACE, MPI leaves this rank's summed block at the start of `data`.
  void reduce_scatter(void* data, std::size_t n, MPI_Datatype type) {
    check_usable();
    MPI_Request request = MPI_REQUEST_NULL;
    {
      const std::lock_guard lock(mutex_);
      CUPIPE_CHECK_MPI(MPI_Ireduce_scatter_block(MPI_IN_PLACE, data, count(n), type, MPI_SUM, replicas_, &request));
    }
    finish_collective(request, "a reduce-scatter over " + describe(Group::replicas),
                      detail::mpi_bytes(n, type) * topology_.replicas);
  }
  /// Starts an in-place MPI_Iallreduce over the replicas; finish_sums() completes it.
  void start_sum(void* data, std::size_t n, MPI_Datatype type) {
    start_over_replicas(n, 2 * detail::mpi_bytes(n, type), [&](MPI_Request* request) {
      CUPIPE_CHECK_MPI(MPI_Iallreduce(MPI_IN_PLACE, data, count(n), type, MPI_SUM, replicas_, request));
    });
  }
  /// Starts an in-place MPI_Ireduce_scatter_block over the replicas; finish_sums() completes it and
  /// then moves this replica's block to its place.
  template <class T>
  void start_reduce_scatter(T* data, std::size_t n, MPI_Datatype type) {
    start_over_replicas(
        n, detail::mpi_bytes(n, type) * topology_.replicas,
        [&](MPI_Request* request) {
          CUPIPE_CHECK_MPI(MPI_Ireduce_scatter_block(MPI_IN_PLACE, data, count(n), type, MPI_SUM, replicas_, request));
        },
        [this, data, n] { place_own_block(data, n); });
  }
  /// Starts an in-place MPI_Iallgather over the replicas; finish_gathers() completes it.
  void start_gather(void* data, std::size_t n, MPI_Datatype type) {
    start_over_replicas(
        n, detail::mpi_bytes(n, type) * topology_.replicas,
        [&](MPI_Request* request) {
          CUPIPE_CHECK_MPI(MPI_Iallgather(MPI_IN_PLACE, 0, MPI_DATATYPE_NULL, data, count(n), type, replicas_, request));
        },
        {}, &started_gathers_);
  }
  /// Starts a nonblocking collective of `n` values per replica over the replicas (`post` posts it,
  /// under mutex_, into the request it is given) for the progress thread to drive; finish_sums()
  /// waits for it, then runs `then` (`into` &started_gathers_: finish_gathers() waits for it).
  template <class Post>
  void start_over_replicas(std::size_t n, double bytes, Post&& post, std::function<void()> then = {},
                           std::vector<MPI_Request>* into = nullptr) {
    check_usable();
    if (n == 0) return;
    {
      const std::lock_guard lock(mutex_);
      MPI_Request request = MPI_REQUEST_NULL;
      post(&request);
      (into ? *into : started_sums_).push_back(request);
      started_bytes_[into ? 1 : 0].push_back(bytes);
      if (then) after_sums_.push_back(std::move(then));
    }
    in_flight_.notify_one();
  }
  /// Under mutex_: whether a started sum or gather, a ring's pass or an expert all-to-all is still running.
  bool sums_running() const {
    for (const std::vector<MPI_Request>* started : {&started_sums_, &started_gathers_})
      for (const MPI_Request& r : *started)
        if (r != MPI_REQUEST_NULL) return true;
    return std::any_of(ring_requests_.begin(), ring_requests_.end(), [](const MPI_Request* r) { return *r != MPI_REQUEST_NULL; });
  }

  /// The context-parallel ring: the ranks of this stage with this data-parallel replica and
  /// tensor-parallel place, in ring order.
  void make_ring() {
    const Topology& t = topology_;
    MPI_Comm ring = MPI_COMM_NULL;
    CUPIPE_CHECK_MPI(MPI_Comm_split(world_, t.ring_color(), t.context_rank(), &ring));
    CUPIPE_CHECK_MPI(MPI_Comm_set_errhandler(ring, MPI_ERRORS_RETURN));
    ring_ = std::make_unique<MpiRing>(ring, t.context, t.context_rank(), t.ring_name(), group_owner());
  }

  /// What a ring or an expert-parallel group shares with this communicator: its mutex, the
  /// progress thread's requests, the collective timeout, and the breakage a timeout causes.
  MpiGroupOwner group_owner() {
    return {mutex_, ring_requests_, in_flight_, [this] { return collective_timeout(); }, [this] { check_usable(); },
            [this](const std::string& what) {
              broken_ = true;
              timed_out("rank " + std::to_string(topology_.rank) + ": " + what);
            }};
  }

  /// The expert-parallel group (this stage's `experts` consecutive replicas at this tensor-parallel
  /// place, in place order) and the holders of this rank's experts (the same place in every group).
  void make_expert_group() {
    const Topology& t = topology_;
    MPI_Comm group = MPI_COMM_NULL, holders = MPI_COMM_NULL;
    const int groups = t.replicas / t.experts, base = t.stage() * t.tensor + t.tensor_rank();
    CUPIPE_CHECK_MPI(MPI_Comm_split(world_, base * groups + t.expert_group_index(), t.expert_rank(), &group));
    CUPIPE_CHECK_MPI(MPI_Comm_split(world_, base * t.experts + t.expert_rank(), t.expert_group_index(), &holders));
    for (MPI_Comm c : {group, holders}) CUPIPE_CHECK_MPI(MPI_Comm_set_errhandler(c, MPI_ERRORS_RETURN));
    // The overlapped F's group (paired_expert_group): the same ranks, their own communicators.
    MPI_Comm paired = MPI_COMM_NULL, paired_holders = MPI_COMM_NULL;
    CUPIPE_CHECK_MPI(MPI_Comm_dup(group, &paired));
    CUPIPE_CHECK_MPI(MPI_Comm_dup(holders, &paired_holders));
    const std::string name = "the expert-parallel group of " + std::to_string(t.experts) + " ranks (stage " +
                             std::to_string(t.stage()) + ", replicas " + std::to_string(t.expert_group_index() * t.experts) +
                             ".." + std::to_string(t.expert_group_index() * t.experts + t.experts - 1);
    experts_ = std::make_unique<MpiExpertGroup>(group, holders, t.experts, t.expert_rank(), groups, name + ")", group_owner());
    paired_experts_ = std::make_unique<MpiExpertGroup>(paired, paired_holders, t.experts, t.expert_rank(), groups,
                                                       name + "; an overlapped forward's)", group_owner());
  }

  /// Moves the block MPI left at the start of `data` to this replica's place (replica() x n).
  template <class T>
  void place_own_block(T* data, std::size_t n) const {
    const std::size_t at = std::size_t(topology_.replica()) * n;
    if (at != 0) std::copy(data, data + n, data + at);  // the blocks do not overlap
  }

  /// Waits at most collective_timeout() for a collective; past it the communicator is unusable.
  /// Waits for a collective that moves `bytes` in all (sent and received: its poll_window).
  void finish_collective(MPI_Request& request, const std::string& what, double bytes) {
    if (!completes_within(request, MPI_STATUS_IGNORE, collective_timeout(), nullptr, poll_window(bytes))) {
      broken_ = true;  // a collective cannot be cancelled: nothing more may go through these communicators
      const std::string error = ::cupipe::detail::str("rank ", topology_.rank, ": ", what, " did not finish within ",
                                            collective_timeout(), " s (collective timeout): another rank stalled or died before reaching it");
      timed_out(error);
      CUPIPE_THROW(error);
    }
  }

  std::string describe(Group group) const {
    const Topology& t = topology_;
    if (group == Group::world) return "all " + std::to_string(t.world) + " ranks";
    if (group == Group::pipeline)
      return "the " + std::to_string(t.stages) + " stages of pipeline (replica) " + std::to_string(t.replica());
    if (group == Group::tensor)
      return "the " + std::to_string(t.tensor) + " tensor-parallel ranks of stage " + std::to_string(t.stage()) +
             " of replica " + std::to_string(t.replica());
    return "the " + std::to_string(t.replicas) + " replicas of stage " + std::to_string(t.stage());
  }

  /// The progress thread: while sends are in flight, tests them (MPI_Test drives MPI's progress
  /// engine) as the waits of comm/wait.hpp poll, never holding mutex_ while it sleeps. An MPI error
  /// here is left for the owner's next call to meet and report; the thread only stops polling.
  void progress_loop() {
    std::unique_lock lock(mutex_);
    for (;;) {
      in_flight_.wait(lock, [&] { return stopping_ || ((!pending_.empty() || sums_running()) && !progress_failed_); });
      if (stopping_) return;
      lock.unlock();
      wait_until(
          [&] {
            const std::lock_guard poll(mutex_);
            if (stopping_ || broken_) return true;
            for (int i = 0; i < progress_burst && !pending_.empty() && !progress_failed_; ++i)
              pending_.reap([&](Send& s) {
                int done = 0;
                if (MPI_Test(&s.request, &done, MPI_STATUS_IGNORE) != MPI_SUCCESS) progress_failed_ = true;
                return done != 0;
              });
            for (std::vector<MPI_Request>* started : {&started_sums_, &started_gathers_})
              for (MPI_Request& r : *started) {  // a completed request becomes MPI_REQUEST_NULL
                int done = 0;
                if (r != MPI_REQUEST_NULL && MPI_Test(&r, &done, MPI_STATUS_IGNORE) != MPI_SUCCESS) progress_failed_ = true;
              }
            for (MPI_Request* r : ring_requests_) {
              int done = 0;
              if (*r != MPI_REQUEST_NULL && MPI_Test(r, &done, MPI_STATUS_IGNORE) != MPI_SUCCESS) progress_failed_ = true;
            }
            return (pending_.empty() && !sums_running()) || progress_failed_;
          },
          0);
      lock.lock();
    }
  }

  void check_usable() const {
    if (broken_)
      CUPIPE_THROW("MpiCommunicator: unusable after a collective timed out (a rank stalled or died); end the job");
  }

  Topology topology_;
  MPI_Comm world_ = MPI_COMM_NULL;
  MPI_Comm pipeline_ = MPI_COMM_NULL;
  MPI_Comm tensor_ = MPI_COMM_NULL;
  TensorSum tensor_sum_;
  MPI_Comm replicas_ = MPI_COMM_NULL;
  long long tag_limit_ = 32767;
  std::mutex mutex_;  ///< held by every MPI call of this communicator and every access to pending_
  std::condition_variable in_flight_;  ///< wakes the progress thread: a send started, or stopping_
  PendingSends<Send> pending_;
  std::vector<MPI_Request> started_sums_;  ///< under mutex_: start_sum's requests, until finish_sums
  std::vector<MPI_Request> started_gathers_;  ///< under mutex_: start_gather's requests, until finish_gathers
  std::vector<double> started_bytes_[2];      ///< under mutex_: what each started sum and gather moves (its wait's poll_window)
  std::vector<std::function<void()>> after_sums_;  ///< under mutex_: what finish_sums does after its waits
  std::vector<MPI_Request*> ring_requests_;  ///< under mutex_: a ring's pass or an expert all-to-all in flight, for the progress thread
  std::unique_ptr<MpiRing> ring_;             ///< the context-parallel ring (null: none)
  std::unique_ptr<MpiExpertGroup> experts_;  ///< the expert-parallel group (null: none)
  std::unique_ptr<MpiExpertGroup> paired_experts_;  ///< the same ranks for an overlapped F (null: none)
  std::atomic<bool> broken_ = false;  ///< a collective timed out (read by every thread)
  bool stopping_ = false;         ///< under mutex_: the destructor ends the progress thread
  bool progress_failed_ = false;  ///< under mutex_: an MPI_Test failed in the progress thread
  std::thread progress_;          ///< declared last: started once every member it uses exists
};

}  // namespace cupipe::comm
