// SPDX-License-Identifier: Apache-2.0
// Writes the fuzz targets' seed corpus: valid inputs of every kind the parsers accept, and the
// hostile cases issue #17 found (deep nesting, edited checkpoint metadata), one folder per target.
//   fuzz_seed_corpus DIR   ->  DIR/safetensors/*  DIR/idx/*  DIR/checkpoint/*
#include <zlib.h>

#include <cstdio>
#include <iterator>
#include <map>
#include <string>
#include <vector>

#include "fuzz_support.hpp"

namespace fs = std::filesystem;
using namespace cupipe;

namespace {

std::vector<std::uint8_t> read_all(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

void write_bytes(const fs::path& path, const std::vector<std::uint8_t>& bytes) { fuzz::write(path, bytes.data(), bytes.size()); }

void write_gzip(const fs::path& path, const std::vector<std::uint8_t>& bytes) {
  gzFile out = gzopen(path.c_str(), "wb");
  if (!out || gzwrite(out, bytes.data(), unsigned(bytes.size())) != int(bytes.size()) || gzclose(out) != Z_OK)
    throw std::runtime_error("cannot write " + path.string());
}

/// An IDX file of unsigned bytes with the given extents, filled with a counter.
std::vector<std::uint8_t> idx(const std::vector<std::uint32_t>& shape) {
  std::vector<std::uint8_t> out{0, 0, 0x08, std::uint8_t(shape.size())};
  std::size_t n = 1;
  for (std::uint32_t e : shape) {
    for (int b = 3; b >= 0; --b) out.push_back(std::uint8_t(e >> (8 * b)));
    n *= e;
  }
  for (std::size_t i = 0; i < n; ++i) out.push_back(std::uint8_t(i * 7));
  return out;
}

/// The checkpoint target's input: a 4-byte little-endian length, the model file, the state file.
std::vector<std::uint8_t> pair(const std::vector<std::uint8_t>& model, const std::vector<std::uint8_t>& state) {
  std::vector<std::uint8_t> out(4 + model.size() + state.size());
  for (std::size_t b = 0; b < 4; ++b) out[b] = std::uint8_t(model.size() >> (8 * b));
  std::copy(model.begin(), model.end(), out.begin() + 4);
  std::copy(state.begin(), state.end(), out.begin() + 4 + std::ptrdiff_t(model.size()));
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: fuzz_seed_corpus DIR\n");
    return 2;
  }
  try {
    const fs::path dir(argv[1]);
    for (const char* target : {"safetensors", "idx", "checkpoint"}) fs::create_directories(dir / target);
    const fs::path work = fuzz::scratch();

    // A real checkpoint of the checkpoint target's model, after two AdamW steps.
    fuzz::CheckpointPipeline pipe({.microbatches = 2, .seed = 3});
    optim::AdamW adamw;
    std::vector<float> x(8 * 4);
    std::vector<std::int32_t> y(8);
    Rng rng(4);
    for (float& v : x) v = float(rng.normal());
    for (auto& v : y) v = std::int32_t(rng.below(3));
    for (int step = 0; step < 2; ++step)
      pipe.train_step(ConstView<float>{x.data(), Shape{8, 4}}, ConstView<std::int32_t>{y.data(), Shape{8}}, adamw);
    io::TrainingState state;
    state.updates = pipe.updates();
    state.epoch = 1;
    state.batch = 2;
    io::save_checkpoint(work / "ckpt", pipe, adamw, state);
    const auto model = read_all(io::model_file(work / "ckpt"));
    const auto state_bytes = read_all(io::state_file(work / "ckpt"));
    write_bytes(dir / "safetensors" / "model", model);
    write_bytes(dir / "safetensors" / "state", state_bytes);
    write_bytes(dir / "checkpoint" / "pair", pair(model, state_bytes));

    // Edited metadata, re-checksummed (the checksum catches accidents, not edits).
    const io::SafetensorsFile state_file = io::SafetensorsFile::load(io::state_file(work / "ckpt"));
    std::vector<io::TensorEntry> tensors;
    for (const std::string& name : state_file.names()) tensors.push_back(state_file.at(name));
    const std::map<std::string, std::string> edits{{"batch", "-1000"}, {"rng", "0 0 0 0"},
                                                   {"updates", "9223372036854775807"}, {"epoch", "-3"}};
    for (const auto& [key, value] : edits) {
      std::map<std::string, std::string> meta = state_file.metadata();
      meta[key] = value;
      meta.erase("checksum");
      io::detail::save_with_checksum(work / "edited.safetensors", tensors, meta);
      write_bytes(dir / "checkpoint" / ("edited_" + key), pair(model, read_all(work / "edited.safetensors")));
    }

    // Every dtype, metadata, an empty tensor.
    const std::vector<io::TensorEntry> kinds{
        io::make_entry("f32", {2, 2}, std::vector<float>{1, 2, 3, 4}),
        io::make_entry("f64", {3}, std::vector<double>{1, 2, 3}),
        io::make_entry("bf16", {2}, std::vector<cupipe::bfloat16>{cupipe::bfloat16(1.0f), cupipe::bfloat16(-2.0f)}),
        io::make_entry("i32", {1, 2}, std::vector<std::int32_t>{7, -7}),
        io::make_entry("i64", {1}, std::vector<std::int64_t>{1LL << 40}),
        io::make_entry("u8", {4}, std::vector<std::uint8_t>{0, 1, 2, 255}),
        io::make_entry("empty", {0, 3}, std::vector<float>{})};
    io::save_safetensors(work / "kinds.safetensors", std::span<const io::TensorEntry>(kinds),
                         {{"format", "pt"}, {"note", "seed"}});
    write_bytes(dir / "safetensors" / "every_dtype", read_all(work / "kinds.safetensors"));

    // Nested 20 deep in a shape (the loader allows 16): 8-byte length, then the header.
    std::string header = "{\"t\":{\"dtype\":\"F32\",\"shape\":" + std::string(20, '[') + std::string(20, ']') +
                         ",\"data_offsets\":[0,0]}}";
    std::vector<std::uint8_t> nested;
    for (int b = 0; b < 8; ++b) nested.push_back(std::uint8_t(header.size() >> (8 * b)));
    nested.insert(nested.end(), header.begin(), header.end());
    write_bytes(dir / "safetensors" / "deep_nesting", nested);

    // IDX: labels, images, rank 4, gzip.
    write_bytes(dir / "idx" / "labels", idx({10}));
    write_bytes(dir / "idx" / "images", idx({3, 4, 5}));
    write_bytes(dir / "idx" / "rank4", idx({2, 2, 2, 2}));
    write_gzip(dir / "idx" / "images_gz", idx({3, 4, 5}));
    std::printf("seed corpus written to %s\n", dir.c_str());
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "fuzz_seed_corpus: %s\n", e.what());
    return 1;
  }
}
