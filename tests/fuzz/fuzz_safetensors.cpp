// SPDX-License-Identifier: Apache-2.0
// libFuzzer target: any bytes as a safetensors file. Loading must succeed or throw cupipe::error.
#include <string>

#include "cupipe/io/safetensors.hpp"
#include "fuzz_support.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  using namespace cupipe;
  const auto path = fuzz::scratch() / "input.safetensors";
  fuzz::write(path, data, size);
  fuzz::refuse_or_accept([&] {
    const io::SafetensorsFile file = io::SafetensorsFile::load(path);
    std::size_t bytes = 0;  // touch what a loader would read
    for (const std::string& name : file.names()) bytes += file.at(name).data.size();
    (void)bytes;
  });
  return 0;
}
