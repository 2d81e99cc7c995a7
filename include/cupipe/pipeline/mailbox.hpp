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
#include <vector>

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

  /// Blocks while the mailbox is full; throws Aborted if the step was aborted. Wakes the worker only
  /// when it waits for this very message, after the lock is released (so it does not wake into a
  /// held mutex). A map node its worker took a message out of is reused: no allocation once a step
  /// has run.
  void send(const MessageKey& key, Message message) {
    bool wake = false;
    {
      std::unique_lock lock(mutex_);
      if (!aborted_ && messages_.size() >= capacity_) {
        ++senders_waiting_;
        space_.wait(lock, [&] { return aborted_ || messages_.size() < capacity_; });
        --senders_waiting_;
      }
      if (aborted_) throw Aborted{};
      bool inserted = false;
      if (!spare_.empty()) {
        auto node = std::move(spare_.back());
        spare_.pop_back();
        node.key() = key;
        node.mapped() = std::move(message);
        inserted = messages_.insert(std::move(node)).inserted;
      } else {
        inserted = messages_.emplace(key, std::move(message)).second;
      }
      if (!inserted)
        CUPIPE_THROW("mailbox: a second message for virtual stage ", key.virtual_stage, ", microbatch ", key.microbatch);
      wake = waiting_ && awaited_ == key;
    }
    if (wake) arrived_.notify_one();
  }

  /// Blocks until the message for `key` arrives. With a positive timeout, a wait longer than that is
  /// an error naming what was awaited; `describe` names the action and the peer for that message.
  /// One receiver: the mailbox's worker.
  template <class Describe>
  Message receive(const MessageKey& key, std::chrono::duration<double> timeout, Describe&& describe) {
    bool wake = false;
    Message out;
    {
      std::unique_lock lock(mutex_);
      auto ready = [&] { return aborted_ || messages_.count(key) != 0; };
      if (!ready()) {
        waiting_ = true;
        awaited_ = key;
        bool arrived = true;
        if (timeout.count() > 0) arrived = arrived_.wait_for(lock, timeout, ready);
        else arrived_.wait(lock, ready);
        waiting_ = false;
        if (!arrived) CUPIPE_THROW(describe(), ": no message after ", timeout.count(), " s (transfer timeout)");
      }
      if (aborted_) throw Aborted{};
      auto node = messages_.extract(key);
      out = std::move(node.mapped());
      node.mapped() = Message{};  // the node keeps no memory of the message's
      spare_.push_back(std::move(node));
      wake = senders_waiting_ > 0;
    }
    if (wake) space_.notify_all();
    return out;
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
  std::vector<typename std::map<MessageKey, Message>::node_type> spare_;  // emptied nodes, for the next sends
  std::size_t capacity_;
  bool aborted_ = false;
  bool waiting_ = false;  // the worker waits for `awaited_`
  MessageKey awaited_{};
  int senders_waiting_ = 0;
};

}  // namespace cupipe::pipeline
