// SPDX-License-Identifier: Apache-2.0
// InFlightTable: the microbatches a stage holds between their forward and their backward (or W), by
// microbatch id. A slot per id, kept from step to step: taking a microbatch in and out allocates
// nothing once the table has seen a step's ids (a std::map made a node on every forward). Taking a
// new id in keeps every other microbatch where it is (a deque grows at its end without moving its
// elements): the B of an overlapped pair that takes turns with its F (paired_turns.hpp) holds its
// microbatch while the F takes its own in.
#pragma once

#include <cstddef>
#include <deque>
#include <utility>
#include <vector>

#include "cupipe/core/error.hpp"

namespace cupipe::pipeline {

template <class InFlight>
class InFlightTable {
 public:
  /// The microbatch held under `j`, or null.
  InFlight* find(int j) noexcept {
    return j >= 0 && std::size_t(j) < held_.size() && held_[std::size_t(j)] ? &items_[std::size_t(j)] : nullptr;
  }
  /// Holds `f` under `j`; a second forward of a microbatch still held is an error.
  InFlight& emplace(int j, InFlight&& f) {
    CUPIPE_REQUIRE(j >= 0, "a microbatch id is not negative, got ", j);
    if (std::size_t(j) >= held_.size()) {
      items_.resize(std::size_t(j) + 1);
      held_.resize(std::size_t(j) + 1, 0);
    }
    if (held_[std::size_t(j)]) CUPIPE_THROW("a second forward of microbatch ", j, " before its backward");
    items_[std::size_t(j)] = std::move(f);
    held_[std::size_t(j)] = 1;
    ++count_;
    return items_[std::size_t(j)];
  }
  /// Frees what microbatch j held (nothing when none).
  void erase(int j) {
    if (find(j) == nullptr) return;
    items_[std::size_t(j)] = InFlight{};
    held_[std::size_t(j)] = 0;
    --count_;
  }
  /// Frees everything held (after a failed step).
  void clear() {
    for (std::size_t j = 0; j < held_.size(); ++j) erase(int(j));
  }
  std::size_t size() const noexcept { return count_; }
  bool empty() const noexcept { return count_ == 0; }

 private:
  std::deque<InFlight> items_;
  std::vector<char> held_;
  std::size_t count_ = 0;
};

}  // namespace cupipe::pipeline
