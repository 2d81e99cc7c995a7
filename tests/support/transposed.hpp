// SPDX-License-Identifier: Apache-2.0
// The transpose of a row-major matrix, for tests that build an operand as a GEMM role sees it.
#pragma once

#include <cstddef>
#include <vector>

#include "cupipe/core/shape.hpp"

namespace cupipe::testing {

/// v (rows, cols), row-major, as its transpose (cols, rows), row-major.
template <class T>
std::vector<T> transposed(const std::vector<T>& v, index_t rows, index_t cols) {
  std::vector<T> out(v.size());
  for (index_t r = 0; r < rows; ++r)
    for (index_t c = 0; c < cols; ++c) out[std::size_t(c * rows + r)] = v[std::size_t(r * cols + c)];
  return out;
}

}  // namespace cupipe::testing
