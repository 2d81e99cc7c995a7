// SPDX-License-Identifier: Apache-2.0
// The pipeline's side of context parallelism (cp/): the communicator's ring, checked against the
// model and the options, handed to every worker's backend context (with the tensor-parallel group),
// and how a batch's rows split into samples on this rank. A ring's ranks count among the stage's
// replicas (comm/topology.hpp), so the gradient sums, the loss normalisers and ZeRO's shards already
// run over them; what changes is that a sample (a sequence) is T / cp rows here.
#pragma once

#include <type_traits>

#include "cupipe/comm/communicator.hpp"
#include "cupipe/core/error.hpp"
#include "cupipe/core/shape.hpp"
#include "cupipe/core/tensor.hpp"
#include "cupipe/core/tensor_group.hpp"
#include "cupipe/cp/context_group.hpp"
#include "cupipe/moe/expert_group.hpp"
#include "cupipe/pipeline/options.hpp"

namespace cupipe::pipeline {

/// How a step's batch splits: into `parts` microbatches of whole samples, a sample being
/// `rows_per_sample` rows on this rank (a sequence's tokens, or its share of them on a ring).
struct BatchSplit {
  int parts = 1;
  index_t rows_per_sample = 1;
};

/// The communicator's context-parallel ring for a pipeline on `Backend` whose samples are
/// `rows_per_sample` rows, or null without one (or with a ring of 1). Refused: a backend without a
/// ring, a ring of the other memory (host rings for host backends, device rings for CUDA), samples that do not cut into 2 cp chunks, packed sequences, and
/// check_equivalence (its unpipelined model would see only this rank's share of each sequence).
template <class Backend>
cp::ContextGroup* context_ring(comm::Communicator* comm, const PipelineOptions& o, index_t rows_per_sample) {
  cp::ContextGroup* ring = comm ? comm->context_group() : nullptr;
  if (!ring || ring->size() == 1) return nullptr;
  const int cp = ring->size();
  if constexpr (!requires(Backend& be) { be.context_group; }) {
    CUPIPE_THROW("Pipeline: context parallelism (rings of ", cp, " ranks) runs on the host and CUDA backends; this backend "
                 "has no ring");
  } else if (std::is_same_v<typename Backend::space, DeviceSpace> != ring->device_memory()) {
    if (ring->device_memory())
      CUPIPE_THROW("Pipeline: context parallelism on the host backend passes host memory, but the communicator's ring "
                   "passes device memory (NCCL's); use MpiCommunicator");
    CUPIPE_THROW("Pipeline: context parallelism on a device backend passes keys and values in device memory, but the "
                 "communicator's ring passes host memory (MPI's); use NcclCommunicator");
  }
  if (rows_per_sample % (2 * cp) != 0)
    CUPIPE_THROW("Pipeline: context parallelism over rings of ", cp, " ranks cuts each sequence into ", 2 * cp,
                 " equal chunks, but the model's samples are ", rows_per_sample, " row(s)",
                 rows_per_sample == 1 ? " (not sequences)" : "");
  if (o.packed_sequences)
    CUPIPE_THROW("Pipeline: packed sequences with context parallelism are not supported; leave packed_sequences off or "
                 "the ring out");
  if (o.check_equivalence)
    CUPIPE_THROW("Pipeline: check_equivalence runs the unpipelined model on this rank's rows, which under context "
                 "parallelism are a share of each sequence; leave it off");
  return ring;
}

/// Gives every worker's backend context the groups its layers use: the split group (when there is
/// one: the tensor-parallel group, or the expert-parallel one, which the mixture-of-experts layers
/// take), the context-parallel ring (null: none), and with an expert-parallel group the one an
/// overlapped F uses while it takes turns with its B (`paired`, null: none; paired_turns.hpp).
template <class Workers>
void join_groups(Workers& workers, TensorGroup* split, cp::ContextGroup* ring, moe::ExpertGroup* paired = nullptr) {
  auto* experts = dynamic_cast<moe::ExpertGroup*>(split);
  workers.for_each([&](int, auto& be) {
    if constexpr (requires { be.tensor_group; })
      if (split && !experts) be.tensor_group = split;
    if constexpr (requires { be.expert_group; }) be.expert_group = experts;
    if constexpr (requires { be.paired_expert_group; }) be.paired_expert_group = experts ? paired : nullptr;
    if constexpr (requires { be.context_group; }) be.context_group = ring;
  });
}

}  // namespace cupipe::pipeline
