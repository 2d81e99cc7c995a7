// SPDX-License-Identifier: Apache-2.0
// Token data for language models: byte-level text (vocabulary 256) from a file or a folder, llm.c's
// token shards, a fixed held-out split, and batches of (B, T + 1) windows sharded across data-parallel
// replicas with a position a checkpoint can store.
//
// llm.c's shard format (dev/data/data_common.py): a header of 256 little-endian int32 (magic
// 20240520, version 1, token count, the rest 0), then `count` little-endian uint16 tokens.
#pragma once

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "cupipe/core/error.hpp"
#include "cupipe/core/shape.hpp"

namespace cupipe::io {

/// Tokens and where they came from.
struct TokenCorpus {
  std::vector<std::int32_t> tokens;
  std::int64_t vocab = 0;
  std::string source;  ///< the file or folder read, for messages
  std::int64_t files = 0;
};

inline constexpr std::int32_t llmc_magic = 20240520;
inline constexpr std::int32_t llmc_version = 1;
inline constexpr std::size_t llmc_header_bytes = 256 * sizeof(std::int32_t);
/// Debian's fortunes package: a few MB of English text in many styles.
inline constexpr const char* fortunes_default_dir = "/usr/share/games/fortunes";

namespace detail {

/// `path` itself if it is a regular file; else the regular files under the folder `path` (recursive,
/// symbolic links not followed, sorted by path) that `keep` accepts. Throws naming the path when
/// there is nothing to read.
template <class Keep>
std::vector<std::filesystem::path> corpus_files(const std::filesystem::path& path, Keep&& keep, const char* what) {
  namespace fs = std::filesystem;
  std::error_code ec;
  const fs::file_status status = fs::status(path, ec);
  if (ec || !fs::exists(status)) CUPIPE_THROW(path.string(), ": no such file or folder (", what, ")");
  if (fs::is_regular_file(status)) return {path};
  if (!fs::is_directory(status)) CUPIPE_THROW(path.string(), ": neither a regular file nor a folder (", what, ")");
  std::vector<fs::path> files;
  for (fs::recursive_directory_iterator it(path, ec), end; !ec && it != end; it.increment(ec))
    if (it->is_regular_file(ec) && !it->is_symlink(ec) && keep(it->path())) files.push_back(it->path());
  if (ec) CUPIPE_THROW(path.string(), ": cannot list the folder: ", ec.message());
  if (files.empty()) CUPIPE_THROW(path.string(), ": the folder holds no ", what);
  std::sort(files.begin(), files.end());
  return files;
}

inline std::vector<char> read_all(const std::filesystem::path& file) {
  std::ifstream in(file, std::ios::binary);
  if (!in) CUPIPE_THROW(file.string(), ": cannot open for reading");
  std::vector<char> bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  if (in.bad()) CUPIPE_THROW(file.string(), ": read error");
  return bytes;
}

inline std::int32_t little_i32(const char* p) {
  std::uint32_t v = 0;
  for (int i = 3; i >= 0; --i) v = (v << 8) | std::uint8_t(p[i]);
  return std::int32_t(v);
}

}  // namespace detail

/// The bytes of a text file, or of every file in a folder (sorted, concatenated), as tokens 0..255.
/// fortune's index files (*.dat) are skipped.
inline TokenCorpus load_text(const std::filesystem::path& path) {
  const auto files = detail::corpus_files(
      path, [](const std::filesystem::path& p) { return p.extension() != ".dat"; }, "text files");
  TokenCorpus corpus{{}, 256, path.string(), std::int64_t(files.size())};
  for (const auto& file : files) {
    const std::vector<char> bytes = detail::read_all(file);
    for (char c : bytes) corpus.tokens.push_back(std::int32_t(std::uint8_t(c)));
  }
  if (corpus.tokens.size() < 2) CUPIPE_THROW(path.string(), ": ", corpus.tokens.size(), " bytes of text; training needs at least 2");
  return corpus;
}

/// One llm.c shard's tokens, appended to `out`. Every way the file can be wrong is an error naming it.
inline void load_llmc_shard(const std::filesystem::path& file, std::int64_t vocab, std::vector<std::int32_t>& out) {
  const std::vector<char> bytes = detail::read_all(file);
  const std::string name = file.string();
  if (bytes.size() < llmc_header_bytes)
    CUPIPE_THROW(name, ": truncated header: ", bytes.size(), " bytes, an llm.c token shard starts with ", llmc_header_bytes);
  const std::int32_t magic = detail::little_i32(bytes.data()), version = detail::little_i32(bytes.data() + 4),
                     count = detail::little_i32(bytes.data() + 8);
  if (magic != llmc_magic)
    CUPIPE_THROW(name, ": magic number ", magic, ", expected ", llmc_magic, " (not an llm.c token shard)");
  if (version != llmc_version) CUPIPE_THROW(name, ": version ", version, "; only version ", llmc_version, " is supported");
  if (count < 0) CUPIPE_THROW(name, ": the header's token count is negative (", count, ")");
  const std::size_t payload = bytes.size() - llmc_header_bytes, expected = std::size_t(count) * 2;
  if (payload < expected)
    CUPIPE_THROW(name, ": truncated: the header says ", count, " tokens (", expected, " bytes) but the file holds ",
                 payload, " bytes after the header");
  if (payload > expected)
    CUPIPE_THROW(name, ": count mismatch: the header says ", count, " tokens (", expected, " bytes) but the file holds ",
                 payload, " bytes after the header");
  const char* p = bytes.data() + llmc_header_bytes;
  out.reserve(out.size() + std::size_t(count));
  for (std::int32_t i = 0; i < count; ++i) {
    const std::int32_t token = std::int32_t(std::uint8_t(p[2 * i])) | (std::int32_t(std::uint8_t(p[2 * i + 1])) << 8);
    if (token >= vocab)
      CUPIPE_THROW(name, ": token ", token, " at position ", i, " is outside the model's vocabulary [0, ", vocab, ")");
    out.push_back(token);
  }
}

/// An llm.c shard, or every *.bin shard in a folder (sorted, concatenated).
inline TokenCorpus load_llmc_shards(const std::filesystem::path& path, std::int64_t vocab) {
  const auto files = detail::corpus_files(
      path, [](const std::filesystem::path& p) { return p.extension() == ".bin"; }, "llm.c token shards (*.bin)");
  TokenCorpus corpus{{}, vocab, path.string(), std::int64_t(files.size())};
  for (const auto& file : files) load_llmc_shard(file, vocab, corpus.tokens);
  if (corpus.tokens.size() < 2) CUPIPE_THROW(path.string(), ": ", corpus.tokens.size(), " tokens; training needs at least 2");
  return corpus;
}

/// Writes tokens as an llm.c shard (for tests and for exporting a corpus).
inline void write_llmc_shard(const std::filesystem::path& file, const std::vector<std::int32_t>& tokens) {
  std::vector<char> bytes(llmc_header_bytes + 2 * tokens.size(), 0);
  const std::array<std::int32_t, 3> head{llmc_magic, llmc_version, std::int32_t(tokens.size())};
  for (std::size_t k = 0; k < head.size(); ++k)
    for (int b = 0; b < 4; ++b) bytes[4 * k + std::size_t(b)] = char((std::uint32_t(head[k]) >> (8 * b)) & 0xff);
  for (std::size_t i = 0; i < tokens.size(); ++i) {
    CUPIPE_REQUIRE(tokens[i] >= 0 && tokens[i] < 65536, "write_llmc_shard: token ", tokens[i], " does not fit in uint16");
    bytes[llmc_header_bytes + 2 * i] = char(tokens[i] & 0xff);
    bytes[llmc_header_bytes + 2 * i + 1] = char((tokens[i] >> 8) & 0xff);
  }
  std::ofstream out(file, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), std::streamsize(bytes.size()));
  if (!out) CUPIPE_THROW(file.string(), ": cannot write the shard");
}

/// A corpus split once, the same way every run: the last `held_out_fraction` of the tokens are held
/// out (never trained on), the rest train.
struct TokenSplit {
  std::vector<std::int32_t> train, held_out;
};
inline TokenSplit split_held_out(const TokenCorpus& corpus, double held_out_fraction) {
  CUPIPE_REQUIRE(held_out_fraction > 0 && held_out_fraction < 1, "split_held_out: the fraction must be in (0, 1), got ",
                 held_out_fraction);
  const std::size_t n = corpus.tokens.size();
  const std::size_t cut = n - std::size_t(double(n) * held_out_fraction);
  return {std::vector<std::int32_t>(corpus.tokens.begin(), corpus.tokens.begin() + std::ptrdiff_t(cut)),
          std::vector<std::int32_t>(corpus.tokens.begin() + std::ptrdiff_t(cut), corpus.tokens.end())};
}

/// Batches of `sequences` windows of T + 1 tokens (inputs: the first T, labels: the last T). Window w
/// starts at token w * T. A global batch is sequences * replicas consecutive windows; replica r takes
/// the r-th share. The position (windows consumed, all replicas together) wraps around at the end of
/// the data and is what a checkpoint stores to resume.
class WindowLoader {
 public:
  WindowLoader(const std::vector<std::int32_t>& tokens, index_t context, index_t sequences, int replica = 0,
               int replicas = 1, std::uint64_t position = 0)
      : tokens_(&tokens), T_(context), B_(sequences), replica_(replica), replicas_(replicas), position_(position) {
    CUPIPE_REQUIRE(context > 0 && sequences > 0, "WindowLoader: context (", context, ") and sequences (", sequences,
                   ") must be positive");
    CUPIPE_REQUIRE(replicas >= 1 && replica >= 0 && replica < replicas, "WindowLoader: replica ", replica, " of ", replicas);
    windows_ = tokens.size() > 1 ? std::uint64_t((tokens.size() - 1) / std::size_t(context)) : 0;
    if (windows_ < std::uint64_t(sequences) * std::uint64_t(replicas))
      CUPIPE_THROW("WindowLoader: ", tokens.size(), " tokens give ", windows_, " windows of ", context + 1,
                   " tokens, fewer than one batch of ", sequences, " x ", replicas, " replicas");
  }

  /// The next batch: x (B * T) token ids and y (B * T) next tokens, both as rows of whole sequences.
  void next(std::vector<std::int32_t>& x, std::vector<std::int32_t>& y) {
    x.resize(std::size_t(B_ * T_));
    y.resize(std::size_t(B_ * T_));
    for (index_t s = 0; s < B_; ++s) {
      const std::uint64_t w = (position_ + std::uint64_t(replica_) * std::uint64_t(B_) + std::uint64_t(s)) % windows_;
      const std::int32_t* from = tokens_->data() + w * std::uint64_t(T_);
      std::memcpy(x.data() + s * T_, from, std::size_t(T_) * sizeof(std::int32_t));
      std::memcpy(y.data() + s * T_, from + 1, std::size_t(T_) * sizeof(std::int32_t));
    }
    position_ = (position_ + std::uint64_t(B_) * std::uint64_t(replicas_)) % windows_;
  }

  std::uint64_t position() const noexcept { return position_; }
  std::uint64_t windows() const noexcept { return windows_; }

 private:
  const std::vector<std::int32_t>* tokens_;
  index_t T_, B_;
  int replica_, replicas_;
  std::uint64_t position_ = 0, windows_ = 0;
};

}  // namespace cupipe::io
