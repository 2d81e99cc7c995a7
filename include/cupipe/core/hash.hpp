// SPDX-License-Identifier: Apache-2.0
// Fnv1a: the 64-bit FNV-1a hash of a byte stream. A fingerprint against accidents (checkpoint
// checksums, the same data on every rank), not against an adversary.
#pragma once

#include <cstddef>
#include <cstdint>

namespace cupipe {

class Fnv1a {
 public:
  /// Folds `bytes` bytes at `data` into the hash; each byte is a bijection of the running value.
  void add(const void* data, std::size_t bytes) noexcept {
    const auto* p = static_cast<const unsigned char*>(data);
    for (std::size_t i = 0; i < bytes; ++i) hash_ = (hash_ ^ p[i]) * 0x100000001b3ull;
  }
  std::uint64_t value() const noexcept { return hash_; }

 private:
  std::uint64_t hash_ = 0xcbf29ce484222325ull;
};

}  // namespace cupipe
