// SPDX-License-Identifier: Apache-2.0
// ZeRO-2 (PipelineOptions::zero = 2; Rajbhandari et al., 2020, stage 2): each data-parallel replica
// keeps its shard of every stage's summed gradients, not the whole of them. Within a step a stage's
// backward accumulates into the whole buffer as usual (StageState::gradients() allocates it, zeroed,
// at the step's first gradient action); once the stage's gradients are complete the buffer is
// reduce-scattered over the replicas, this replica's block is added into its shard
// (StageState::grad_shard) and the buffer is released. Between steps, and through the update, a
// replica holds 1/R of the gradients.
//
// The reduce-scatter starts inside the step where the communicator can (start_scatter, from
// GradientSync::after_action: as soon as the stage's last B or W is done, while the worker goes on
// with its other stages), else at the update (scatter_gradients). A stage that holds a copy of a
// tied tensor waits for the update: its copy's gradient is first summed with the other copy's
// (sum_tied_gradients), which needs both whole.
#pragma once

#include <cstddef>
#include <type_traits>

#include "cupipe/comm/communicator.hpp"
#include "cupipe/core/tensor.hpp"
#include "cupipe/layers/sequential.hpp"
#include "cupipe/pipeline/optimizer_step.hpp"

namespace cupipe::pipeline {

/// Whether a stage whose parameters are [offset, offset + count) of the whole model holds a copy of
/// `tied` (which then keeps its whole gradients until the update's tied sum).
constexpr bool holds_tied_copy(const TiedCopies& tied, index_t offset, index_t count) {
  const auto holds = [&](index_t at) { return at < offset + count && at + tied.count > offset; };
  return tied.count > 0 && (holds(tied.first) || holds(tied.second));
}

/// ZeRO-2, once this replica's block of the stage's whole gradient buffer holds its sum over the
/// replicas: the block is added into the stage's shard and the whole buffer released.
template <class St>
void keep_own_block(St& st) {
  using B = std::remove_reference_t<decltype(*st.be)>;
  using G = grad_t<B>;
  const index_t n = st.shard.size();
  if (n > 0)
    axpy(*st.be, G(1), ConstViewOn<B, G>{st.grads.data() + st.shard.begin, Shape{n}}, ViewOn<B, G>{st.grad_shard.data(), Shape{n}});
  st.be->synchronize();  // the buffer may go back to the pool only once the kernel has read it
  st.grads = typename St::grad_buffer();
}

/// ZeRO-2: starts the reduce-scatter of the stage's whole gradient buffer (replicas x stride
/// values, in the backend's memory, which `comm` reads: comm.starts_reduce_scatters()); after
/// comm.finish_sums(), keep_own_block.
template <class St>
void start_scatter(comm::Communicator& comm, St& st) {
  st.be->synchronize();
  comm.start_reduce_scatter_over_replicas(st.gradients(), std::size_t(st.shard.stride));
}

/// ZeRO-2: reduce-scatters the stage's whole gradient buffer over the replicas now, in place where
/// `comm` reads the backend's memory, else through host memory (ZeRO-1's
/// reduce_scatter_over_replicas), then keep_own_block. Nothing to do where the buffer is not held
/// (no gradient since the last).
template <class St>
void scatter_gradients(comm::Communicator& comm, St& st) {
  if (!st.holds_gradients()) return;
  if (comm::reads_backend_memory<std::remove_reference_t<decltype(*st.be)>>(comm)) {
    st.be->synchronize();
    comm.reduce_scatter_over_replicas(st.grads.data(), std::size_t(st.shard.stride));
  } else {
    reduce_scatter_over_replicas(comm, st);
  }
  keep_own_block(st);
}

}  // namespace cupipe::pipeline
