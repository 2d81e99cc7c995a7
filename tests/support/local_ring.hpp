// SPDX-License-Identifier: Apache-2.0
// Test support for context parallelism: LocalRing, a ring of threads in one process
// (cp::ContextGroup), for tests that run a ring's ranks side by side without MPI or NCCL. A pass
// posts the rank's buffers; finish_pass meets the other ranks at a barrier (under a deadline, never
// spinning: LocalExperts's), copies the previous rank's send into this rank's receive, and meets
// them again. Host memory with std::memcpy, or device memory with a given copy (then
// device_memory() is true, as NCCL's ring: the CUDA tests pass one that synchronises the device
// before and after cudaMemcpy, so that a pass sees the kernels that wrote its send).
#pragma once

#include <cstddef>
#include <stdexcept>
#include <vector>

#include "cupipe/cp/context_group.hpp"
#include "local_expert_group.hpp"

namespace cupipe::testing {

/// What the ranks of one ring share.
struct LocalRing {
  explicit LocalRing(int size, LocalExperts::Copy copy = {}) : meeting(size, std::move(copy)), bytes(std::size_t(size)) {}
  LocalExperts meeting;            ///< the barrier, each rank's buffers and the copy
  std::vector<std::size_t> bytes;  ///< each rank's pass
  int passes = 0;                  ///< rank 0's

  class Rank final : public cp::ContextGroup {
   public:
    Rank(LocalRing& ring, int rank) : ring_(ring), rank_(rank) {}
    int size() const override { return ring_.meeting.size(); }
    int rank() const override { return rank_; }
    bool device_memory() const override { return ring_.meeting.device_memory(); }
    void start_pass(const void* send, void* receive, std::size_t n, void*) override {
      const auto r = std::size_t(rank_);
      ring_.meeting.send_[r] = send;
      ring_.meeting.receive_[r] = receive;
      ring_.bytes[r] = n;
    }
    void finish_pass() override {
      ring_.meeting.barrier("ring pass");
      const auto r = std::size_t(rank_), previous = std::size_t((rank_ + size() - 1) % size());
      if (ring_.bytes[previous] != ring_.bytes[r]) throw std::runtime_error("local ring: passes of different sizes");
      ring_.meeting.copy(ring_.meeting.receive_[r], ring_.meeting.send_[previous], ring_.bytes[r]);
      if (rank_ == 0) ++ring_.passes;
      ring_.meeting.barrier("ring pass, read");
    }
    void sum(double*, std::size_t) override { throw std::runtime_error("local ring: no sums"); }

   private:
    LocalRing& ring_;
    int rank_;
  };
};

}  // namespace cupipe::testing
