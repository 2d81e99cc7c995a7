// SPDX-License-Identifier: Apache-2.0
// BackendTransfer<B, T>: one all-to-all of an expert-parallel group (moe::Transfer) on a backend's
// memory. Where the group takes that memory as it is (the host backend, or a group whose
// device_memory() is true: NCCL's) the buffers go to it directly, a device's after its context's
// queued work (the group runs on streams of its own, which do not see that work). Otherwise (a device
// context over a host group: MPI's) the rows to send are downloaded, the group moves host copies, and
// finish() uploads what arrived, as tensor_group_sum stages a tensor-parallel sum. The staging buffers
// outlive the transfer, which an exception finishes before they are freed.
#pragma once

#include <cstdint>
#include <numeric>
#include <span>
#include <vector>

#include "cupipe/core/tensor.hpp"
#include "cupipe/moe/exchange.hpp"
#include "cupipe/moe/expert_group.hpp"
#include "cupipe/moe/tally.hpp"

namespace cupipe::moe {

template <class B, class T>
class BackendTransfer {
 public:
  BackendTransfer(B& be, ExpertGroup& group, Tally* tally) : be_(be), group_(group), transfer_(group, tally) {}
  BackendTransfer(const BackendTransfer&) = delete;
  BackendTransfer& operator=(const BackendTransfer&) = delete;

  /// Starts the all-to-all of `send` (send_counts[q] values for each rank q, in rank order, in the
  /// backend's memory) into `receive` (receive_counts[q] from each rank q): see moe::Transfer.
  void start(const T* send, const std::vector<std::int64_t>& send_counts, T* receive,
             const std::vector<std::int64_t>& receive_counts) {
    if constexpr (!host_accessible<typename B::space>) {
      if (!group_.device_memory()) {  // a host group: staged
        send_.resize(std::size_t(total(send_counts)));
        receive_.resize(std::size_t(total(receive_counts)));
        be_.download(send, std::span<T>(send_));
        device_receive_ = receive;
        return transfer_.start(send_.data(), send_counts, receive_.data(), receive_counts);
      }
      be_.synchronize();  // the group's streams do not wait for this context's
    }
    transfer_.start(send, send_counts, receive, receive_counts);
  }
  /// Waits for the all-to-all (moe::Transfer::finish); a staged one's rows then go to the device.
  void finish() {
    transfer_.finish();
    if constexpr (!host_accessible<typename B::space>)
      if (device_receive_ != nullptr && !receive_.empty()) be_.upload(std::span<const T>(receive_), device_receive_);
  }

 private:
  static std::int64_t total(const std::vector<std::int64_t>& counts) {
    return std::accumulate(counts.begin(), counts.end(), std::int64_t(0));
  }

  B& be_;
  ExpertGroup& group_;
  std::vector<T> send_, receive_;  ///< host copies, staged (declared before the transfer, which reads them)
  T* device_receive_ = nullptr;    ///< staged: where the received rows go on finish()
  Transfer transfer_;
};

}  // namespace cupipe::moe
