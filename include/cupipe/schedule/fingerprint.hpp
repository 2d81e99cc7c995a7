// SPDX-License-Identifier: Apache-2.0
// fingerprint: one short text that changes whenever anything a plan says changes (its counts, split,
// update rule, placement, channel depth, and every action in order). Ranks of one job compare
// fingerprints before the first step (Pipeline does so under a communicator), so ranks that read
// different plan files, or were started with different schedules or microbatch counts, fail at once
// instead of waiting on messages that never come.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <string>

#include "cupipe/core/hash.hpp"
#include "cupipe/schedule/action.hpp"

namespace cupipe::schedule {

namespace detail {

/// Folds a whole integer into the hash as 8 little-endian bytes, so the hash does not depend on the host.
inline void add_integer(Fnv1a& h, std::int64_t value) {
  unsigned char bytes[8];
  for (int i = 0; i < 8; ++i) bytes[i] = static_cast<unsigned char>(static_cast<std::uint64_t>(value) >> (8 * i));
  h.add(bytes, sizeof bytes);
}

}  // namespace detail

/// 16 hex digits of a 64-bit FNV-1a hash over the whole plan.
inline std::string fingerprint(const Plan& plan) {
  Fnv1a h;
  auto add = [&h](std::int64_t v) { detail::add_integer(h, v); };
  const Config& c = plan.config;
  for (const int v : {c.stages, c.microbatches, c.chunks, c.batches, plan.channel_depth}) add(v);
  add(plan.split_backward ? 1 : 0);
  add(static_cast<int>(plan.update));
  for (int k = 0; k < c.virtual_stages(); ++k) {
    add(plan.placement.worker_of(k));
    add(plan.placement.chunk_of(k));
  }
  for (const auto& list : plan.actions) {
    add(std::int64_t(list.size()));
    for (const Action& a : list) {
      add(static_cast<int>(a.kind));
      add(a.microbatch);
      add(a.chunk);
      add(a.overlap ? 1 : 0);
    }
  }
  static constexpr char digits[] = "0123456789abcdef";
  std::string text(16, '0');
  std::uint64_t value = h.value();
  for (int i = 15; i >= 0; --i, value >>= 4) text[std::size_t(i)] = digits[value & 0xfu];
  return text;
}

}  // namespace cupipe::schedule
