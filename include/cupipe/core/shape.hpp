// SPDX-License-Identifier: Apache-2.0
// Shape: up to four extents, row-major. Printed as "(8, 50)".
#pragma once

#include <array>
#include <cstdint>
#include <initializer_list>
#include <ostream>
#include <string>

#include "cupipe/core/error.hpp"

namespace cupipe {

using index_t = std::int64_t;

class Shape {
 public:
  static constexpr int max_rank = 4;

  constexpr Shape() = default;
  constexpr Shape(std::initializer_list<index_t> extents) {
    if (extents.size() > max_rank) throw std::length_error("cupipe::Shape: more than 4 extents");
    for (index_t e : extents) {
      if (e < 0) throw std::invalid_argument("cupipe::Shape: negative extent");
      dims_[rank_++] = e;
    }
  }

  constexpr int rank() const noexcept { return rank_; }
  constexpr index_t operator[](int axis) const noexcept { return dims_[axis]; }
  constexpr index_t numel() const noexcept {
    index_t n = 1;
    for (int i = 0; i < rank_; ++i) n *= dims_[i];
    return n;
  }
  /// Rows of the 2-D view used by every op: all leading extents folded together.
  constexpr index_t rows() const noexcept {
    index_t n = 1;
    for (int i = 0; i + 1 < rank_; ++i) n *= dims_[i];
    return n;
  }
  /// Columns of the 2-D view: the last extent (1 for a scalar).
  constexpr index_t cols() const noexcept { return rank_ == 0 ? 1 : dims_[rank_ - 1]; }

  constexpr bool operator==(const Shape& other) const noexcept {
    if (rank_ != other.rank_) return false;
    for (int i = 0; i < rank_; ++i)
      if (dims_[i] != other.dims_[i]) return false;
    return true;
  }

  std::string to_string() const {
    std::string out = "(";
    for (int i = 0; i < rank_; ++i) {
      if (i) out += ", ";
      out += std::to_string(dims_[i]);
    }
    if (rank_ == 1) out += ",";
    return out + ")";
  }

 private:
  std::array<index_t, max_rank> dims_{};
  int rank_ = 0;
};

inline std::ostream& operator<<(std::ostream& out, const Shape& shape) { return out << shape.to_string(); }

}  // namespace cupipe
