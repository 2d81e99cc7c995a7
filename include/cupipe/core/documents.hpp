// SPDX-License-Identifier: Apache-2.0
// Packed sequences: documents of different lengths side by side in one sequence (a batch row of
// SeqLen tokens), attention kept within each document and positions restarting at each one. The
// borders are a row's document start (DocumentStarts), read from the token ids where a separator
// begins each document (document_starts: llm.c's shards begin each document with <|endoftext|>),
// and turned into FlashAttention's and cuDNN's cumulative lengths where a kernel takes them
// (cumulative_lengths). A backend context carries the current microbatch's (Host::documents,
// Cuda::documents); layers/attention.hpp and layers/embedding.hpp read it.
#pragma once

#include <cstdint>
#include <span>
#include <string_view>
#include <vector>

#include "cupipe/core/error.hpp"
#include "cupipe/core/shape.hpp"

namespace cupipe {

/// The document borders of a batch's rows (tokens), in host memory on every backend (the layers
/// split their work by them; no kernel reads them): start[r] is the index, within row r's sequence,
/// of the first row of r's document. Empty (null `start`): each sequence is one document.
struct DocumentStarts {
  const std::int32_t* start = nullptr;
  index_t rows = 0;

  bool empty() const { return start == nullptr; }

  /// Rows [first, first + count), e.g. one microbatch's (whole sequences, so still valid borders).
  DocumentStarts slice(index_t first, index_t count) const {
    if (empty()) return {};
    CUPIPE_REQUIRE(first >= 0 && count >= 0 && first + count <= rows, "DocumentStarts: rows [", first, ", ",
                   first + count, ") are outside the ", rows, " rows given");
    return {start + first, count};
  }

  /// f(first_row, length) for each document of the sequence whose first row is `s0` (seq_len rows),
  /// in order; the whole sequence once where empty.
  template <class F>
  void each_document(index_t s0, index_t seq_len, F&& f) const {
    if (empty()) return f(s0, seq_len);
    index_t begin = 0;
    for (index_t t = 1; t <= seq_len; ++t)
      if (t == seq_len || start[s0 + t] == t) {
        f(s0 + begin, t - begin);
        begin = t;
      }
  }

  /// Row r's position in its document.
  index_t position(index_t r, index_t seq_len) const { return empty() ? r % seq_len : r % seq_len - start[r]; }
};

/// Refuses borders `d` that do not describe `rows` rows of sequences of `seq_len` (names `what` and the
/// first bad row): an entry per row, each sequence's first 0, each next the one before (the same
/// document) or its own index in the sequence (a new one).
inline void check_documents(const DocumentStarts& d, index_t rows, index_t seq_len, std::string_view what) {
  if (d.empty()) return;
  CUPIPE_REQUIRE(d.rows == rows, what, ": document starts for ", d.rows, " rows, but the batch has ", rows);
  CUPIPE_REQUIRE(seq_len > 0 && rows % seq_len == 0, what, ": ", rows, " rows are not whole sequences of ", seq_len);
  for (index_t r = 0; r < rows; ++r) {
    const index_t t = r % seq_len;
    const std::int32_t s = d.start[r];
    const bool fine = t == 0 ? s == 0 : (s == d.start[r - 1] || s == t);
    CUPIPE_REQUIRE(fine, what, ": row ", r, " (token ", t, " of sequence ", r / seq_len, ") has document start ", s,
                   "; a start is 0 at a sequence's first token, then the previous token's or the token's own index");
  }
}

/// The document starts of `ids` (whole sequences of `seq_len` token ids): a document begins at each
/// sequence's first token and at each `separator` token (GPT-2's <|endoftext|>, 50256, which llm.c's
/// shards put before every document; or a byte that separates texts).
inline std::vector<std::int32_t> document_starts(std::span<const std::int32_t> ids, index_t seq_len, std::int32_t separator) {
  CUPIPE_REQUIRE(seq_len > 0 && index_t(ids.size()) % seq_len == 0, "document_starts: ", ids.size(),
                 " token ids are not whole sequences of ", seq_len);
  std::vector<std::int32_t> start(ids.size());
  for (std::size_t r = 0; r < ids.size(); ++r) {
    const auto t = std::int32_t(index_t(r) % seq_len);
    start[r] = t == 0 || ids[r] == separator ? t : start[r - 1];
  }
  return start;
}

/// f(first_row, length) for each document of `rows` rows in sequences of `seq_len`, in order (each
/// whole sequence where `d` is empty). The borders are checked first (check_documents, naming `what`).
template <class F>
void each_document_in(const DocumentStarts& d, index_t rows, index_t seq_len, std::string_view what, F&& f) {
  check_documents(d, rows, seq_len, what);
  for (index_t s0 = 0; s0 < rows; s0 += seq_len) d.each_document(s0, seq_len, f);
}

/// FlashAttention's cu_seqlens (cuDNN's ragged offsets) of `d` over `rows` rows in sequences of
/// `seq_len`: 0, then the end row of each document in order (documents + 1 entries). Empty borders:
/// one document per sequence.
inline std::vector<std::int32_t> cumulative_lengths(const DocumentStarts& d, index_t rows, index_t seq_len) {
  std::vector<std::int32_t> out{0};
  each_document_in(d, rows, seq_len, "cumulative_lengths",
                   [&](index_t first, index_t length) { out.push_back(std::int32_t(first + length)); });
  return out;
}

}  // namespace cupipe
