// SPDX-License-Identifier: Apache-2.0
// MpiRing: a context-parallel ring (cp::ContextGroup) of host ranks over MPI, made by
// comm::MpiCommunicator for the ranks of one stage that share a data-parallel replica and a
// tensor-parallel place. A pass posts MPI_Irecv from the previous rank and MPI_Isend to the next,
// and returns; the communicator's progress thread tests the two requests while the rank computes
// (MPI moves a large message only while someone calls it), and finish_pass waits for them under
// the collective timeout, sleeping between polls (comm/wait.hpp). Every MPI call holds the
// communicator's mutex (MPI_THREAD_SERIALIZED), as every other call of the communicator does.
#pragma once

#include <mpi.h>

#include <algorithm>
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
#include "cupipe/cp/context_group.hpp"

namespace cupipe::comm {

class MpiRing final : public cp::ContextGroup {
 public:
  /// `comm`: the ring's communicator, ranks 0 .. size - 1 in ring order; the owner frees it
  /// (communicator()). `name` describes the ring in errors.
  MpiRing(MPI_Comm comm, int size, int rank, std::string name, MpiGroupOwner owner)
      : comm_(comm), size_(size), rank_(rank), name_(std::move(name)), owner_(std::move(owner)) {}
  MpiRing(const MpiRing&) = delete;
  MpiRing& operator=(const MpiRing&) = delete;

  int size() const override { return size_; }
  int rank() const override { return rank_; }
  MPI_Comm communicator() const { return comm_; }

  void start_pass(const void* send, void* receive, std::size_t bytes, void* /*stream: host memory*/) override {
    owner_.check_usable();
    CUPIPE_REQUIRE(!in_flight_, name_, ": a pass started while another is in flight (finish_pass first)");
    CUPIPE_REQUIRE(bytes <= std::size_t(INT32_MAX), name_, ": a pass of ", bytes, " bytes exceeds 2 GiB; use smaller microbatches");
    const int next = (rank_ + 1) % size_, previous = (rank_ + size_ - 1) % size_;
    {
      const std::lock_guard lock(owner_.mutex);
      CUPIPE_CHECK_MPI(MPI_Irecv(receive, int(bytes), MPI_BYTE, previous, 0, comm_, &requests_[0]));
      CUPIPE_CHECK_MPI(MPI_Isend(send, int(bytes), MPI_BYTE, next, 0, comm_, &requests_[1]));
      track();
    }
    in_flight_ = true;
    in_flight_bytes_ = 2.0 * double(bytes);  // sent and received
    owner_.wake.notify_one();
  }
  void finish_pass() override {
    CUPIPE_REQUIRE(in_flight_, name_, ": finish_pass without a pass in flight");
    finish("a pass of keys and values round " + name_);
  }
  void sum(double* data, std::size_t count) override {
    owner_.check_usable();
    CUPIPE_REQUIRE(!in_flight_ && count <= std::size_t(INT32_MAX), name_, ": a sum while a pass is in flight, or of too many values");
    {
      const std::lock_guard lock(owner_.mutex);
      CUPIPE_CHECK_MPI(MPI_Iallreduce(MPI_IN_PLACE, data, int(count), MPI_DOUBLE, MPI_SUM, comm_, &requests_[0]));
      requests_[1] = MPI_REQUEST_NULL;
      track();
    }
    in_flight_ = true;
    in_flight_bytes_ = 2.0 * double(count) * sizeof(double);
    owner_.wake.notify_one();
    finish("a sum over " + name_);
  }

 private:
  /// Under the mutex: hands the requests to the progress thread.
  void track() {
    for (MPI_Request& r : requests_) owner_.progressed.push_back(&r);
  }
  /// Waits for both requests under the collective timeout, then takes them back from the progress
  /// thread; past the timeout the communicator is unusable (a posted receive cannot be relied on to
  /// cancel) and the error names the ring.
  void finish(const std::string& what) {
    const bool done = owner_.completes(requests_.data(), 2, in_flight_bytes_);
    {
      const std::lock_guard lock(owner_.mutex);
      std::erase_if(owner_.progressed, [&](MPI_Request* r) { return r == &requests_[0] || r == &requests_[1]; });
    }
    in_flight_ = false;
    if (!done) owner_.expire(what, "ring");
  }

  MPI_Comm comm_;
  int size_, rank_;
  std::string name_;
  MpiGroupOwner owner_;
  std::array<MPI_Request, 2> requests_{MPI_REQUEST_NULL, MPI_REQUEST_NULL};
  bool in_flight_ = false;
  double in_flight_bytes_ = 0;  ///< what the requests in flight move (their wait's poll_window)
};

}  // namespace cupipe::comm
