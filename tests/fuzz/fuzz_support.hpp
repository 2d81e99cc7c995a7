// SPDX-License-Identifier: Apache-2.0
// What the fuzz targets share: the bytes of one input written to a file (the parsers read files, as
// the trainers do, so the fuzzers test that path), and the rule for what a target may answer.
// A target returns normally on a cupipe::error (a clear refusal is the right answer to bad input);
// anything else escapes: a crash, a sanitizer report, or another exception is a finding.
// Each target includes only the parser it fuzzes, not cupipe.hpp: under the sanitizers a target's
// compile time is the headers it includes (checkpoint_model.hpp holds the one model that needs more).
#pragma once

#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <stdexcept>
#include <string>
#include <system_error>

#include "cupipe/core/error.hpp"

namespace cupipe::fuzz {

/// A directory of this process's own, removed at exit.
inline const std::filesystem::path& scratch() {
  struct Dir {
    std::filesystem::path path = std::filesystem::temp_directory_path() / ("cupipe-fuzz-" + std::to_string(::getpid()));
    Dir() { std::filesystem::create_directories(path); }
    ~Dir() {
      std::error_code ignored;
      std::filesystem::remove_all(path, ignored);
    }
  };
  static const Dir dir;
  return dir.path;
}

inline void write(const std::filesystem::path& path, const std::uint8_t* data, std::size_t size) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(reinterpret_cast<const char*>(data), std::streamsize(size));
  if (!out) throw std::runtime_error("fuzz: cannot write " + path.string());
}

/// Runs `parse`, accepting a cupipe::error as the answer.
template <class Parse>
void refuse_or_accept(Parse&& parse) {
  try {
    parse();
  } catch (const cupipe::error&) {
  }
}

}  // namespace cupipe::fuzz
