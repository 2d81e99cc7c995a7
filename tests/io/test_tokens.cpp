// SPDX-License-Identifier: Apache-2.0
// Token data: byte-level text from a file or a folder, llm.c shards and every way one can be wrong,
// the held-out split, and windows (in order or shuffled per epoch) sharded across replicas with a
// resumable position.
#include <catch2/catch.hpp>

#include <algorithm>
#include <numeric>
#include <set>

#include "cupipe/io/tokens.hpp"
#include "io_test_support.hpp"

using namespace cupipe;
using namespace cupipe::io;
using namespace cupipe::io::testing;
using Catch::Contains;

namespace {
std::string error_of(auto&& call) {
  try {
    call();
  } catch (const cupipe::error& e) {
    return e.what();
  }
  return "no error";
}
Bytes text_bytes(const std::string& s) { return Bytes(s.begin(), s.end()); }
}  // namespace

TEST_CASE("text: a file's bytes are its tokens, a folder's files are read in order, index files skipped",
          "[io][tokens]") {
  TempDir dir;
  write_bytes(dir / "b", text_bytes("world\n"));
  write_bytes(dir / "a", text_bytes("hello \xc3\xa9"));
  write_bytes(dir / "a.dat", text_bytes("INDEX"));
  std::filesystem::create_directories(dir / "sub");
  write_bytes(dir / "sub" / "c", text_bytes("!"));
  std::filesystem::create_symlink(dir / "a", dir / "a.u8");  // fortune's links to the same text

  const TokenCorpus one = load_text(dir / "b");
  CHECK(one.tokens == std::vector<std::int32_t>{'w', 'o', 'r', 'l', 'd', '\n'});
  CHECK(one.vocab == 256);
  const TokenCorpus all = load_text(dir.path());
  CHECK(all.files == 3);
  std::string joined;
  for (std::int32_t t : all.tokens) joined += char(t);
  CHECK(joined == "hello \xc3\xa9world\n!");
  CHECK(all.tokens[6] == 0xc3);  // bytes, unsigned

  CHECK_THAT(error_of([&] { load_text(dir / "missing"); }), Contains("missing: no such file or folder"));
  TempDir empty;
  CHECK_THAT(error_of([&] { load_text(empty.path()); }), Contains("the folder holds no text files"));
  write_bytes(empty / "x", text_bytes("x"));
  CHECK_THAT(error_of([&] { load_text(empty / "x"); }), Contains("1 bytes of text; training needs at least 2"));
}

TEST_CASE("llm.c shards: written and read back, a bad magic, version, size or token is named with the file",
          "[io][tokens]") {
  TempDir dir;
  std::vector<std::int32_t> tokens(1000);
  std::iota(tokens.begin(), tokens.end(), 50000);  // above 2^15: read as unsigned 16-bit
  write_llmc_shard(dir / "shard_000.bin", tokens);
  write_llmc_shard(dir / "shard_001.bin", {1, 2, 3});
  write_bytes(dir / "notes.txt", text_bytes("not a shard"));
  CHECK(load_llmc_shards(dir / "shard_000.bin", 51000).tokens == tokens);
  const TokenCorpus both = load_llmc_shards(dir.path(), 51000);
  CHECK(both.files == 2);
  REQUIRE(both.tokens.size() == 1003);
  CHECK(both.tokens.back() == 3);

  const Bytes good = read_bytes(dir / "shard_001.bin");
  auto variant = [&](const std::string& name, auto&& edit) {
    Bytes b = good;
    edit(b);
    write_bytes(dir / name, b);
    return error_of([&] { load_llmc_shards(dir / name, 51000); });
  };
  CHECK_THAT(variant("magic.bin", [](Bytes& b) { b[0] ^= 1; }),
             Contains("magic.bin: magic number 20240521, expected 20240520 (not an llm.c token shard)"));
  CHECK_THAT(variant("version.bin", [](Bytes& b) { b[4] = 2; }), Contains("version.bin: version 2; only version 1"));
  CHECK_THAT(variant("short.bin", [](Bytes& b) { b.pop_back(); }),
             Contains("short.bin: truncated: the header says 3 tokens (6 bytes) but the file holds 5 bytes"));
  CHECK_THAT(variant("long.bin", [](Bytes& b) { b.push_back(0); b.push_back(0); }),
             Contains("long.bin: count mismatch: the header says 3 tokens (6 bytes) but the file holds 8 bytes"));
  CHECK_THAT(variant("header.bin", [](Bytes& b) { b.resize(100); }),
             Contains("header.bin: truncated header: 100 bytes, an llm.c token shard starts with 1024"));
  CHECK_THAT(error_of([&] { load_llmc_shards(dir / "shard_000.bin", 50500); }),
             Contains("shard_000.bin: token 50500 at position 500 is outside the model's vocabulary [0, 50500)"));
}

TEST_CASE("held-out split and windows in order: fixed split, whole windows, replicas disjoint, position resumes",
          "[io][tokens]") {
  TokenCorpus corpus;
  corpus.tokens.resize(1001);
  std::iota(corpus.tokens.begin(), corpus.tokens.end(), 0);
  const TokenSplit split = split_held_out(corpus, 0.1);
  CHECK(split.train.size() == 901);
  CHECK(split.held_out.front() == 901);

  // 1000 tokens after the first: 100 windows of 10 + 1 tokens; an epoch is 16 batches of 3 x 2.
  WindowLoader a(corpus.tokens, 10, 3, 0, 2, {}, WindowOrder::in_order), b(corpus.tokens, 10, 3, 1, 2, {}, WindowOrder::in_order);
  CHECK(a.windows() == 100);
  CHECK(a.batches_per_epoch() == 16);
  std::vector<std::int32_t> xa, ya, xb, yb;
  std::set<std::int32_t> starts;
  for (int step = 0; step < 16; ++step) {
    a.next(xa, ya);
    b.next(xb, yb);
    REQUIRE(xa.size() == 30);
    CHECK(xa[0] == 60 * step);  // consecutive windows: replica 0 the first 3 of each 6, replica 1 the next 3
    CHECK(xb[0] == 60 * step + 30);
    for (index_t s = 0; s < 3; ++s) {
      CHECK(xa[std::size_t(s * 10)] % 10 == 0);  // each row of 10 is one window
      starts.insert(xa[std::size_t(s * 10)]);
      starts.insert(xb[std::size_t(s * 10)]);
      for (index_t t = 0; t < 10; ++t) CHECK(ya[std::size_t(s * 10 + t)] == xa[std::size_t(s * 10 + t)] + 1);
    }
  }
  CHECK(starts.size() == 96);  // every window of the epoch's 16 batches once, no replica overlap
  CHECK(a.position().epoch == 0);
  CHECK(a.position().batch == 16);
  WindowLoader resumed(corpus.tokens, 10, 3, 0, 2, a.position(), WindowOrder::in_order);
  std::vector<std::int32_t> xr, yr;
  a.next(xa, ya);
  resumed.next(xr, yr);
  CHECK(xr == xa);
  CHECK(xa[0] == 0);  // the next epoch starts again at window 0; windows 96..99 wait
  CHECK(xa[10] == 10);
  CHECK(a.position().epoch == 1);
  CHECK(a.position().batch == 1);
  CHECK_THAT(error_of([&] { WindowLoader(corpus.tokens, 100, 6, 0, 2); }),
             Contains("1001 tokens give 10 windows of 101 tokens, fewer than one batch of 6 x 2 replicas"));
}

namespace {
/// The first token of each row of the next `batches` batches: the windows' starts, in order.
std::vector<std::int32_t> window_starts(WindowLoader& loader, int batches, index_t context) {
  std::vector<std::int32_t> starts, x, y;
  for (int b = 0; b < batches; ++b) {
    loader.next(x, y);
    for (std::size_t row = 0; row < x.size(); row += std::size_t(context)) starts.push_back(x[row]);
  }
  return starts;
}
}  // namespace

TEST_CASE("shuffled windows: a seeded permutation per epoch, replicas disjoint and covering it, resumed exactly",
          "[io][tokens]") {
  std::vector<std::int32_t> tokens(1001);  // 100 windows of 10 + 1 tokens
  std::iota(tokens.begin(), tokens.end(), 0);
  WindowLoader one(tokens, 10, 10, 0, 1, WindowPosition::start(7));
  CHECK(one.batches_per_epoch() == 10);
  const std::vector<std::int32_t> epoch0 = window_starts(one, 10, 10), epoch1 = window_starts(one, 10, 10);

  // Each epoch is a permutation of all 100 windows, not the corpus's order, and a new one each epoch.
  for (const auto* epoch : {&epoch0, &epoch1}) {
    REQUIRE(epoch->size() == 100);
    std::vector<std::int32_t> sorted = *epoch;
    std::sort(sorted.begin(), sorted.end());
    for (std::size_t w = 0; w < sorted.size(); ++w) CHECK(sorted[w] == std::int32_t(10 * w));
    std::vector<std::int32_t> in_order(sorted);
    CHECK(*epoch != in_order);
  }
  CHECK(epoch0 != epoch1);
  CHECK(one.position().epoch == 1);

  // Rows are whole windows: labels are the inputs shifted by one token.
  std::vector<std::int32_t> x, y;
  WindowLoader rows(tokens, 10, 4, 0, 1, WindowPosition::start(7));
  rows.next(x, y);
  for (std::size_t i = 0; i < x.size(); ++i) CHECK(y[i] == x[i] + 1);
  CHECK(x[0] == epoch0[0]);

  // Deterministic per seed; another seed, another order.
  WindowLoader again(tokens, 10, 10, 0, 1, WindowPosition::start(7)), other(tokens, 10, 10, 0, 1, WindowPosition::start(8));
  CHECK(window_starts(again, 10, 10) == epoch0);
  CHECK(window_starts(other, 10, 10) != epoch0);

  // Two replicas of 5 take the one process's batches of 10: disjoint halves, covering each epoch.
  WindowLoader r0(tokens, 10, 5, 0, 2, WindowPosition::start(7)), r1(tokens, 10, 5, 1, 2, WindowPosition::start(7));
  for (int epoch = 0; epoch < 2; ++epoch) {
    const std::vector<std::int32_t>& whole = epoch == 0 ? epoch0 : epoch1;
    std::set<std::int32_t> seen;
    for (int b = 0; b < 10; ++b) {
      const std::vector<std::int32_t> mine = window_starts(r0, 1, 10), theirs = window_starts(r1, 1, 10);
      CHECK(std::equal(mine.begin(), mine.end(), whole.begin() + 10 * b));
      CHECK(std::equal(theirs.begin(), theirs.end(), whole.begin() + 10 * b + 5));
      seen.insert(mine.begin(), mine.end());
      seen.insert(theirs.begin(), theirs.end());
    }
    CHECK(seen.size() == 100);
  }
  CHECK(r0.position() == r1.position());

  // A loader built from a saved position gives what the uninterrupted one gives next: within an
  // epoch, at its end, and into the next.
  for (const int stop : {3, 10, 13}) {
    WindowLoader straight(tokens, 10, 5, 1, 2, WindowPosition::start(7));
    window_starts(straight, stop, 10);
    WindowLoader resumed(tokens, 10, 5, 1, 2, straight.position());
    CHECK(window_starts(resumed, 15, 10) == window_starts(straight, 15, 10));
  }

  // Windows past the epoch's last whole batch wait: 103 windows make 10 batches of 10, each distinct.
  std::vector<std::int32_t> more(1031);
  std::iota(more.begin(), more.end(), 0);
  WindowLoader leftover(more, 10, 10, 0, 1, WindowPosition::start(1));
  CHECK(leftover.windows() == 103);
  const std::vector<std::int32_t> first = window_starts(leftover, 10, 10);
  CHECK(std::set<std::int32_t>(first.begin(), first.end()).size() == 100);
  CHECK(leftover.position().batch == 10);

  CHECK_THAT(error_of([&] { WindowLoader(tokens, 10, 10, 0, 1, WindowPosition{WindowPosition::start(7).rng, 0, 11}); }),
             Contains("the position is batch 11 of epoch 0, but an epoch of 100 windows has 10 batches of 10 x 1 replicas"));
}
