// SPDX-License-Identifier: Apache-2.0
// Random slots for the mixture-of-experts permutation ops (backend/host/ops_moe.hpp), shared by the
// host tests and the CUDA tests that check the kernels against them.
#pragma once

#include <cstdint>
#include <utility>
#include <vector>

#include "cupipe/core/rng.hpp"
#include "cupipe/core/shape.hpp"

namespace cupipe::testing {

/// Slots of n tokens' k choices (n x k, row-major): about a quarter dropped (-1), the others a
/// shuffle of the rows [0, kept), which `kept` returns.
inline std::vector<std::int32_t> random_moe_slots(Rng& rng, index_t n, index_t k, index_t& kept) {
  std::vector<std::int32_t> slots(static_cast<std::size_t>(n * k), -1);
  std::vector<std::size_t> choices;
  for (std::size_t i = 0; i < slots.size(); ++i)
    if (rng.uniform() >= 0.25) choices.push_back(i);
  for (std::size_t i = choices.size(); i > 1; --i) std::swap(choices[i - 1], choices[std::size_t(rng.below(i))]);
  for (std::size_t row = 0; row < choices.size(); ++row) slots[choices[row]] = std::int32_t(row);
  kept = index_t(choices.size());
  return slots;
}

}  // namespace cupipe::testing
