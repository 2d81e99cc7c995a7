// SPDX-License-Identifier: Apache-2.0
// libFuzzer target: any bytes as an IDX file, plain or gzip. Reading must succeed or throw
// cupipe::error.
#include "cupipe/io/idx.hpp"
#include "fuzz_support.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  using namespace cupipe;
  const auto path = fuzz::scratch() / "input.idx";
  fuzz::write(path, data, size);
  fuzz::refuse_or_accept([&] {
    const io::IdxArray array = io::read_idx(path);
    std::size_t elements = 1;
    for (auto extent : array.shape) elements *= extent;
    if (elements != array.data.size()) __builtin_trap();  // the shape must describe the data read
  });
  return 0;
}
