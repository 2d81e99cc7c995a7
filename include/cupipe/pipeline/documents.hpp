// SPDX-License-Identifier: Apache-2.0
// A step's document borders (packed sequences, core/documents.hpp) on their way to the stages:
// checked against the batch and against PipelineOptions::packed_sequences (check_step_documents);
// across processes agreed over the stages of the pipeline, one small sum over them per step, so a
// stage given other borders than its neighbours fails with them instead of training on a mask
// that does not match their activations (agree_on_documents). A stage's context carries a
// microbatch's borders for each action on it (pipeline/microbatch_scope.hpp).
#pragma once

#include <cstdint>
#include <string_view>

#include "cupipe/comm/communicator.hpp"
#include "cupipe/core/documents.hpp"
#include "cupipe/core/error.hpp"
#include "cupipe/pipeline/options.hpp"

namespace cupipe::pipeline {

/// 48 bits of FNV-1a over the row count and the starts: what the stages compare.
inline std::uint64_t documents_fingerprint(const DocumentStarts& d) {
  std::uint64_t h = 1469598103934665603ull;
  const auto mix = [&](std::uint64_t v) {
    for (int b = 0; b < 8; ++b) h = (h ^ ((v >> (8 * b)) & 0xffu)) * 1099511628211ull;
  };
  mix(std::uint64_t(d.rows));
  for (index_t r = 0; r < d.rows && !d.empty(); ++r) mix(std::uint32_t(d.start[r]));
  return h & ((std::uint64_t(1) << 48) - 1);
}

/// Across processes: every stage of this pipeline was given the same borders `d` for this step,
/// or every stage throws, naming `who`. One sum over the stages of seven doubles: the count, then
/// each 16-bit piece of the fingerprint and its square (exact in doubles for up to 1,024 stages);
/// the pieces agree everywhere exactly when count x sum of squares = square of the sum.
inline void agree_on_documents(comm::Communicator& comm, const DocumentStarts& d, std::string_view who) {
  const std::uint64_t h = documents_fingerprint(d);
  double sums[7] = {1.0};
  for (int i = 0; i < 3; ++i) {
    const double piece = double((h >> (16 * i)) & 0xffffu);
    sums[1 + 2 * i] = piece;
    sums[2 + 2 * i] = piece * piece;
  }
  comm.sum_over_stages(sums, 7);
  for (int i = 0; i < 3; ++i)
    CUPIPE_REQUIRE(sums[0] * sums[2 + 2 * i] == sums[1 + 2 * i] * sums[1 + 2 * i], who,
                   ": the stages of this pipeline were given different document borders for this batch (packed "
                   "sequences); every rank of a pipeline must pass the same ones");
}

/// The borders given with a batch of `rows` rows in sequences of `seq_len`, before any work:
/// present exactly when the pipeline was built for packed sequences (options.packed_sequences), and
/// valid; agreed over the stages where the pipeline spans processes (options.communicator).
inline void check_step_documents(const DocumentStarts& d, const PipelineOptions& options, index_t rows, index_t seq_len,
                                 std::string_view who = "Pipeline::train_step") {
  comm::Communicator* comm = options.communicator.get();
  if (!options.packed_sequences) {
    CUPIPE_REQUIRE(d.empty(), who, ": document borders given, but the pipeline was built without "
                   "PipelineOptions::packed_sequences");
    return;
  }
  CUPIPE_REQUIRE(!d.empty(), who, ": the pipeline was built with PipelineOptions::packed_sequences, so every "
                 "batch needs its document borders (document_starts)");
  check_documents(d, rows, seq_len, who);
  if (comm != nullptr && comm->topology().stages > 1) agree_on_documents(*comm, d, who);
}

}  // namespace cupipe::pipeline
