// SPDX-License-Identifier: Apache-2.0
// ExpertGroup: the ranks of one expert-parallel group as a mixture-of-experts layer sees them
// (GShard's and Megatron-LM's expert parallelism). The group is `size()` consecutive data-parallel
// replicas of one stage; each holds E / size() of every MoE layer's experts (rank t experts
// [t E / size, (t + 1) E / size)) and its own tokens, and the tokens travel to their experts' rank
// and back with two all-to-alls whose counts are exchanged first (layers/moe.hpp, moe/exchange.hpp).
//
// As a TensorGroup it is the group over which the experts' tensors are split
// (TensorSplit::expert_rows): rank() picks a rank's part of the whole model's initialisation and
// checkpoint, and sum() (over the group) adds up the split tensors' squares for the global gradient
// norm and assembles the whole model's values. The replicas that hold the same experts (the same
// place in different groups: holders()) sum those experts' gradients with sum_over_holders(); every
// other tensor sums over all the stage's replicas, as under plain data parallelism.
// A backend context carries a pointer to one (Host::expert_group); comm::MpiCommunicator provides
// one for host ranks (Communicator::expert_group()).
#pragma once

#include <cstddef>
#include <cstdint>

#include "cupipe/core/tensor_group.hpp"

namespace cupipe::moe {

class ExpertGroup : public TensorGroup {
 public:
  /// Replicas of this stage that hold this rank's experts (itself included): the stage's replicas
  /// over size().
  virtual int holders() const = 0;
  /// In place, host memory: element-wise sum over the holders of this rank's experts.
  virtual void sum_over_holders(float* data, std::size_t count) = 0;
  virtual void sum_over_holders(double* data, std::size_t count) = 0;
  /// Every rank gives `per_rank` values for each rank of the group (`send`, size() x per_rank, in
  /// rank order) and receives each rank's values for it (`receive`, size() x per_rank, in rank
  /// order): the counts that precede an all-to-all. Under the collective timeout, naming the group.
  virtual void exchange_counts(const std::int64_t* send, std::int64_t* receive, std::size_t per_rank) = 0;
  /// The all-to-all, started: `send` holds consecutive blocks of send_counts[q] values for each
  /// rank q, in rank order; `receive` gets receive_counts[q] values from each rank q, in rank order.
  /// Each rank's receive_counts[q] must be rank q's send_counts[this rank] (exchange them first); the
  /// counts are read at the call. It returns at once: the communicator moves the data while the
  /// caller computes, and finish_all_to_all() waits for it under the collective timeout, naming the
  /// group. `send` and `receive` stay untouched until then. One at a time; every rank of the group
  /// starts and finishes the same ones in the same order.
  virtual void start_all_to_all(const float* send, const std::int64_t* send_counts, float* receive,
                                const std::int64_t* receive_counts) = 0;
  virtual void start_all_to_all(const double* send, const std::int64_t* send_counts, double* receive,
                                const std::int64_t* receive_counts) = 0;
  virtual void finish_all_to_all() = 0;
  /// "the expert-parallel group of 2 ranks (stage 0, ...)", for errors.
  virtual const char* name() const = 0;
};

/// The expert-parallel group on a backend context: null without one (or on a backend that has none).
template <class B>
ExpertGroup* expert_group_of(const B& be) {
  if constexpr (requires { be.expert_group; }) return be.expert_group;
  else return nullptr;
}

}  // namespace cupipe::moe
