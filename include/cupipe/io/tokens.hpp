// SPDX-License-Identifier: Apache-2.0
// Token data for language models: byte-level text (vocabulary 256) from a file or a folder, llm.c's
// token shards, a fixed held-out split, and batches of (B, T + 1) windows, shuffled each epoch by a
// seeded generator, sharded across data-parallel replicas, with a position a checkpoint can store.
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
#include <numeric>
#include <string>
#include <vector>

#include "cupipe/core/error.hpp"
#include "cupipe/core/rng.hpp"
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

/// The order a WindowLoader takes the windows in.
enum class WindowOrder {
  shuffled,  ///< each epoch a fresh seeded permutation of the windows (nanoGPT samples at random, llm.c shuffles)
  in_order,  ///< window 0, 1, 2, ...: the same batches every time (held-out evaluation)
};

/// The stream of Rng::derive(seed, stream) that orders the windows: past any layer's index, so the
/// order draws nothing a layer's initialisation draws.
inline constexpr std::uint64_t window_order_stream = std::uint64_t(1) << 32;

/// Where a WindowLoader is, all replicas together; what a checkpoint stores to resume.
struct WindowPosition {
  Rng::state_type rng = Rng::derive(0, window_order_stream).state();  ///< the generator at the start of `epoch`
  std::int64_t epoch = 0;  ///< epochs done
  std::int64_t batch = 0;  ///< global batches done within the epoch
  /// The start of the first epoch of `seed`'s order.
  static WindowPosition start(std::uint64_t seed) { return {Rng::derive(seed, window_order_stream).state(), 0, 0}; }
  friend bool operator==(const WindowPosition&, const WindowPosition&) = default;
};

/// Batches of `sequences` windows of T + 1 tokens (inputs: the first T, labels: the last T). Window w
/// starts at token w * T. Each epoch orders the windows (shuffled: a permutation drawn by Fisher-Yates
/// from the position's generator, which then starts the next epoch; in order: as they lie) and cuts the
/// order into global batches of sequences * replicas windows, of which replica r takes the r-th share:
/// the replicas' windows are disjoint, and together the replicas take the batches one process would.
/// An epoch is the whole batches the windows make; the few left over wait for a later epoch's order.
class WindowLoader {
 public:
  WindowLoader(const std::vector<std::int32_t>& tokens, index_t context, index_t sequences, int replica = 0,
               int replicas = 1, WindowPosition position = {}, WindowOrder order = WindowOrder::shuffled)
      : tokens_(&tokens), T_(context), B_(sequences), replica_(replica), replicas_(replicas), order_(order),
        position_(position) {
    CUPIPE_REQUIRE(context > 0 && sequences > 0, "WindowLoader: context (", context, ") and sequences (", sequences,
                   ") must be positive");
    CUPIPE_REQUIRE(replicas >= 1 && replica >= 0 && replica < replicas, "WindowLoader: replica ", replica, " of ", replicas);
    const std::uint64_t windows = tokens.size() > 1 ? std::uint64_t((tokens.size() - 1) / std::size_t(context)) : 0;
    const std::uint64_t global = std::uint64_t(sequences) * std::uint64_t(replicas);
    if (windows < global)
      CUPIPE_THROW("WindowLoader: ", tokens.size(), " tokens give ", windows, " windows of ", context + 1,
                   " tokens, fewer than one batch of ", sequences, " x ", replicas, " replicas");
    batches_ = std::int64_t(windows / global);
    if (position.epoch < 0 || position.batch < 0 || position.batch > batches_)
      CUPIPE_THROW("WindowLoader: the position is batch ", position.batch, " of epoch ", position.epoch, ", but an epoch of ",
                   windows, " windows has ", batches_, " batches of ", sequences, " x ", replicas,
                   " replicas (was it saved with another batch size, context or corpus?)");
    order_windows(std::size_t(windows));
  }

  /// The next batch: x (B * T) token ids and y (B * T) next tokens, both as rows of whole sequences.
  void next(std::vector<std::int32_t>& x, std::vector<std::int32_t>& y) {
    if (position_.batch == batches_) {  // the epoch is done: the generator, now past its shuffle, orders the next
      position_ = {rng_.state(), position_.epoch + 1, 0};
      order_windows(windows_.size());
    }
    x.resize(std::size_t(B_ * T_));
    y.resize(std::size_t(B_ * T_));
    const std::size_t first = std::size_t(position_.batch * replicas_ + replica_) * std::size_t(B_);
    for (index_t s = 0; s < B_; ++s) {
      const std::int32_t* from = tokens_->data() + windows_[first + std::size_t(s)] * std::uint64_t(T_);
      std::memcpy(x.data() + s * T_, from, std::size_t(T_) * sizeof(std::int32_t));
      std::memcpy(y.data() + s * T_, from + 1, std::size_t(T_) * sizeof(std::int32_t));
    }
    ++position_.batch;
  }

  /// Where the next batch comes from (every replica's loader gives the same).
  const WindowPosition& position() const noexcept { return position_; }
  std::uint64_t windows() const noexcept { return windows_.size(); }
  /// Global batches an epoch makes.
  std::int64_t batches_per_epoch() const noexcept { return batches_; }

 private:
  /// This epoch's order of the windows, drawn from the position's generator (left past the draws).
  void order_windows(std::size_t count) {
    windows_.resize(count);
    std::iota(windows_.begin(), windows_.end(), std::uint64_t(0));
    rng_.set_state(position_.rng);
    if (order_ == WindowOrder::shuffled)
      for (std::size_t i = count - 1; i > 0; --i) std::swap(windows_[i], windows_[rng_.below(i + 1)]);
  }

  const std::vector<std::int32_t>* tokens_;
  index_t T_, B_;
  int replica_, replicas_;
  WindowOrder order_;
  WindowPosition position_;
  Rng rng_;
  std::int64_t batches_ = 0;
  std::vector<std::uint64_t> windows_;  ///< this epoch's order: window indices
};

}  // namespace cupipe::io
