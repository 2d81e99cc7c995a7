// SPDX-License-Identifier: Apache-2.0
// The zigzag split of context parallelism: a sequence of T tokens cut into 2 cp chunks, rank r of a
// ring of cp holding chunks r and 2 cp - 1 - r (Megatron's CP, llama3), and the ring's order. No
// dependencies, so a backend context can name the ring (cp/context_group.hpp) without the
// attention code.
#pragma once

#include <array>
#include <string_view>

#include "cupipe/core/error.hpp"
#include "cupipe/core/shape.hpp"

namespace cupipe::cp {

/// How a sequence's 2 cp chunks are dealt to the cp ranks.
enum class Split {
  zigzag,      ///< rank r: chunks r and 2 cp - 1 - r (balanced causal work)
  contiguous,  ///< rank r: chunks 2r and 2r + 1 (the last rank does the most)
};

/// The two chunks rank `rank` of `cp` holds, first the earlier.
inline std::array<int, 2> chunks_of(int rank, int cp, Split split = Split::zigzag) {
  CUPIPE_REQUIRE(cp >= 1 && rank >= 0 && rank < cp, "context parallel: rank ", rank, " of ", cp, " ranks");
  if (split == Split::contiguous) return {2 * rank, 2 * rank + 1};
  return {rank, 2 * cp - 1 - rank};
}

/// Rows per chunk of a sequence of `seq_len` tokens cut for `cp` ranks; refused unless 2 cp divides it.
inline index_t chunk_rows(index_t seq_len, int cp) {
  CUPIPE_REQUIRE(cp >= 1 && seq_len % (2 * cp) == 0, "context parallel: a sequence of ", seq_len,
                 " tokens does not cut into ", 2 * cp, " equal chunks for ", cp, " ranks");
  return seq_len / (2 * cp);
}

/// Refuses `rows` local rows that are not whole sequences' shares on a ring of `cp` (2 chunks of
/// sequences of `seq_len`), naming `who`.
inline void check_ring_rows(index_t rows, index_t seq_len, int cp, std::string_view who) {
  const index_t local = 2 * chunk_rows(seq_len, cp);
  if (rows % local != 0)
    CUPIPE_THROW(who, ": ", rows, " rows are not whole sequences' shares (", local, " rows each: ", seq_len,
                 " tokens over a context-parallel ring of ", cp, ")");
}

/// The ring's order: at step s (0 .. cp - 1) rank r works on the keys and values of rank
/// (r - s) mod cp, its own first, each rank passing on what it last received.
inline int ring_source(int rank, int step, int cp) { return ((rank - step) % cp + cp) % cp; }

}  // namespace cupipe::cp
