// SPDX-License-Identifier: Apache-2.0
// Helpers for the io/ tests: a self-deleting temp directory and raw file writers.
#pragma once

#include <unistd.h>
#include <zlib.h>

#include <atomic>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

namespace cupipe::io::testing {

/// A fresh directory under the system temp dir, removed with everything in it at scope exit.
class TempDir {
 public:
  TempDir() {
    static std::atomic<int> counter{0};
    const std::string name = "cupipe-io-test-" + std::to_string(::getpid()) + "-" + std::to_string(counter++) + "-" +
                             std::to_string(std::random_device{}());
    path_ = std::filesystem::temp_directory_path() / name;
    std::filesystem::create_directories(path_);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  ~TempDir() {
    std::error_code ignored;
    std::filesystem::remove_all(path_, ignored);
  }
  const std::filesystem::path& path() const { return path_; }
  std::filesystem::path operator/(const std::string& name) const { return path_ / name; }

 private:
  std::filesystem::path path_;
};

using Bytes = std::vector<std::uint8_t>;

inline void write_bytes(const std::filesystem::path& path, const Bytes& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
  if (!out) throw std::runtime_error("test: cannot write " + path.string());
}

inline Bytes read_bytes(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw std::runtime_error("test: cannot read " + path.string());
  return Bytes(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

/// Writes `bytes` gzip-compressed with zlib's gzwrite.
inline void write_gzip(const std::filesystem::path& path, const Bytes& bytes) {
  gzFile out = gzopen(path.c_str(), "wb");
  if (!out) throw std::runtime_error("test: gzopen failed for " + path.string());
  const int written = bytes.empty() ? 0 : gzwrite(out, bytes.data(), static_cast<unsigned>(bytes.size()));
  if (gzclose(out) != Z_OK || written != static_cast<int>(bytes.size()))
    throw std::runtime_error("test: gzwrite failed for " + path.string());
}

inline std::vector<std::string> directory_entries(const std::filesystem::path& dir) {
  std::vector<std::string> names;
  for (const auto& entry : std::filesystem::directory_iterator(dir)) names.push_back(entry.path().filename().string());
  return names;
}

}  // namespace cupipe::io::testing
