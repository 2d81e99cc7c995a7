// SPDX-License-Identifier: Apache-2.0
// HandOverTransport: the in-process transport of a pipeline whose workers have different backends
// (backend::PerWorker). As LocalTransport, a send allocates the message in the receiver's memory and
// posts it in the receiver's mailbox, and a receive takes exactly the message its action needs; the
// copy is a hand-over (pipeline/hand_over.hpp), which converts the sender's storage type into the
// receiver's. Worker indices are compile-time here: each mailbox holds its own worker's buffers.
#pragma once

#include <chrono>
#include <cstddef>
#include <memory>
#include <tuple>
#include <utility>

#include "cupipe/core/memory.hpp"
#include "cupipe/pipeline/hand_over.hpp"
#include "cupipe/pipeline/mailbox.hpp"
#include "cupipe/pipeline/transport.hpp"

namespace cupipe::pipeline {

template <class Workers, int N>
class HandOverTransport {
  template <int W>
  using backend_at = typename Workers::template backend<W>;

 public:
  /// Worker W's message buffers: its own storage type, in its own memory.
  template <int W>
  using buffer = typename backend_at<W>::template buffer<typename backend_at<W>::value_type>;

  HandOverTransport(const Workers& workers, double timeout_seconds) : workers_(workers), timeout_(timeout_seconds) {}

  void begin_step(std::size_t capacity) {
    each([&](auto& box) { box.reset(capacity); });
  }

  /// Hands `data` (worker From's storage, in its memory) to worker To as To's storage type.
  /// Returns the bytes sent to another worker (0 when To == From).
  template <int From, int To, class U>
  std::size_t send(const MessageKey& key, TensorView<const U, typename backend_at<From>::space> data) {
    backend_at<To>& target = *workers_.template get<To>();
    using V = typename backend_at<To>::value_type;
    buffer<To> message = target.template allocate<V>(data.numel(), MemoryTag::activations);
    hand_over<backend_at<From>, backend_at<To>, U, V>(*workers_.template get<From>(), target, data,
                                                      TensorView<V, typename backend_at<To>::space>{message.data(), data.shape()});
    std::get<std::size_t(To)>(mailboxes_).send(key, std::move(message));
    return From == To ? 0 : std::size_t(data.numel()) * sizeof(U);
  }

  /// The message `key` from worker `peer`, in worker At's memory.
  template <int At>
  buffer<At> receive(int peer, const MessageKey& key, index_t) {
    return std::get<std::size_t(At)>(mailboxes_).receive(
        key, timeout_, [&] { return "waiting for " + describe_message(key, "from", peer); });
  }

  void abort() {
    each([](auto& box) { box.abort(); });
  }
  void finish_step() {}

 private:
  template <std::size_t... W>
  static auto boxes(std::index_sequence<W...>) -> std::tuple<Mailbox<buffer<int(W)>>...>;

  template <class F>
  void each(F&& f) {
    std::apply([&](auto&... box) { (f(box), ...); }, mailboxes_);
  }

  const Workers& workers_;
  std::chrono::duration<double> timeout_;
  decltype(boxes(std::make_index_sequence<std::size_t(N)>())) mailboxes_;
};

}  // namespace cupipe::pipeline
