// SPDX-License-Identifier: Apache-2.0
// TensorGroup: the ranks that split one stage's layers by tensor parallelism (Megatron's scheme), as
// the tensor-parallel layers see them: a size, this rank's place, and an in-place sum. A backend
// context carries a pointer to one (Host::tensor_group, Cuda::tensor_group); the layers in
// layers/tensor_parallel.hpp sum through it (tensor_group_sum). comm::MpiCommunicator provides one
// for host ranks and comm::NcclCommunicator one for device ranks (Communicator::tensor_group()).
#pragma once

#include <cstddef>

namespace cupipe {

class TensorGroup {
 public:
  virtual ~TensorGroup() = default;
  /// Ranks in the group, and this rank's place in it (0 .. size() - 1).
  virtual int size() const = 0;
  virtual int rank() const = 0;
  /// In place, host memory: element-wise sum over the group's ranks. Every rank of the group calls
  /// it with the same count, in the same order.
  virtual void sum(float* data, std::size_t count) = 0;
  virtual void sum(double* data, std::size_t count) = 0;
  /// Whether sum() also takes device memory (of this rank's device, its kernels synchronised):
  /// an NCCL group sums device tensors where they are; others take host memory only.
  virtual bool device_memory() const { return false; }
};

}  // namespace cupipe
