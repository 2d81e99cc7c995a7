// SPDX-License-Identifier: Apache-2.0
// LocalTransport: the workers of one process. A send copies the data into a buffer of the receiving
// worker's backend through the transfer() customization point (a plain copy on the host; on CUDA an
// event-ordered copy between the two streams, peer-to-peer across devices) and posts it in the
// receiver's mailbox; a receive takes exactly the message its action needs.
#pragma once

#include <chrono>
#include <memory>
#include <vector>

#include "cupipe/core/memory.hpp"
#include "cupipe/pipeline/mailbox.hpp"
#include "cupipe/pipeline/transport.hpp"

namespace cupipe::pipeline {

template <class Backend>
class LocalTransport final : public Transport<Backend> {
 public:
  using typename Transport<Backend>::T;
  using typename Transport<Backend>::buffer;

  /// `backends[w]` is worker w's context; null for workers of other processes.
  LocalTransport(std::vector<Backend*> backends, double timeout_seconds)
      : backends_(std::move(backends)), timeout_(timeout_seconds) {
    for (std::size_t w = 0; w < backends_.size(); ++w) mailboxes_.push_back(std::make_unique<Mailbox<buffer>>());
  }

  void begin_step(std::size_t capacity) override {
    for (auto& box : mailboxes_) box->reset(capacity);
  }

  void send(int from, int to, const MessageKey& key, ConstViewOn<Backend, T> data) override {
    Backend& target = *backends_[std::size_t(to)];
    buffer message = target.template allocate<T>(data.numel(), MemoryTag::activations);
    transfer(*backends_[std::size_t(from)], target, data, ViewOn<Backend, T>{message.data(), data.shape()});
    mailboxes_[std::size_t(to)]->send(key, std::move(message));
  }

  buffer receive(int at, int peer, const MessageKey& key, index_t) override {
    return mailboxes_[std::size_t(at)]->receive(key, timeout_,
                                                [&] { return "waiting for " + describe_message(key, "from", peer); });
  }

  void abort() override {
    for (auto& box : mailboxes_) box->abort();
  }

  void finish_step() override {}

 private:
  std::vector<Backend*> backends_;
  std::chrono::duration<double> timeout_;
  std::vector<std::unique_ptr<Mailbox<buffer>>> mailboxes_;
};

}  // namespace cupipe::pipeline
