// SPDX-License-Identifier: Apache-2.0
// libFuzzer target: any bytes as an llm.c token shard, read as gpt_train --shards reads one, for
// GPT-2's vocabulary. Reading must succeed or throw cupipe::error, and a shard read must be the
// header's count of tokens, each inside the vocabulary.
#include "cupipe/io/tokens.hpp"
#include "fuzz_support.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  using namespace cupipe;
  constexpr std::int64_t vocab = 50257;
  const auto path = fuzz::scratch() / "input.bin";
  fuzz::write(path, data, size);
  fuzz::refuse_or_accept([&] {
    const io::TokenCorpus corpus = io::load_llmc_shards(path, vocab);
    if (io::llmc_header_bytes + 2 * corpus.tokens.size() != size) __builtin_trap();
    for (const std::int32_t token : corpus.tokens)
      if (token < 0 || token >= vocab) __builtin_trap();
  });
  return 0;
}
