// SPDX-License-Identifier: Apache-2.0
// The point-to-point channels of an NcclCommunicator (comm/nccl.hpp). NCCL matches point-to-point
// messages in issue order, without tags, and a send occupies its stream until the peer posts the
// matching receive; so every directed channel between neighbouring stages (sender -> receiver,
// activations or gradients) is a two-rank communicator of its own with a stream of its own, and a
// pending send holds up only later sends on the same channel. The stages form a ring (interleaved
// schedules send from the last stage to the first); each link of the ring carries four channels.
// Built only with CUPIPE_HAS_NCCL.
#pragma once

#include <nccl.h>

#include "cupipe/backend/cuda/stream.cuh"
#include "cupipe/comm/message.hpp"

namespace cupipe::comm::detail {

/// One direction of one flow between two neighbouring stages: a two-rank communicator in which
/// this rank only sends or only receives, with its own stream.
struct NcclChannel {
  ncclComm_t comm = nullptr;
  int peer = 0;  ///< the other rank within `comm`
  backend::cuda::Stream stream;
  backend::cuda::Event received{false};
};

/// Links of a ring of `stages` stages: link l joins stages l and (l + 1) % stages; two stages have
/// one link, one stage none.
inline int ring_links(int stages) { return stages == 1 ? 0 : stages == 2 ? 1 : stages; }

/// Channel c (0 .. 3) of the link between stages a and b: a -> b for c < 2, else b -> a; each for
/// activations (even c) and for gradients (odd c).
struct LinkChannel {
  int sender, receiver;
  Flow flow;
};
inline LinkChannel link_channel(int a, int b, int c) {
  return {c < 2 ? a : b, c < 2 ? b : a, c % 2 == 0 ? Flow::activation : Flow::gradient};
}

}  // namespace cupipe::comm::detail
