// SPDX-License-Identifier: Apache-2.0
// Token data: byte-level text from a file or a folder, llm.c shards and every way one can be wrong,
// the held-out split, and windows sharded across replicas with a resumable position.
#include <catch2/catch.hpp>

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

TEST_CASE("held-out split and windows: fixed split, whole windows, replicas disjoint, position resumes",
          "[io][tokens]") {
  TokenCorpus corpus;
  corpus.tokens.resize(1001);
  std::iota(corpus.tokens.begin(), corpus.tokens.end(), 0);
  const TokenSplit split = split_held_out(corpus, 0.1);
  CHECK(split.train.size() == 901);
  CHECK(split.held_out.front() == 901);

  // 1000 tokens after the first: 100 windows of 10 + 1 tokens.
  WindowLoader a(corpus.tokens, 10, 3, 0, 2), b(corpus.tokens, 10, 3, 1, 2);
  CHECK(a.windows() == 100);
  std::vector<std::int32_t> xa, ya, xb, yb;
  std::set<std::int32_t> starts;
  for (int step = 0; step < 16; ++step) {  // 16 * 6 = 96 windows: no wrap yet
    a.next(xa, ya);
    b.next(xb, yb);
    REQUIRE(xa.size() == 30);
    for (index_t s = 0; s < 3; ++s) {
      CHECK(xa[std::size_t(s * 10)] % 10 == 0);  // each row of 10 is one window
      starts.insert(xa[std::size_t(s * 10)]);
      starts.insert(xb[std::size_t(s * 10)]);
      for (index_t t = 0; t < 10; ++t) CHECK(ya[std::size_t(s * 10 + t)] == xa[std::size_t(s * 10 + t)] + 1);
    }
  }
  CHECK(starts.size() == 96);  // every window once, no replica overlap
  CHECK(a.position() == 96);
  WindowLoader resumed(corpus.tokens, 10, 3, 0, 2, a.position());
  std::vector<std::int32_t> xr, yr;
  a.next(xa, ya);
  resumed.next(xr, yr);
  CHECK(xr == xa);
  CHECK(xa[0] == 960);
  CHECK(xa[10] == 970);
  CHECK(xa[20] == 980);
  CHECK(a.position() == 2);  // wrapped around
  CHECK_THAT(error_of([&] { WindowLoader(corpus.tokens, 100, 6, 0, 2); }),
             Contains("1001 tokens give 10 windows of 101 tokens, fewer than one batch of 6 x 2 replicas"));
}
