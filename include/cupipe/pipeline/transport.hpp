// SPDX-License-Identifier: Apache-2.0
// Transport: how a stage's output reaches the worker that needs it. The executor has one path for
// every neighbour; the transport decides how: LocalTransport (workers in this process: a keyed
// mailbox per worker and the backend's transfer()) or CommTransport (workers in other processes,
// through a comm::Communicator: MPI for host ranks, NCCL for device ranks).
#pragma once

#include <cstddef>
#include <string>

#include "cupipe/comm/message.hpp"
#include "cupipe/core/tensor.hpp"

namespace cupipe::pipeline {

using comm::Flow;
using comm::MessageKey;

template <class Backend>
class Transport {
 public:
  using T = typename Backend::value_type;
  using buffer = typename Backend::template buffer<T>;

  virtual ~Transport() = default;
  /// Forgets whatever a failed step left and opens for a new step; `capacity` bounds the messages a
  /// worker holds before senders wait.
  virtual void begin_step(std::size_t capacity) = 0;
  /// Hands `data` (in worker `from`'s memory) to worker `to` under `key`. The caller may reuse
  /// `data` once this returns. Returns the bytes it moved to another worker (0 when to == from).
  virtual std::size_t send(int from, int to, const MessageKey& key, ConstViewOn<Backend, T> data) = 0;
  /// The message `key` from worker `peer`, `elements` values, in worker `at`'s memory. A wait longer
  /// than the transfer timeout is an error naming the message and the peer.
  virtual buffer receive(int at, int peer, const MessageKey& key, index_t elements) = 0;
  /// A buffer of `elements` values in worker `at`'s memory, counted as activations: a recycled
  /// message of that size where one waits, else a new one.
  virtual buffer spare(int at, index_t elements) = 0;
  /// Gives back a message worker `at` received and no longer needs, for a later message to it to
  /// reuse (LocalTransport does on the host); by default it is freed.
  virtual void recycle(int /*at*/, buffer&& message) { buffer dropped = std::move(message); }
  /// Wakes every waiter with pipeline::Aborted: a failure elsewhere ends the step.
  virtual void abort() = 0;
  /// Waits until every send of the step has been received (within the transfer timeout).
  virtual void finish_step() = 0;
};

/// The message id of predict()'s single batch, clear of any training microbatch id.
inline constexpr int predict_message_id = 1 << 19;

/// "the activation of microbatch 3 from worker 1" (or "of predict()'s batch"), for waits and errors.
inline std::string describe_message(const MessageKey& key, const char* direction, int peer) {
  const std::string which =
      key.microbatch == predict_message_id ? "predict()'s batch" : "microbatch " + std::to_string(key.microbatch);
  return std::string(key.flow == Flow::activation ? "the activation" : "the gradient") + " of " + which + " " +
         direction + " worker " + std::to_string(peer);
}

}  // namespace cupipe::pipeline
