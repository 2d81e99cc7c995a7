// SPDX-License-Identifier: Apache-2.0
// A seeded, reproducible generator (xoshiro256**, seeded through splitmix64). Its whole state is
// four words, so checkpoints can save and restore it exactly. Results are identical on every
// platform: no std:: distributions, whose outputs differ between standard libraries.
#pragma once

#include <array>
#include <cmath>
#include <cstdint>
#include <numbers>

namespace cupipe {

class Rng {
 public:
  using state_type = std::array<std::uint64_t, 4>;

  explicit Rng(std::uint64_t seed = 0) noexcept { reseed(seed); }

  void reseed(std::uint64_t seed) noexcept {
    std::uint64_t x = seed;
    for (auto& word : state_) word = splitmix64(x);
  }

  std::uint64_t next_u64() noexcept {
    const std::uint64_t result = rotl(state_[1] * 5, 7) * 9;
    const std::uint64_t t = state_[1] << 17;
    state_[2] ^= state_[0];
    state_[3] ^= state_[1];
    state_[1] ^= state_[2];
    state_[0] ^= state_[3];
    state_[2] ^= t;
    state_[3] = rotl(state_[3], 45);
    return result;
  }

  /// Uniform in [0, 1) with 53 random bits.
  double uniform() noexcept { return static_cast<double>(next_u64() >> 11) * 0x1.0p-53; }
  /// Uniform in [low, high).
  double uniform(double low, double high) noexcept { return low + (high - low) * uniform(); }
  /// Uniform integer in [0, n), without modulo bias.
  std::uint64_t below(std::uint64_t n) noexcept {
    if (n == 0) return 0;
    const std::uint64_t limit = -n % n;
    for (;;) {
      const std::uint64_t r = next_u64();
      if (r >= limit) return r % n;
    }
  }
  /// Standard normal, Box-Muller (one value per call, so the stream position is simple to reason about).
  double normal() noexcept {
    const double u1 = 1.0 - uniform();  // (0, 1]
    const double u2 = uniform();
    return std::sqrt(-2.0 * std::log(u1)) * std::cos(2.0 * std::numbers::pi * u2);
  }

  const state_type& state() const noexcept { return state_; }
  void set_state(const state_type& state) noexcept { state_ = state; }

  /// A generator for a sub-stream (layer i, worker j, ...), independent of this one's position.
  static Rng derive(std::uint64_t seed, std::uint64_t stream) noexcept {
    std::uint64_t x = seed ^ (0x9e3779b97f4a7c15ull * (stream + 1));
    return Rng(splitmix64(x));
  }

 private:
  static constexpr std::uint64_t rotl(std::uint64_t x, int k) noexcept { return (x << k) | (x >> (64 - k)); }
  static constexpr std::uint64_t splitmix64(std::uint64_t& x) noexcept {
    std::uint64_t z = (x += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  }

  state_type state_{};
};

}  // namespace cupipe
