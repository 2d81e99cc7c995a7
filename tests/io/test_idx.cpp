// SPDX-License-Identifier: Apache-2.0
// IDX files (plain and gzip), their corruptions, and the Fashion-MNIST loader on made-up and real data.
#include <catch2/catch.hpp>

#include <algorithm>
#include <numeric>

#include "cupipe/io/io.hpp"
#include "io_test_support.hpp"

using namespace cupipe;
using namespace cupipe::io;
using namespace cupipe::io::testing;
using Catch::Contains;

namespace {

/// An IDX file of unsigned bytes: 0 0 0x08 rank, big-endian extents, data.
Bytes idx_bytes(const std::vector<std::uint32_t>& shape, const Bytes& data) {
  Bytes out{0, 0, 0x08, std::uint8_t(shape.size())};
  for (std::uint32_t extent : shape)
    for (int shift : {24, 16, 8, 0}) out.push_back(std::uint8_t(extent >> shift));
  out.insert(out.end(), data.begin(), data.end());
  return out;
}

Bytes iota_bytes(std::size_t n) {
  Bytes out(n);
  std::iota(out.begin(), out.end(), std::uint8_t(0));
  return out;
}

Bytes gzip_bytes(const TempDir& dir, const Bytes& content) {
  write_gzip(dir / "scratch.gz", content);
  return read_bytes(dir / "scratch.gz");
}

/// Writes `bytes` to dir/name and reads it as IDX.
IdxArray read_written(const TempDir& dir, const std::string& name, const Bytes& bytes) {
  write_bytes(dir / name, bytes);
  return read_idx(dir / name);
}

}  // namespace

TEST_CASE("read_idx reads plain and gzip files of rank 1 to 4", "[cpu][io][idx]") {
  TempDir dir;
  for (const auto& shape : std::vector<std::vector<std::uint32_t>>{{5}, {3, 4}, {2, 3, 4}, {2, 1, 3, 2}, {0, 28}}) {
    const std::size_t n = std::accumulate(shape.begin(), shape.end(), std::size_t{1}, std::multiplies<>());
    const Bytes file = idx_bytes(shape, iota_bytes(n));
    const std::vector<std::int64_t> expected_shape(shape.begin(), shape.end());
    // The name says nothing: gzip is recognised by its magic bytes.
    const IdxArray plain = read_written(dir, "plain.idx", file);
    const IdxArray zipped = read_written(dir, "zipped.idx", gzip_bytes(dir, file));
    CHECK(plain.shape == expected_shape);
    CHECK(plain.data == iota_bytes(n));
    CHECK(zipped.shape == expected_shape);
    CHECK(zipped.data == iota_bytes(n));
  }
}

TEST_CASE("read_idx reads a large gzip file and concatenated gzip members", "[cpu][io][idx]") {
  TempDir dir;
  Bytes data(3 * 300 * 400);
  for (std::size_t i = 0; i < data.size(); ++i) data[i] = std::uint8_t((i * 7919) >> 5);
  const Bytes file = idx_bytes({3, 300, 400}, data);
  CHECK(read_written(dir, "big.gz", gzip_bytes(dir, file)).data == data);

  const std::size_t half = file.size() / 2;
  Bytes members = gzip_bytes(dir, Bytes(file.begin(), file.begin() + half));
  const Bytes second = gzip_bytes(dir, Bytes(file.begin() + half, file.end()));
  members.insert(members.end(), second.begin(), second.end());
  CHECK(read_written(dir, "members.gz", members).data == data);
}

TEST_CASE("read_idx rejects bad headers", "[cpu][io][idx]") {
  TempDir dir;
  REQUIRE_THROWS_WITH(read_idx(dir / "missing-idx1-ubyte"), Contains("missing-idx1-ubyte: cannot open: No such file"));
  REQUIRE_THROWS_WITH(read_idx(dir.path()), Contains("not a regular file (it is a directory)"));
  REQUIRE_THROWS_WITH(read_written(dir, "short", Bytes{0, 0, 8}),
                      Contains("short: truncated header: the file has 3 bytes, an IDX header needs at least 4"));
  REQUIRE_THROWS_WITH(read_written(dir, "magic", Bytes{0x50, 0x4b, 0x03, 0x04, 0, 0, 0, 0}),
                      Contains("magic: not an IDX file: it starts with 0x50 0x4b, expected 0x00 0x00"));
  REQUIRE_THROWS_WITH(read_written(dir, "float", Bytes{0, 0, 0x0d, 1, 0, 0, 0, 1, 0, 0, 0x80, 0x3f}),
                      Contains("float: element type 0x0d (float32) is not supported; cupipe reads only 0x08"));
  REQUIRE_THROWS_WITH(read_written(dir, "type", Bytes{0, 0, 0x42, 1, 0, 0, 0, 0}),
                      Contains("element type 0x42 is not an IDX type"));
  REQUIRE_THROWS_WITH(read_written(dir, "rank0", Bytes{0, 0, 8, 0}),
                      Contains("rank0: rank 0 is not supported; expected 1 to 4 dimensions"));
  REQUIRE_THROWS_WITH(read_written(dir, "rank5", idx_bytes({1, 1, 1, 1, 1}, {7})), Contains("rank 5 is not supported"));
  REQUIRE_THROWS_WITH(read_written(dir, "cut-header", Bytes{0, 0, 8, 3, 0, 0, 0, 2, 0, 0}),
                      Contains("cut-header: truncated header: rank 3 needs 16 header bytes but the file has 10"));
  REQUIRE_THROWS_WITH(read_written(dir, "huge", idx_bytes({0xffffffff, 0xffffffff, 0xffffffff}, {})),
                      Contains("more bytes than fit in 64 bits"));
}

TEST_CASE("read_idx rejects truncated data and trailing garbage", "[cpu][io][idx]") {
  TempDir dir;
  const Bytes good = idx_bytes({3, 4, 5}, iota_bytes(60));
  const Bytes cut(good.begin(), good.begin() + 50);
  Bytes longer = good;
  longer.insert(longer.end(), {1, 2, 3});

  REQUIRE_THROWS_WITH(read_written(dir, "cut", cut),
                      Contains("cut: truncated: header says 3 items of 4x5 (76 bytes) but the file has 50 bytes"));
  REQUIRE_THROWS_WITH(read_written(dir, "cut.gz", gzip_bytes(dir, cut)),
                      Contains("cut.gz: truncated: header says 3 items of 4x5 (76 bytes) but the file has 50 bytes "
                               "after gunzip"));
  REQUIRE_THROWS_WITH(read_written(dir, "long", longer),
                      Contains("long: 3 extra bytes after the data: header says 3 items of 4x5 (76 bytes) but the "
                               "file has 79 bytes"));
  REQUIRE_THROWS_WITH(read_written(dir, "long.gz", gzip_bytes(dir, longer)),
                      Contains("long.gz: 3 extra bytes after the data") && Contains("79 bytes after gunzip"));
  REQUIRE_THROWS_WITH(read_written(dir, "labels", idx_bytes({10}, iota_bytes(4))),
                      Contains("header says 10 items (18 bytes) but the file has 12 bytes"));
}

TEST_CASE("read_idx rejects corrupted gzip streams", "[cpu][io][idx]") {
  TempDir dir;
  Bytes data(5000);
  for (std::size_t i = 0; i < data.size(); ++i) data[i] = std::uint8_t(i * i % 251);
  const Bytes zipped = gzip_bytes(dir, idx_bytes({5, 1000}, data));

  Bytes body_flipped = zipped;
  for (std::size_t i = 20; i < 40; ++i) body_flipped[i] ^= 0xa5;
  REQUIRE_THROWS_WITH(read_written(dir, "flipped.gz", body_flipped), Contains("flipped.gz: corrupted gzip stream"));

  Bytes crc_flipped = zipped;
  crc_flipped[zipped.size() - 6] ^= 0x01;  // the CRC-32 in the trailer
  REQUIRE_THROWS_WITH(read_written(dir, "crc.gz", crc_flipped),
                      Contains("crc.gz: corrupted gzip stream after") && Contains("incorrect data check"));

  REQUIRE_THROWS_WITH(read_written(dir, "cut.gz", Bytes(zipped.begin(), zipped.begin() + zipped.size() / 2)),
                      Contains("cut.gz: truncated gzip stream: the file ends after"));
  REQUIRE_THROWS_WITH(read_written(dir, "head.gz", Bytes{0x1f, 0x8b}), Contains("head.gz: truncated gzip stream"));

  Bytes garbage = zipped;
  garbage.insert(garbage.end(), {'j', 'u', 'n', 'k'});
  REQUIRE_THROWS_WITH(read_written(dir, "garbage.gz", garbage),
                      Contains("garbage.gz: 4 bytes of garbage after the end of the gzip stream"));

  SECTION("no single bit flip or truncation crashes the reader") {
    const Bytes plain = idx_bytes({2, 3, 4}, iota_bytes(24));
    for (const Bytes& good : {plain, gzip_bytes(dir, plain)}) {
      for (std::size_t at = 0; at < good.size(); ++at) {
        for (int bit = 0; bit < 8; ++bit) {
          Bytes bad = good;
          bad[at] ^= std::uint8_t(1u << bit);
          try {
            (void)read_written(dir, "fuzz", bad);
          } catch (const cupipe::error&) {
          }
        }
        try {
          (void)read_written(dir, "fuzz", Bytes(good.begin(), good.begin() + static_cast<std::ptrdiff_t>(at)));
        } catch (const cupipe::error&) {
        }
      }
    }
  }
}

namespace {

/// A made-up Fashion-MNIST folder: images whose pixel i of image n is (n + i) % 256, labels n % 10.
void write_fake_split(const TempDir& dir, const std::string& prefix, std::uint32_t count, bool gzip,
                      std::uint32_t side = 28, std::uint32_t label_count = 0, std::uint8_t label_offset = 0) {
  Bytes pixels(std::size_t(count) * side * side);
  for (std::size_t i = 0; i < pixels.size(); ++i) pixels[i] = std::uint8_t(i / (side * side) + i % (side * side));
  if (label_count == 0) label_count = count;
  Bytes labels(label_count);
  for (std::uint32_t n = 0; n < label_count; ++n) labels[n] = std::uint8_t(n % 10 + label_offset);
  const auto put = [&](const std::string& stem, const Bytes& bytes) {
    if (gzip) write_gzip(dir / (stem + ".gz"), bytes);
    else write_bytes(dir / stem, bytes);
  };
  put(prefix + "-images-idx3-ubyte", idx_bytes({count, side, side}, pixels));
  put(prefix + "-labels-idx1-ubyte", idx_bytes({label_count}, labels));
}

}  // namespace

TEST_CASE("load_fashion_mnist reads gzip or plain files and scales pixels", "[cpu][io][fashion_mnist]") {
  TempDir dir;
  write_fake_split(dir, "train", 12, true);
  write_fake_split(dir, "t10k", 3, false);
  const FashionMnist data = load_fashion_mnist(dir.path());
  CHECK(data.train.count == 12);
  CHECK(data.test.count == 3);
  CHECK(data.train.features == 784);
  CHECK(data.train.images.size() == 12 * 784);
  CHECK(data.test.labels == std::vector<std::int32_t>{0, 1, 2});
  CHECK(data.train.labels[11] == 1);
  CHECK(data.train.images[1] == Approx(1.0f / 255.0f));
  CHECK(data.train.images[784 + 254] == 1.0f);  // image 1, pixel 254: 255
  CHECK(data.train.images[784 + 255] == 0.0f);  // wraps to 0

  const Dataset middle = take(data.train, 10, 2);
  CHECK(middle.count == 2);
  CHECK(middle.labels == std::vector<std::int32_t>{0, 1});
  CHECK(middle.images == std::vector<float>(data.train.images.begin() + 10 * 784, data.train.images.end()));
  CHECK(take(data.train, 12, 0).count == 0);
  REQUIRE_THROWS_WITH(take(data.train, 10, 3), Contains("take: rows [10, 13) are outside the dataset's 12 rows"));
  REQUIRE_THROWS_WITH(take(data.train, -1, 1), Contains("outside the dataset's 12 rows"));
}

TEST_CASE("load_fashion_mnist names the file at fault", "[cpu][io][fashion_mnist]") {
  TempDir dir;
  REQUIRE_THROWS_WITH(load_fashion_mnist(dir / "nowhere"), Contains("nowhere: not a directory"));
  write_fake_split(dir, "train", 4, true);
  REQUIRE_THROWS_WITH(load_fashion_mnist(dir.path()),
                      Contains("no t10k-images-idx3-ubyte.gz or t10k-images-idx3-ubyte; expected the four"));

  write_fake_split(dir, "t10k", 4, true, 28, 5);
  REQUIRE_THROWS_WITH(load_fashion_mnist(dir.path()),
                      Contains("t10k-labels-idx1-ubyte.gz: has 5 labels but") &&
                          Contains("t10k-images-idx3-ubyte.gz has 4 images"));
  write_fake_split(dir, "t10k", 4, true, 28, 0, 7);
  REQUIRE_THROWS_WITH(load_fashion_mnist(dir.path()),
                      Contains("t10k-labels-idx1-ubyte.gz: label 10 at index 3 is outside the classes 0..9"));
  write_fake_split(dir, "t10k", 4, true, 27);
  REQUIRE_THROWS_WITH(load_fashion_mnist(dir.path()),
                      Contains("t10k-images-idx3-ubyte.gz: expected images of shape (N, 28, 28) but the file holds "
                               "(4, 27, 27)"));
  write_fake_split(dir, "t10k", 4, true);
  write_bytes(dir / "t10k-labels-idx1-ubyte.gz", idx_bytes({2, 2}, iota_bytes(4)));
  REQUIRE_THROWS_WITH(load_fashion_mnist(dir.path()),
                      Contains("t10k-labels-idx1-ubyte.gz: expected labels of shape (N,) but the file holds (2, 2)"));
}

TEST_CASE("load_fashion_mnist reads the real dataset when it is installed", "[cpu][io][fashion_mnist]") {
  const std::filesystem::path dir = fashion_mnist_default_dir;
  if (!std::filesystem::exists(dir / "train-images-idx3-ubyte.gz") && !std::filesystem::exists(dir / "train-images-idx3-ubyte")) {
    WARN("Fashion-MNIST is not installed in " << dir << " (apt install dataset-fashion-mnist); skipping");
    return;
  }
  const FashionMnist data = load_fashion_mnist(dir);
  REQUIRE(data.train.count == 60000);
  REQUIRE(data.test.count == 10000);
  CHECK(data.train.images.size() == std::size_t(60000) * 784);
  CHECK(data.test.images.size() == std::size_t(10000) * 784);
  for (const Dataset* split : {&data.train, &data.test}) {
    std::vector<std::int64_t> per_class(10, 0);
    for (std::int32_t label : split->labels) ++per_class.at(static_cast<std::size_t>(label));
    // Fashion-MNIST is balanced: every class has a tenth of the images.
    CHECK(per_class == std::vector<std::int64_t>(10, split->count / 10));
    CHECK(split->labels[0] == 9);  // the first image of each split is an ankle boot
    const auto [lo, hi] = std::minmax_element(split->images.begin(), split->images.end());
    CHECK(*lo == 0.0f);
    CHECK(*hi == 1.0f);
  }
}
