// SPDX-License-Identifier: Apache-2.0
// ContextGroup: the ranks of one context-parallel ring as the layers see it. Each holds the same
// weights and 2 of the 2 cp chunks of every sequence (the zigzag split, cp/zigzag.hpp):
// rank r chunks r and 2 cp - 1 - r, so a sequence of T tokens is T / cp rows on each rank, chunk
// r's first, in order. A backend context carries a pointer to one (Host::context_group); the
// attention layer passes keys and values round the ring through it (cp/ring_layer.hpp), and the
// position embedding reads each row's place in the whole sequence from it (sequence_runs).
// comm::MpiCommunicator provides one for host ranks (Communicator::context_group()).
//
// Everything else in a transformer is token-wise: the rows of a ring's ranks are just more tokens
// of the same batch, which is why the pipeline counts a ring's ranks among a stage's replicas
// (comm/topology.hpp) and sums gradients and losses over them with the data-parallel replicas.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "cupipe/core/error.hpp"
#include "cupipe/core/shape.hpp"
#include "cupipe/cp/zigzag.hpp"

namespace cupipe::cp {

class ContextGroup {
 public:
  virtual ~ContextGroup() = default;
  /// Ranks in the ring, and this rank's place in it (0 .. size() - 1).
  virtual int size() const = 0;
  virtual int rank() const = 0;
  /// Whether the passes move device memory (NCCL's ring) rather than host memory (MPI's).
  virtual bool device_memory() const { return false; }
  /// Starts one hand-over round the ring: `bytes` of `send` to the next rank, rank() + 1 mod
  /// size(), and as many from the previous into `receive`, in host memory or, where
  /// device_memory(), device memory. Returns at once: the caller computes meanwhile and then calls
  /// finish_pass(), which waits for both (under the communicator's collective timeout, naming the
  /// ring on expiry). `send` must not be written and `receive` not touched until then. A device
  /// ring starts the pass after the work enqueued so far on `stream` (a cudaStream_t: what wrote
  /// `send` and last read `receive`); a host ring ignores it. No stream ever waits for the pass:
  /// finish_pass waits on the host, under its deadline. One pass at a time; every rank of the ring
  /// makes the same passes in the same order.
  virtual void start_pass(const void* send, void* receive, std::size_t bytes, void* stream) = 0;
  virtual void finish_pass() = 0;
  /// In place, host memory: element-wise sum over the ring (held-out losses, which each rank holds
  /// a share of).
  virtual void sum(double* data, std::size_t count) = 0;
};

/// The ring's size on a backend context: 1 without a context group (or on a backend that has none).
template <class B>
int ring_size(const B& be) {
  if constexpr (requires { be.context_group; }) return be.context_group ? be.context_group->size() : 1;
  else return 1;
}

/// f(first row, first position, length) over the runs of consecutive positions in `rows` local rows
/// of sequences of `seq_len` tokens split over a ring of `cp` ranks, this one `rank`: two runs per
/// sequence (its two chunks), or one run per sequence without a ring.
template <class F>
void sequence_runs(index_t rows, index_t seq_len, int rank, int cp, F&& f) {
  if (cp == 1) {
    for (index_t s = 0; s < rows; s += seq_len) f(s, index_t(0), seq_len);
    return;
  }
  const index_t c = chunk_rows(seq_len, cp);
  const std::array<int, 2> chunks = chunks_of(rank, cp);
  for (index_t s = 0; s < rows; s += 2 * c)
    for (int i = 0; i < 2; ++i) f(s + i * c, index_t(chunks[std::size_t(i)]) * c, c);
}

/// This ring rank's rows of whole sequences: for each sequence of `seq_len` rows of `width` values
/// in `whole`, its two chunks under the zigzag split, in order (what the rank feeds its pipeline:
/// token ids and labels, width 1).
template <class V>
std::vector<V> local_rows(std::span<const V> whole, index_t seq_len, int rank, int cp, index_t width = 1) {
  const index_t sequence = seq_len * width;
  CUPIPE_REQUIRE(seq_len > 0 && width > 0 && index_t(whole.size()) % sequence == 0, "context parallel: ", whole.size(),
                 " values are not whole sequences of ", seq_len, " rows of ", width);
  const index_t chunk = chunk_rows(seq_len, cp) * width;
  std::vector<V> out;
  out.reserve(whole.size() / std::size_t(cp));
  for (index_t s = 0; s < index_t(whole.size()); s += sequence)
    for (const int k : chunks_of(rank, cp))
      out.insert(out.end(), whole.begin() + s + k * chunk, whole.begin() + s + (k + 1) * chunk);
  return out;
}

/// The row, among ring rank `rank`'s rows of a sequence of `seq_len` (local_rows), that holds
/// position `position`; -1 where another rank of the ring holds it.
inline index_t local_row_of(index_t position, index_t seq_len, int rank, int cp) {
  const index_t c = chunk_rows(seq_len, cp);
  const std::array<int, 2> chunks = chunks_of(rank, cp);
  for (int i = 0; i < 2; ++i)
    if (position / c == chunks[std::size_t(i)]) return i * c + position % c;
  return -1;
}

}  // namespace cupipe::cp
