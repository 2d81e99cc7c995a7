// SPDX-License-Identifier: Apache-2.0
// require_same_settings: ranks started with different settings fail at once, naming the setting.
// Every rank passes the same list of (name, value) pairs, e.g. {"--seed", "7"}; the values are
// exchanged (each rank's text, up to 60 bytes per setting, packed 6 bytes per double into one sum over
// the world, which is exact because each slot has exactly one non-zero contributor), and every rank
// compares all of them, so every rank fails with the same sentence. Lists of different lengths are
// caught first, by a sum of the counts and of their squares.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "cupipe/comm/communicator.hpp"
#include "cupipe/core/error.hpp"

namespace cupipe::comm {

using Settings = std::vector<std::pair<std::string, std::string>>;

namespace detail {

inline constexpr std::size_t setting_bytes = 60;  ///< of "name=value" compared per setting
inline constexpr std::size_t bytes_per_double = 6;  ///< 48 bits: exact in a double, and in a sum of one
inline constexpr std::size_t doubles_per_setting = setting_bytes / bytes_per_double;

/// The first `doubles` x 6 bytes of `text` (zero-padded), 6 bytes per double.
inline void pack(const std::string& text, double* out, std::size_t doubles = doubles_per_setting) {
  for (std::size_t d = 0; d < doubles; ++d) {
    std::uint64_t word = 0;
    for (std::size_t b = 0; b < bytes_per_double; ++b) {
      const std::size_t i = d * bytes_per_double + b;
      word = word << 8 | (i < text.size() ? std::uint8_t(text[i]) : 0u);
    }
    out[d] = double(word);
  }
}

inline std::string unpack(const double* in, std::size_t doubles = doubles_per_setting) {
  std::string text;
  for (std::size_t d = 0; d < doubles; ++d) {
    const auto word = std::uint64_t(in[d]);
    for (std::size_t b = 0; b < bytes_per_double; ++b) {
      const char c = char((word >> (8 * (bytes_per_double - 1 - b))) & 0xff);
      if (c != '\0') text.push_back(c);
    }
  }
  return text;
}

}  // namespace detail

/// Throws on every rank when the ranks' settings differ: "rank 2 was started with --seed=7 but rank 0
/// with --seed=5". A collective: every rank of `comm` must call it, before any other collective.
inline void require_same_settings(Communicator& comm, const Settings& settings) {
  const int world = comm.topology().world, rank = comm.topology().rank;
  // The lists must have one length before they can be summed slot by slot: every count equals the
  // mean exactly when world * sum(c^2) == (sum c)^2 (small integers: exact in doubles).
  const double count = double(settings.size());
  std::vector<double> moments{count, count * count};
  comm.sum_over_world(moments.data(), moments.size());
  if (double(world) * moments[1] != moments[0] * moments[0])
    CUPIPE_THROW("ranks were started with different settings: rank ", rank, " compares ", settings.size(),
                 " settings but the ranks' counts differ (is every rank the same program and version?)");
  const std::size_t per_rank = settings.size() * detail::doubles_per_setting;
  std::vector<double> all(per_rank * std::size_t(world), 0.0);
  double* mine = all.data() + per_rank * std::size_t(rank);
  for (std::size_t i = 0; i < settings.size(); ++i)
    detail::pack(settings[i].first + "=" + settings[i].second, mine + i * detail::doubles_per_setting);
  comm.sum_over_world(all.data(), all.size());
  for (std::size_t i = 0; i < settings.size(); ++i) {
    const std::string first = detail::unpack(all.data() + i * detail::doubles_per_setting);
    for (int r = 1; r < world; ++r) {
      const std::string other = detail::unpack(all.data() + per_rank * std::size_t(r) + i * detail::doubles_per_setting);
      if (other != first)
        CUPIPE_THROW("ranks were started with different settings: rank ", r, " has ", other, " but rank 0 has ", first,
                     " (start every rank with the same command line)");
    }
  }
}

/// Rank 0's `text` on every rank (the other ranks' `text` is ignored): its length, then its bytes
/// packed as require_same_settings packs them, in two sums over the world, exact because rank 0 is
/// the only non-zero contributor. A collective: every rank of `comm` calls it. For what one rank
/// measured and every rank must use alike (a planner's cost model, as JSON). Text without NUL bytes.
inline std::string share_from_first(Communicator& comm, const std::string& text) {
  const bool first = comm.topology().rank == 0;
  const auto length = std::size_t(comm.sum_over_world(first ? double(text.size()) : 0.0));
  std::vector<double> packed((length + detail::bytes_per_double - 1) / detail::bytes_per_double, 0.0);
  if (first) detail::pack(text, packed.data(), packed.size());
  comm.sum_over_world(packed.data(), packed.size());
  std::string shared = detail::unpack(packed.data(), packed.size());
  CUPIPE_REQUIRE(shared.size() == length, "share_from_first: received ", shared.size(), " bytes of ", length,
                 " (the text holds a NUL byte?)");
  return shared;
}

}  // namespace cupipe::comm
