// SPDX-License-Identifier: Apache-2.0
// LocalTransport: the workers of one process. A send copies the data into a buffer of the receiving
// worker's backend through the transfer() customization point (a plain copy on the host; on CUDA an
// event-ordered copy between the two streams, peer-to-peer across devices) and posts it in the
// receiver's mailbox; a receive takes exactly the message its action needs. On the host, a message
// the receiver is done with comes back (recycle) and the next message of its size to that worker
// is copied into it, so a steady run allocates no messages. A device buffer goes back to its pool
// instead, whose reuse fence orders the next writer after the receiver's last read
// (backend/cuda/memory_pool.cuh); a recycled one would have none.
#pragma once

#include <chrono>
#include <memory>
#include <mutex>
#include <type_traits>
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
    for (std::size_t w = 0; w < backends_.size(); ++w) {
      mailboxes_.push_back(std::make_unique<Mailbox<buffer>>());
      spares_.push_back(std::make_unique<Spares>(backends_[w] ? &backends_[w]->memory : nullptr));
    }
  }

  void begin_step(std::size_t capacity) override {
    for (auto& box : mailboxes_) box->reset(capacity);
  }

  std::size_t send(int from, int to, const MessageKey& key, ConstViewOn<Backend, T> data) override {
    buffer message = spare(to, data.numel());
    transfer(*backends_[std::size_t(from)], *backends_[std::size_t(to)], data, ViewOn<Backend, T>{message.data(), data.shape()});
    mailboxes_[std::size_t(to)]->send(key, std::move(message));
    return from == to ? 0 : std::size_t(data.numel()) * sizeof(T);
  }

  buffer spare(int at, index_t elements) override {
    buffer message = spares_[std::size_t(at)]->take(elements);
    if (message.data() == nullptr) message = backends_[std::size_t(at)]->template allocate<T>(elements, MemoryTag::activations);
    return message;
  }

  buffer receive(int at, int peer, const MessageKey& key, index_t) override {
    return mailboxes_[std::size_t(at)]->receive(key, timeout_,
                                                [&] { return "waiting for " + describe_message(key, "from", peer); });
  }

  void recycle(int at, buffer&& message) override {
    if constexpr (recycles) {
      spares_[std::size_t(at)]->give(std::move(message));
    } else {
      buffer dropped = std::move(message);  // back to its pool, which fences it
    }
  }

  void abort() override {
    for (auto& box : mailboxes_) box->abort();
  }

  void finish_step() override {}

 private:
  std::vector<Backend*> backends_;
  std::chrono::duration<double> timeout_;
  /// Host memory only: see the file comment.
  static constexpr bool recycles = host_accessible<typename Backend::space>;

  /// Messages a worker is done with, for the next messages to it. Senders and the receiver share it.
  /// A spare does not count as activations in the worker's tracker while it waits (a freed pool
  /// block does not either), so measured peaks are the same as without recycling.
  class Spares {
   public:
    static constexpr std::size_t most = 256;  // beyond: freed (sizes a run no longer sends)
    explicit Spares(MemoryTracker* tracker) : tracker_(tracker) {}
    Spares(const Spares&) = delete;
    Spares& operator=(const Spares&) = delete;
    ~Spares() {
      for (const buffer& b : held_) count(b);  // each buffer's destructor takes its bytes off again
    }
    /// A spare of exactly `elements` values (empty: none).
    buffer take(index_t elements) {
      if constexpr (recycles) {
        std::lock_guard lock(mutex_);
        for (std::size_t i = held_.size(); i-- > 0;)
          if (held_[i].size() == elements) {
            buffer out = std::move(held_[i]);
            held_[i] = std::move(held_.back());
            held_.pop_back();
            count(out);
            return out;
          }
      }
      return buffer{};
    }
    void give(buffer message) {
      std::lock_guard lock(mutex_);
      if (tracker_ == nullptr || held_.size() >= most) return;  // freed as `message` goes
      tracker_->release(MemoryTag::activations, bytes(message));
      held_.push_back(std::move(message));
    }

   private:
    static std::size_t bytes(const buffer& b) { return std::size_t(b.size()) * sizeof(T); }
    void count(const buffer& b) {
      if (tracker_) tracker_->allocate(MemoryTag::activations, bytes(b));
    }

    MemoryTracker* tracker_;
    std::mutex mutex_;
    std::vector<buffer> held_;
  };

  std::vector<std::unique_ptr<Mailbox<buffer>>> mailboxes_;
  std::vector<std::unique_ptr<Spares>> spares_;
};

}  // namespace cupipe::pipeline
