// SPDX-License-Identifier: Apache-2.0
// Hugging Face GPT-2 weights (model.safetensors, as transformers' GPT2LMHeadModel saves them) into
// gpt::Model<config>'s flat parameter layout, so a user can fine-tune GPT-2 weights they already have.
// Differences from nanoGPT's layout, undone here:
//   - names have no "transformer." prefix (GPT2Model) or have it (GPT2LMHeadModel): both are read;
//   - attention and MLP weights are Conv1D, stored (in, out): they are transposed to (out, in);
//   - lm_head is tied to wte (and absent from the file): the head's copy is wte;
//   - the vocabulary may be padded here (50257 -> 50304, as llm.c does): extra wte rows are zero;
//     a shorter context takes the first rows of wpe.
// Buffers such as "h.0.attn.bias" (the causal mask) are not parameters and are ignored.
#pragma once

#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

#include "cupipe/core/error.hpp"
#include "cupipe/io/safetensors.hpp"
#include "cupipe/gpt/model.hpp"

namespace cupipe::gpt {

template <Config c, class T = float>
std::vector<T> import_hf_gpt2(const std::filesystem::path& path) {
  using Body = typename Model<c>::body;
  const io::SafetensorsFile file = io::SafetensorsFile::load(path);
  const std::string prefix = file.contains("transformer.wte.weight") ? "transformer." : "";
  auto entry = [&](const std::string& name) -> const io::TensorEntry& {
    if (!file.contains(prefix + name))
      CUPIPE_THROW(path.string(), ": no tensor '", prefix + name, "' (not a Hugging Face GPT-2 file for ", c.layers,
                   " blocks?)");
    return file.at(prefix + name);
  };
  std::vector<T> flat(static_cast<std::size_t>(Body::param_count), T(0));
  for (const ParamInfo& p : Body::parameter_table()) {
    std::string name = nanogpt_name(c, p.name);
    if (name.starts_with("transformer.")) name = name.substr(12);
    const index_t rows = p.shape[0], cols = p.shape.rank() > 1 ? p.shape[1] : 0;
    T* out = flat.data() + p.offset;
    if (name == "lm_head.weight") name = "wte.weight";  // GPT-2 ties them: the head is a copy of wte
    const bool conv1d = cols != 0 && (name.ends_with("c_attn.weight") || name.ends_with("c_proj.weight") ||
                                      name.ends_with("c_fc.weight"));
    const io::TensorEntry& e = entry(name);
    std::vector<std::int64_t> want = cols == 0 ? std::vector<std::int64_t>{rows} : std::vector<std::int64_t>{rows, cols};
    if (conv1d) want = {cols, rows};
    if (name == "wte.weight") {
      if (e.shape.size() != 2 || e.shape[1] != cols || e.shape[0] > rows)
        CUPIPE_THROW(path.string(), ": '", prefix + name, "' must be (at most ", rows, ", ", cols, ") for this model's vocabulary of ",
                     c.vocab, " and C ", c.channels);
      want = {e.shape[0], cols};
    } else if (name == "wpe.weight") {
      if (e.shape.size() != 2 || e.shape[1] != cols || e.shape[0] < rows)
        CUPIPE_THROW(path.string(), ": '", prefix + name, "' must be (at least ", rows, ", ", cols, ") for this model's context of ",
                     c.context, " and C ", c.channels);
      want = {e.shape[0], cols};
    }
    const std::vector<float> values = file.read<float>(prefix + name, want);
    if (conv1d) {
      for (index_t i = 0; i < cols; ++i)
        for (index_t o = 0; o < rows; ++o) out[o * cols + i] = T(values[std::size_t(i * rows + o)]);
    } else {
      const std::size_t n = std::min(values.size(), static_cast<std::size_t>(p.numel));  // wpe: its first rows
      for (std::size_t i = 0; i < n; ++i) out[i] = T(values[i]);
    }
  }
  return flat;
}

}  // namespace cupipe::gpt
