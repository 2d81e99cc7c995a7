// SPDX-License-Identifier: Apache-2.0
// Writes the fuzz targets' seed corpus: valid inputs of every kind the parsers accept, and hostile
// cases (issue #17's: deep nesting, edited checkpoint metadata; issue #61's: counts and numbers out
// of range, wrong shapes and headers), one folder per target. Each seed is small (the largest, a
// trained checkpoint, is a few kB), so that libFuzzer mutates all of it.
//   fuzz_seed_corpus DIR   ->  DIR/safetensors/*  DIR/idx/*  DIR/checkpoint/*  DIR/llmc_shard/*
//                             DIR/plan_file/*  DIR/cost_model/*  DIR/gpt_import/*
#include <zlib.h>

#include <array>
#include <cstdio>
#include <cstring>
#include <iterator>
#include <map>
#include <string>
#include <vector>

#include "checkpoint_model.hpp"
#include "cupipe/planner/cost_json.hpp"
#include "fuzz_support.hpp"

namespace fs = std::filesystem;
using namespace cupipe;

namespace {

std::vector<std::uint8_t> read_all(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

void write_bytes(const fs::path& path, const std::vector<std::uint8_t>& bytes) { fuzz::write(path, bytes.data(), bytes.size()); }

void write_text(const fs::path& path, const std::string& text) {
  fuzz::write(path, reinterpret_cast<const std::uint8_t*>(text.data()), text.size());
}

/// `depth` nested JSON arrays around 0: deeper than any file of these formats nests.
std::string nested_json(int depth) { return std::string(std::size_t(depth), '[') + "0" + std::string(std::size_t(depth), ']'); }

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

/// llm.c shards: valid ones, then each way a header or payload can be wrong.
void write_llmc_shards(const fs::path& dir, const fs::path& work) {
  io::write_llmc_shard(work / "shard.bin", {0, 1, 2, 50256, 464, 3290, 318, 7});  // 50256: GPT-2's <|endoftext|>
  const std::vector<std::uint8_t> valid = read_all(work / "shard.bin");
  write_bytes(dir / "valid", valid);
  const auto edited = [&](std::size_t field, std::int32_t value) {
    std::vector<std::uint8_t> out = valid;
    for (int b = 0; b < 4; ++b) out[4 * field + std::size_t(b)] = std::uint8_t(std::uint32_t(value) >> (8 * b));
    return out;
  };
  write_bytes(dir / "wrong_magic", edited(0, 20240801));
  write_bytes(dir / "version_2", edited(1, 2));
  write_bytes(dir / "negative_count", edited(2, -1));
  write_bytes(dir / "count_beyond_file", edited(2, 0x7fffffff));
  write_bytes(dir / "count_short_of_file", edited(2, 3));
  io::write_llmc_shard(work / "empty.bin", {});
  write_bytes(dir / "no_tokens", read_all(work / "empty.bin"));
  std::vector<std::uint8_t> outside = valid;
  outside[io::llmc_header_bytes] = outside[io::llmc_header_bytes + 1] = 0xff;  // token 65535
  write_bytes(dir / "token_outside_vocab", outside);
  write_bytes(dir / "truncated_header", std::vector<std::uint8_t>(valid.begin(), valid.begin() + 100));
  write_bytes(dir / "odd_payload", std::vector<std::uint8_t>(valid.begin(), valid.end() - 1));
}

/// Plan files: policies' plans in both formats (F, B, W, F& and each update rule), then hostile ones.
void write_plan_files(const fs::path& dir) {
  write_text(dir / "1f1b_csv", io::plan_to_csv(schedule::generate<schedule::OneFOneB>({2, 2})));
  write_text(dir / "interleaved_json", io::plan_to_json(schedule::generate<schedule::Interleaved<2>>({2, 4, 2})));
  write_text(dir / "zb_h1_csv", io::plan_to_csv(schedule::generate<schedule::ZeroBubbleH1>({2, 2})));
  write_text(dir / "dualpipev_json", io::plan_to_json(schedule::generate<schedule::DualPipeV>({2, 4, 2})));
  write_text(dir / "pipedream_json", io::plan_to_json(schedule::generate<schedule::PipeDream>({2, 2})));
  write_text(dir / "2bw_csv", io::plan_to_csv(schedule::generate<schedule::PipeDream2BW>({2, 2})));
  // Counts whose product overflows an int, as CSV and JSON (where each is at most 2^30).
  write_text(dir / "huge_counts_csv", "# cupipe plan 1\n# stages=65536 microbatches=65536 chunks=65537 batches=65537\n"
                                      "# placement=0.0\nworker,kind,microbatch,chunk\n0,F,0,0\n");
  write_text(dir / "huge_counts_json", R"({"format": "cupipe plan", "version": 1, "stages": 1073741824, "microbatches": 1073741824,)"
                                       R"( "chunks": 1073741824, "batches": 4, "placement": [[0, 0]], "actions": []})");
  write_text(dir / "huge_unsigned_json", R"({"format": "cupipe plan", "version": 1, "stages": 1, "microbatches": 1, "placement": [[0, 0]],)"
                                         R"( "actions": [{"worker": 0, "kind": "F", "microbatch": 18446744073709551615, "chunk": 0}]})");
  write_text(dir / "deep_json", R"({"format": "cupipe plan", "version": 1, "stages": 1, "microbatches": 1, "placement": [)" +
                                    nested_json(64) + "]}");
  write_text(dir / "unknown_field_json", R"({"format": "cupipe plan", "version": 1, "stages": 1, "microbatches": 1, "stagse": 2})");
  write_text(dir / "short_row_csv", "# cupipe plan 1\n# stages=1 microbatches=1 chunks=1\n# placement=0.0\n"
                                    "worker,kind,microbatch,chunk\n0,F&,0\n0,X,-1,0\n");
}

/// Cost models: a calibrated-looking one with every field, a minimal one, then hostile ones.
void write_cost_models(const fs::path& dir) {
  planner::CostModel model;
  model.profiled_rows = 32;
  model.rows_per_sample = 8;
  model.value_bytes = 2;
  model.compute_bytes = 4;
  model.link_latency = 1e-5;
  model.link_bytes_per_second = 2.5e10;
  model.contention = {1.0, 1.25};
  model.tied = true;
  model.layers.push_back({"embedding", 1e-4, 0, 2e-4, 4096, 1, 64, 0});
  model.layers.push_back({"block0", 3e-4, 3e-4, 3e-4, 49152, 64, 64, 512, 1e-5, 1e-5, 0,
                          {std::array<double, 4>{8, 1e-4, 1e-4, 1e-4}, std::array<double, 4>{32, 3e-4, 3e-4, 3e-4}}});
  model.tensor_variants.push_back({2, model.layers});
  model.tensor_variants[0].layers[1].sum_forward = 64;
  model.tensor_variants[0].layers[1].sum_forward_calls = 1;
  write_text(dir / "calibrated", planner::to_json(model).dump());
  write_text(dir / "minimal", R"({"profiled_rows": 8, "layers": [{"forward": 1e-3, "backward_input": 1e-3,)"
                              R"( "backward_weight": 1e-3, "params": 100, "in": 10, "out": 10}]})");
  write_text(dir / "huge_rows", R"({"profiled_rows": 1e300, "value_bytes": 1e10, "layers": []})");
  write_text(dir / "infinite_cost", R"({"profiled_rows": 8, "layers": [{"forward": 1e400, "backward_input": 0,)"
                                    R"( "backward_weight": 0, "params": 0, "in": 1, "out": 1}]})");
  write_text(dir / "wrong_types", R"({"profiled_rows": "8", "layers": {"forward": 1}, "tensor_variants": [{"degree": 2.5}]})");
  write_text(dir / "deep", R"({"profiled_rows": 8, "layers": [)" + nested_json(64) + "]}");
}

/// Hugging Face GPT-2 files for fuzz_gpt_import's model (vocabulary 11, context 4, 1 block, C 4):
/// transformers' names and shapes with a vocabulary of 10 and a context of 6, then broken ones.
void write_gpt_imports(const fs::path& dir, const fs::path& work) {
  const std::int64_t C = 4;
  std::map<std::string, std::vector<std::int64_t>> shapes{
      {"wte.weight", {10, C}}, {"wpe.weight", {6, C}}, {"ln_f.weight", {C}}, {"ln_f.bias", {C}},
      {"h.0.ln_1.weight", {C}}, {"h.0.ln_1.bias", {C}}, {"h.0.ln_2.weight", {C}}, {"h.0.ln_2.bias", {C}},
      {"h.0.attn.c_attn.weight", {C, 3 * C}}, {"h.0.attn.c_attn.bias", {3 * C}},
      {"h.0.attn.c_proj.weight", {C, C}}, {"h.0.attn.c_proj.bias", {C}}, {"h.0.attn.bias", {1, 1, 6, 6}},
      {"h.0.mlp.c_fc.weight", {C, 4 * C}}, {"h.0.mlp.c_fc.bias", {4 * C}},
      {"h.0.mlp.c_proj.weight", {4 * C, C}}, {"h.0.mlp.c_proj.bias", {C}}};
  const auto save = [&](const std::string& seed, const std::map<std::string, std::vector<std::int64_t>>& tensors,
                        const std::string& prefix = "", const std::string& f64 = "") {
    std::vector<io::TensorEntry> entries;
    float counter = 0;
    for (const auto& [name, shape] : tensors) {
      std::size_t n = 1;
      for (const std::int64_t d : shape) n *= std::size_t(d);
      std::vector<double> values(n);
      for (double& v : values) v = (counter += 0.25f);
      if (name == f64) {
        entries.push_back(io::make_entry(prefix + name, shape, std::span<const double>(values)));
      } else {
        const std::vector<float> floats(values.begin(), values.end());
        entries.push_back(io::make_entry(prefix + name, shape, std::span<const float>(floats)));
      }
    }
    io::save_safetensors(work / "hf.safetensors", std::span<const io::TensorEntry>(entries));
    write_bytes(dir / seed, read_all(work / "hf.safetensors"));
  };
  save("gpt2_model", shapes);
  save("gpt2_lm_head_model", shapes, "transformer.");
  save("f64_tensor", shapes, "", "h.0.ln_1.bias");
  auto edited = [&](const std::string& name, std::vector<std::int64_t> shape) {
    auto out = shapes;
    if (shape.empty()) out.erase(name);
    else out[name] = std::move(shape);
    return out;
  };
  save("missing_tensor", edited("h.0.mlp.c_proj.bias", {}));
  save("conv1d_not_transposed", edited("h.0.mlp.c_fc.weight", {4 * C, C}));
  save("vocab_too_long", edited("wte.weight", {12, C}));
  save("context_too_short", edited("wpe.weight", {3, C}));
  save("wte_rank_1", edited("wte.weight", {10}));
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: fuzz_seed_corpus DIR\n");
    return 2;
  }
  try {
    const fs::path dir(argv[1]);
    for (const char* target : {"safetensors", "idx", "checkpoint", "llmc_shard", "plan_file", "cost_model", "gpt_import"})
      fs::create_directories(dir / target);
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

    write_llmc_shards(dir / "llmc_shard", work);
    write_plan_files(dir / "plan_file");
    write_cost_models(dir / "cost_model");
    write_gpt_imports(dir / "gpt_import", work);
    std::printf("seed corpus written to %s\n", dir.c_str());
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "fuzz_seed_corpus: %s\n", e.what());
    return 1;
  }
}
