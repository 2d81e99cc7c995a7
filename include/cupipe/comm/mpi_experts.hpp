// SPDX-License-Identifier: Apache-2.0
// MpiExpertGroup: an expert-parallel group (moe::ExpertGroup) of host ranks over MPI, made by
// comm::MpiCommunicator for `experts` consecutive data-parallel replicas of one stage (at one
// tensor-parallel place). Two communicators: the group's own, for the counts (MPI_Ialltoall), the
// tokens (MPI_Ialltoallv) and the sums of split tensors' values; and the holders', the replicas at
// the same place of every group of the stage, for the experts' gradient sums. Each collective is
// posted nonblocking and tested until it completes or the collective timeout passes, sleeping between
// polls (comm/wait.hpp); past the timeout the communicator is unusable and the error names the group.
// A started all-to-all is handed to the communicator's progress thread, which tests it while the
// rank computes (MPI moves a message only while someone calls it), until finish_all_to_all.
// Every MPI call holds the communicator's mutex (MPI_THREAD_SERIALIZED).
#pragma once

#include <mpi.h>

#include <array>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <mutex>
#include <string>
#include <vector>

#include "cupipe/comm/mpi_check.hpp"
#include "cupipe/comm/mpi_group_owner.hpp"
#include "cupipe/core/error.hpp"
#include "cupipe/moe/expert_group.hpp"

namespace cupipe::comm {

class MpiExpertGroup final : public moe::ExpertGroup {
 public:
  /// `group`: the expert-parallel group's communicator (ranks in place order), `holders`: the
  /// communicator of the replicas holding this rank's experts; the owner frees both (communicators()).
  MpiExpertGroup(MPI_Comm group, MPI_Comm holders, int size, int rank, int holders_size, std::string name, MpiGroupOwner owner)
      : group_(group), holders_(holders), size_(size), rank_(rank), holders_size_(holders_size), name_(std::move(name)),
        owner_(std::move(owner)) {}
  MpiExpertGroup(const MpiExpertGroup&) = delete;
  MpiExpertGroup& operator=(const MpiExpertGroup&) = delete;

  int size() const override { return size_; }
  int rank() const override { return rank_; }
  int holders() const override { return holders_size_; }
  const char* name() const override { return name_.c_str(); }
  std::array<MPI_Comm, 2> communicators() const { return {group_, holders_}; }

  void sum(float* data, std::size_t n) override { allreduce(data, n, MPI_FLOAT, group_, "a sum over " + name_); }
  void sum(double* data, std::size_t n) override { allreduce(data, n, MPI_DOUBLE, group_, "a sum over " + name_); }
  void sum_over_holders(float* data, std::size_t n) override { allreduce(data, n, MPI_FLOAT, holders_, holders_text()); }
  void sum_over_holders(double* data, std::size_t n) override { allreduce(data, n, MPI_DOUBLE, holders_, holders_text()); }

  void exchange_counts(const std::int64_t* send, std::int64_t* receive, std::size_t per_rank) override {
    post_and_finish("the counts' exchange before an all-to-all over " + name_, [&](MPI_Request* request) {
      CUPIPE_CHECK_MPI(MPI_Ialltoall(send, count(per_rank), MPI_INT64_T, receive, count(per_rank), MPI_INT64_T, group_, request));
    });
  }
  void start_all_to_all(const float* send, const std::int64_t* send_counts, float* receive,
                        const std::int64_t* receive_counts) override {
    start(send, send_counts, receive, receive_counts, MPI_FLOAT);
  }
  void start_all_to_all(const double* send, const std::int64_t* send_counts, double* receive,
                        const std::int64_t* receive_counts) override {
    start(send, send_counts, receive, receive_counts, MPI_DOUBLE);
  }
  void finish_all_to_all() override {
    CUPIPE_REQUIRE(in_flight_, name_, ": finish_all_to_all without an all-to-all in flight");
    const bool done = owner_.completes(&request_, 1, in_flight_bytes_);
    {
      const std::lock_guard lock(owner_.mutex);
      std::erase(owner_.progressed, &request_);
    }
    in_flight_ = false;
    if (!done) owner_.expire("an all-to-all of tokens over " + name_, "group");
  }

 private:
  static int count(std::size_t n) {
    CUPIPE_REQUIRE(n <= std::size_t(INT32_MAX), "expert parallel: ", n, " values exceed MPI's int count; use smaller microbatches");
    return int(n);
  }
  std::string holders_text() const {
    return "a sum over the " + std::to_string(holders_size_) + " replicas that hold the experts of place " +
           std::to_string(rank_) + " of " + name_;
  }

  void allreduce(void* data, std::size_t n, MPI_Datatype type, MPI_Comm comm, const std::string& what) {
    post_and_finish(
        what, [&](MPI_Request* request) {
          CUPIPE_CHECK_MPI(MPI_Iallreduce(MPI_IN_PLACE, data, count(n), type, MPI_SUM, comm, request));
        },
        2 * detail::mpi_bytes(n, type));
  }

  /// Posts MPI_Ialltoallv (its count arrays kept until it completes, as MPI requires) and hands it
  /// to the progress thread.
  template <class T>
  void start(const T* send, const std::int64_t* send_counts, T* receive, const std::int64_t* receive_counts, MPI_Datatype type) {
    owner_.check_usable();
    CUPIPE_REQUIRE(!in_flight_, name_, ": an all-to-all started while another is in flight (finish_all_to_all first)");
    for (auto* v : {&sc_, &sd_, &rc_, &rd_}) v->assign(std::size_t(size_), 0);
    std::size_t s_at = 0, r_at = 0;
    for (std::size_t q = 0; q < sc_.size(); ++q) {
      CUPIPE_REQUIRE(send_counts[q] >= 0 && receive_counts[q] >= 0, "expert parallel: a negative count in an all-to-all over ", name_);
      sc_[q] = count(std::size_t(send_counts[q]));
      rc_[q] = count(std::size_t(receive_counts[q]));
      sd_[q] = count(s_at);
      rd_[q] = count(r_at);
      s_at += std::size_t(sc_[q]);
      r_at += std::size_t(rc_[q]);
    }
    {
      const std::lock_guard lock(owner_.mutex);
      CUPIPE_CHECK_MPI(MPI_Ialltoallv(send, sc_.data(), sd_.data(), type, receive, rc_.data(), rd_.data(), type, group_, &request_));
      owner_.progressed.push_back(&request_);
    }
    in_flight_ = true;
    in_flight_bytes_ = double(s_at + r_at) * sizeof(T);
    owner_.wake.notify_one();
  }

  /// Posts a nonblocking collective (`post`, under the mutex) and waits for it under the collective
  /// timeout, polling back to back while its `bytes` move (poll_window); past the timeout the
  /// communicator is marked broken and the error names `what`.
  template <class Post>
  void post_and_finish(const std::string& what, Post&& post, double bytes = 0) {
    owner_.check_usable();
    CUPIPE_REQUIRE(!in_flight_, name_, ": a collective while an all-to-all is in flight (finish_all_to_all first)");
    MPI_Request request = MPI_REQUEST_NULL;
    {
      const std::lock_guard lock(owner_.mutex);
      post(&request);
    }
    if (!owner_.completes(&request, 1, bytes)) owner_.expire(what, "group");
  }

  MPI_Comm group_, holders_;
  int size_, rank_, holders_size_;
  std::string name_;
  MpiGroupOwner owner_;
  MPI_Request request_ = MPI_REQUEST_NULL;  ///< the all-to-all in flight (the progress thread tests it)
  std::vector<int> sc_, sd_, rc_, rd_;       ///< its counts and displacements, alive until it completes
  bool in_flight_ = false;
  double in_flight_bytes_ = 0;  ///< what the all-to-all in flight sends and receives (its wait's poll_window)
};

}  // namespace cupipe::comm
