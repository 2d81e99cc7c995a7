// SPDX-License-Identifier: Apache-2.0
// libFuzzer target: a checkpoint pair (model file, state file) from one input, loaded into a small
// pipeline with AdamW. The load must succeed or throw cupipe::error, and a refused load must leave
// the pipeline's weights as they were.
#include <cstring>
#include <vector>

#include "checkpoint_model.hpp"
#include "fuzz_support.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  using namespace cupipe;
  static fuzz::CheckpointPipeline pipe({.microbatches = 1, .seed = 1});
  static const optim::AdamW adamw;
  if (size < 4) return 0;
  std::uint32_t model_bytes = 0;
  for (int i = 3; i >= 0; --i) model_bytes = model_bytes << 8 | data[i];
  data += 4;
  size -= 4;
  model_bytes = std::uint32_t(std::min<std::size_t>(model_bytes, size));
  const auto prefix = fuzz::scratch() / "ckpt";
  fuzz::write(io::model_file(prefix), data, model_bytes);
  fuzz::write(io::state_file(prefix), data + model_bytes, size - model_bytes);
  const std::vector<float> before = pipe.parameters();
  try {
    (void)io::load_checkpoint(prefix, pipe, adamw);
  } catch (const cupipe::error&) {
    if (pipe.parameters() != before) __builtin_trap();  // a refused load changed the weights
  }
  return 0;
}
