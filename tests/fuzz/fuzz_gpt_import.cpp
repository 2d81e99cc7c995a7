// SPDX-License-Identifier: Apache-2.0
// libFuzzer target: any bytes as a Hugging Face GPT-2 model.safetensors, imported into a small GPT
// (vocabulary 11, context 4, 1 block, 2 heads, C 4) as gpt::import_hf_gpt2 does for a fine-tune.
// The import must succeed or throw cupipe::error, and an imported model must have every parameter
// and the head tied to wte.
#include <cstring>
#include <vector>

#include "cupipe/gpt/import.hpp"
#include "fuzz_support.hpp"

namespace {
constexpr cupipe::gpt::Config fuzz_config{11, 4, 1, 2, 4};
}

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  using namespace cupipe;
  using Body = gpt::Model<fuzz_config>::body;
  const auto path = fuzz::scratch() / "model.safetensors";
  fuzz::write(path, data, size);
  fuzz::refuse_or_accept([&] {
    const std::vector<float> flat = gpt::import_hf_gpt2<fuzz_config>(path);
    if (flat.size() != std::size_t(Body::param_count)) __builtin_trap();
    const index_t wte_size = fuzz_config.vocab * fuzz_config.channels;
    const auto table = Body::parameter_table();
    const auto offset = [&](const char* name) {
      for (const ParamInfo& p : table)
        if (gpt::nanogpt_name(fuzz_config, p.name) == name) return std::size_t(p.offset);
      __builtin_trap();
    };
    const std::size_t wte = offset("transformer.wte.weight"), head = offset("lm_head.weight");
    if (std::memcmp(flat.data() + wte, flat.data() + head, std::size_t(wte_size) * sizeof(float)) != 0)  // bits: NaN too
      __builtin_trap();
  });
  return 0;
}
