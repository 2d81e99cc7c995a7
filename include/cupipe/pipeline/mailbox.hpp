// SPDX-License-Identifier: Apache-2.0
// Mailbox: the channel into one pipeline worker. Senders deposit messages under a key (what, for
// which virtual stage, which microbatch); the worker takes exactly the message its next action needs,
// so the order in which neighbours produce never has to match the order in which it consumes.
// Capacity is bounded; abort() wakes every waiter so that a failure anywhere stops everyone.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <map>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <tuple>
#include <utility>

#include "cupipe/comm/message.hpp"
#include "cupipe/core/error.hpp"

namespace cupipe::pipeline {

using comm::Flow;
using comm::MessageKey;

/// Thrown inside a worker whose wait was cut short because another worker failed.
struct Aborted : std::exception {
  const char* what() const noexcept override { return "pipeline step aborted by a failure elsewhere"; }
};

template <class Message>
class Mailbox {
 public:
  explicit Mailbox(std::size_t capacity = 1) : capacity_(capacity == 0 ? 1 : capacity) {}

  /// Blocks while the mailbox is full; throws Aborted if the step was aborted.
  void send(const MessageKey& key, Message message) {
    std::unique_lock lock(mutex_);
    space_.wait(lock, [&] { return aborted_ || messages_.size() < capacity_; });
    if (aborted_) throw Aborted{};
    if (!messages_.emplace(key, std::move(message)).second)
      CUPIPE_THROW("mailbox: a second message for virtual stage ", key.virtual_stage, ", microbatch ", key.microbatch);
    arrived_.notify_all();
  }

  /// Blocks until the message for `key` arrives. With a positive timeout, a wait longer than that is
  /// an error naming what was awaited; `describe` names the action and the peer for that message.
  template <class Describe>
  Message receive(const MessageKey& key, std::chrono::duration<double> timeout, Describe&& describe) {
    std::unique_lock lock(mutex_);
    auto ready = [&] { return aborted_ || messages_.count(key) != 0; };
    if (timeout.count() > 0) {
      if (!arrived_.wait_for(lock, timeout, ready))
        CUPIPE_THROW(describe(), ": no message after ", timeout.count(), " s (transfer timeout)");
    } else {
      arrived_.wait(lock, ready);
    }
    if (aborted_) throw Aborted{};
    auto node = messages_.extract(key);
    space_.notify_all();
    return std::move(node.mapped());
  }

  void abort() {
    std::lock_guard lock(mutex_);
    aborted_ = true;
    arrived_.notify_all();
    space_.notify_all();
  }

  /// Empties the mailbox and clears the abort, ready for the next step.
  void reset(std::size_t capacity) {
    std::lock_guard lock(mutex_);
    messages_.clear();
    aborted_ = false;
    capacity_ = capacity == 0 ? 1 : capacity;
  }


 private:
  std::mutex mutex_;
  std::condition_variable arrived_;
  std::condition_variable space_;
  std::map<MessageKey, Message> messages_;
  std::size_t capacity_;
  bool aborted_ = false;
};

}  // namespace cupipe::pipeline
