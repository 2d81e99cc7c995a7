// SPDX-License-Identifier: Apache-2.0
// Hugging Face GPT-2 weights into the GPT model: a file in transformers' layout (Conv1D weights
// (in, out), no lm_head, a causal-mask buffer, a shorter vocabulary and a longer context) written by
// the test, read back transposed, padded and tied; missing tensors and wrong shapes are named.
#include <catch2/catch.hpp>

#include "cupipe/cupipe.hpp"

#include <algorithm>
#include <cstdint>
#include <filesystem>
#include <span>
#include <map>
#include <string>
#include <vector>

#include "cupipe/gpt/import.hpp"

using namespace cupipe;

namespace {

constexpr gpt::Config config{11, 4, 2, 2, 8};
using Body = gpt::Model<config>::body;

struct HfFile {
  std::map<std::string, io::TensorEntry> tensors;
  Rng rng{17};
  void add(const std::string& name, std::vector<std::int64_t> shape) {
    io::TensorEntry e{name, DType::f32, shape, {}};
    std::int64_t n = 1;
    for (auto d : shape) n *= d;
    std::vector<float> values(static_cast<std::size_t>(n));
    for (float& v : values) v = float(rng.uniform(-1, 1));
    e.data.resize(values.size() * sizeof(float));
    std::memcpy(e.data.data(), values.data(), e.data.size());
    tensors[name] = e;
  }
  float at(const std::string& name, std::size_t i) const {
    float v;
    std::memcpy(&v, tensors.at(name).data.data() + i * sizeof(float), sizeof v);
    return v;
  }
  std::filesystem::path save(const std::string& file) const {
    const auto path = std::filesystem::temp_directory_path() / file;
    std::vector<io::TensorEntry> list;
    for (const auto& [name, e] : tensors) list.push_back(e);
    io::save_safetensors(path, std::span<const io::TensorEntry>(list));
    return path;
  }
};

/// transformers' GPT2Model names and shapes for `config`, with a vocabulary of 10 and a context of 6.
HfFile gpt2_file() {
  HfFile f;
  const std::int64_t C = 8;
  f.add("wte.weight", {10, C});
  f.add("wpe.weight", {6, C});
  for (int b = 0; b < 2; ++b) {
    const std::string h = "h." + std::to_string(b) + ".";
    for (const char* ln : {"ln_1", "ln_2"}) {
      f.add(h + ln + ".weight", {C});
      f.add(h + ln + ".bias", {C});
    }
    f.add(h + "attn.c_attn.weight", {C, 3 * C});
    f.add(h + "attn.c_attn.bias", {3 * C});
    f.add(h + "attn.c_proj.weight", {C, C});
    f.add(h + "attn.c_proj.bias", {C});
    f.add(h + "attn.bias", {1, 1, 6, 6});  // the causal mask buffer
    f.add(h + "mlp.c_fc.weight", {C, 4 * C});
    f.add(h + "mlp.c_fc.bias", {4 * C});
    f.add(h + "mlp.c_proj.weight", {4 * C, C});
    f.add(h + "mlp.c_proj.bias", {C});
  }
  f.add("ln_f.weight", {C});
  f.add("ln_f.bias", {C});
  return f;
}

const ParamInfo& param(const std::string& nanogpt) {
  static const std::vector<ParamInfo> table = Body::parameter_table();
  for (const ParamInfo& p : table)
    if (gpt::nanogpt_name(config, p.name) == nanogpt) return p;
  throw std::runtime_error("no parameter " + nanogpt);
}

}  // namespace

TEST_CASE("Hugging Face GPT-2 weights: Conv1D transposed, vocabulary padded, context cut, head tied",
          "[layers][gpt][io]") {
  const HfFile hf = gpt2_file();
  const auto path = hf.save("cupipe-hf-gpt2.safetensors");
  const std::vector<float> flat = gpt::import_hf_gpt2<config>(path);
  REQUIRE(flat.size() == std::size_t(Body::param_count));

  const ParamInfo& c_attn = param("transformer.h.1.attn.c_attn.weight");  // (3C, C) here, (C, 3C) there
  for (index_t o = 0; o < 24; ++o)
    for (index_t i = 0; i < 8; ++i)
      REQUIRE(flat[std::size_t(c_attn.offset + o * 8 + i)] == hf.at("h.1.attn.c_attn.weight", std::size_t(i * 24 + o)));
  const ParamInfo& fc = param("transformer.h.0.mlp.c_fc.weight");  // (4C, C) here, (C, 4C) there
  CHECK(flat[std::size_t(fc.offset + 5 * 8 + 3)] == hf.at("h.0.mlp.c_fc.weight", 3 * 32 + 5));
  const ParamInfo& bias = param("transformer.h.0.attn.c_attn.bias");
  CHECK(flat[std::size_t(bias.offset + 7)] == hf.at("h.0.attn.c_attn.bias", 7));

  const ParamInfo& wte = param("transformer.wte.weight");
  const ParamInfo& head = param("lm_head.weight");
  for (std::size_t i = 0; i < 80; ++i) REQUIRE(flat[std::size_t(wte.offset) + i] == hf.at("wte.weight", i));
  for (std::size_t i = 80; i < 88; ++i) CHECK(flat[std::size_t(wte.offset) + i] == 0.0f);  // padded token 10
  for (std::size_t i = 0; i < 88; ++i) REQUIRE(flat[std::size_t(head.offset) + i] == flat[std::size_t(wte.offset) + i]);
  const ParamInfo& wpe = param("transformer.wpe.weight");
  CHECK(flat[std::size_t(wpe.offset + 31)] == hf.at("wpe.weight", 31));  // the first 4 of 6 positions

  // GPT2LMHeadModel's names ("transformer." prefix) read the same.
  HfFile prefixed;
  for (const auto& [name, e] : hf.tensors) {
    io::TensorEntry copy = e;
    copy.name = "transformer." + name;
    prefixed.tensors[copy.name] = copy;
  }
  CHECK(gpt::import_hf_gpt2<config>(prefixed.save("cupipe-hf-gpt2-prefixed.safetensors")) == flat);

  HfFile missing = hf;
  missing.tensors.erase("h.1.mlp.c_proj.bias");
  CHECK_THROWS_WITH(gpt::import_hf_gpt2<config>(missing.save("cupipe-hf-missing.safetensors")),
                    Catch::Contains("no tensor 'h.1.mlp.c_proj.bias'"));
  HfFile wrong = hf;
  wrong.add("h.0.attn.c_proj.weight", {8, 9});
  CHECK_THROWS_WITH(gpt::import_hf_gpt2<config>(wrong.save("cupipe-hf-wrong.safetensors")),
                    Catch::Contains("tensor 'h.0.attn.c_proj.weight': expected F32 (8, 8) but the file has F32 (8, 9)"));
  HfFile long_vocab = hf;
  long_vocab.add("wte.weight", {12, 8});
  CHECK_THROWS_WITH(gpt::import_hf_gpt2<config>(long_vocab.save("cupipe-hf-vocab.safetensors")),
                    Catch::Contains("must be (at most 11, 8) for this model's vocabulary of 11"));
  for (const char* f : {"cupipe-hf-gpt2.safetensors", "cupipe-hf-gpt2-prefixed.safetensors", "cupipe-hf-missing.safetensors",
                        "cupipe-hf-wrong.safetensors", "cupipe-hf-vocab.safetensors"})
    std::filesystem::remove(std::filesystem::temp_directory_path() / f);
}

namespace {

/// Part t of every rank's initialisation of `Part` equals part t of the whole model's (`Whole`), and
/// the parts differ from one rank to the next where the model splits anything.
template <class Whole, class Part, int TP>
void check_parts_of_whole_initialisation(std::uint64_t seed) {
  std::vector<double> whole(static_cast<std::size_t>(Whole::param_count));
  Whole::init(std::span<double>(whole), seed);
  const std::vector<ParamInfo> whole_table = Whole::parameter_table();
  const std::vector<ParamInfo> part_table = Part::parameter_table();
  std::vector<std::vector<double>> parts;
  for (int t = 0; t < TP; ++t) {
    std::vector<double> mine(static_cast<std::size_t>(Part::param_count));
    Part::init(std::span<double>(mine), seed, t);
    const std::vector<double> want =
        layers::tensor_parallel::shard(whole_table, part_table, std::span<const double>(whole), t);
    INFO("tensor rank " << t << " of " << TP);
    CHECK(mine == want);
    parts.push_back(std::move(mine));
  }
  for (int t = 1; t < TP; ++t) CHECK(parts[std::size_t(t)] != parts[0]);
}

}  // namespace

TEST_CASE("a tensor-parallel model's ranks start with their parts of the whole model's initialisation",
          "[cpu][layers][tensor_parallel]") {
  constexpr gpt::Config tied{64, 8, 2, 4, 16};
  constexpr gpt::Config untied{64, 8, 2, 4, 16, false};
  check_parts_of_whole_initialisation<gpt::Model<tied>::body, gpt::TensorParallelModel<tied, 2>::body, 2>(4);
  check_parts_of_whole_initialisation<gpt::Model<tied>::body, gpt::TensorParallelModel<tied, 4>::body, 4>(7);
  check_parts_of_whole_initialisation<gpt::Model<untied>::body, gpt::TensorParallelModel<untied, 2>::body, 2>(4);
  // Split Linears straight in a Sequential (the row-parallel one's input width is its part's).
  using Whole = Sequential<Linear<12, 16>, ReLU, Linear<16, 8>, ReLU, Linear<8, 5>>;
  using Split = Sequential<Linear<12, 16>, ReLU, ColumnParallelLinear<16, 8, 2>, ReLU, RowParallelLinear<8, 5, 2>>;
  check_parts_of_whole_initialisation<Whole, Split, 2>(11);
  // A Network of a rank's part, initialised with its place in the group.
  {
    Network<gpt::TensorParallelModel<tied, 2>, backend::Host<double>> net(4);
    net.initialise(4, 1);
    std::vector<double> whole(static_cast<std::size_t>(gpt::Model<tied>::body::param_count));
    gpt::Model<tied>::body::init(std::span<double>(whole), 4);
    CHECK(net.parameters() == layers::tensor_parallel::shard(gpt::Model<tied>::body::parameter_table(),
                                                     gpt::TensorParallelModel<tied, 2>::body::parameter_table(),
                                                     std::span<const double>(whole), 1));
  }
  // The tied copies of a rank's parts start equal, as the whole model's copies do.
  using Part = gpt::TensorParallelModel<tied, 2>::body;
  std::vector<double> mine(static_cast<std::size_t>(Part::param_count));
  Part::init(std::span<double>(mine), 4, 1);
  constexpr TiedCopies copies = Part::tied;
  REQUIRE(copies.count == tied.vocab / 2 * tied.channels);
  CHECK(std::equal(mine.begin() + copies.first, mine.begin() + copies.first + copies.count, mine.begin() + copies.second));
}
