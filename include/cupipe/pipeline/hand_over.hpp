// SPDX-License-Identifier: Apache-2.0
// The hand-over between two stages of a pipeline whose workers have different backends
// (backend::PerWorker): an activation or a gradient leaves one worker in its storage type and memory
// space and arrives in the next worker's. Between two contexts of one backend type it is that
// backend's transfer(); otherwise each value converts as convert_value says, in host memory when
// either side cannot be read by the host (a device stage), directly when both can.
#pragma once

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstddef>
#include <span>
#include <type_traits>
#include <vector>

#include "cupipe/core/dtype.hpp"
#include "cupipe/core/error.hpp"
#include "cupipe/core/tensor.hpp"

namespace cupipe::pipeline {

/// A double rounded to bf16, to nearest even, once. Through float by round-to-odd: the float keeps
/// the double's value truncated toward zero with its last bit set when inexact, so no tie is made
/// or broken on the way (float has 16 more bits than bf16), and bfloat16(float) then rounds
/// correctly. `bfloat16(float(x))` would round twice: 1 + 2^-8 + 2^-30 would become 1, not 1 + 2^-7.
inline bfloat16 bf16_from_double(double x) noexcept {
  float f = static_cast<float>(x);
  if (std::isfinite(f) && static_cast<double>(f) != x) {
    if (std::abs(static_cast<double>(f)) > std::abs(x)) f = std::nextafter(f, 0.0f);
    f = std::bit_cast<float>(std::bit_cast<std::uint32_t>(f) | 1u);
  }
  return bfloat16(f);
}

/// One value of type U in type V. Widening (bf16 to float or double, float to double) is exact;
/// narrowing (double to float, float or double to bf16) rounds to nearest even, once.
template <class V, class U>
V convert_value(U u) noexcept {
  if constexpr (std::is_same_v<U, V>) return u;
  else if constexpr (std::is_same_v<U, bfloat16>) return V(float(u));
  else if constexpr (std::is_same_v<V, bfloat16> && std::is_same_v<U, double>) return bf16_from_double(u);
  else if constexpr (std::is_same_v<V, bfloat16>) return bfloat16(float(u));
  else return V(u);
}

/// Converts n values of `from` into `to` (both in host memory).
template <class V, class U>
void convert_values(const U* from, V* to, std::size_t n) noexcept {
  std::transform(from, from + n, to, [](U u) { return convert_value<V>(u); });
}

/// Copies `src` (in `from`'s memory, element type U) into `dst` (in `to`'s, element type V),
/// converting each value. Returns once `src` may be reused.
template <class From, class To, class U, class V>
void hand_over(From& from, To& to, TensorView<const U, typename From::space> src, TensorView<V, typename To::space> dst) {
  CUPIPE_REQUIRE(src.numel() == dst.numel(), "hand-over: ", src.numel(), " values sent into a buffer of ", dst.numel());
  const auto n = static_cast<std::size_t>(src.numel());
  if constexpr (std::is_same_v<From, To> && std::is_same_v<U, V>) {
    transfer(from, to, src, dst);
  } else if constexpr (host_accessible<typename From::space> && host_accessible<typename To::space>) {
    convert_values(src.data(), dst.data(), n);
  } else {
    std::vector<U> sent(n);
    from.download(src.data(), std::span<U>(sent));
    std::vector<V> received(n);
    convert_values(sent.data(), received.data(), n);
    // Download and upload wait for their copies. The upload runs on the receiver's stream from the
    // sender's thread and waits for the work queued there: simple, not fast (the pipeline refuses
    // this with a second stream open, DualPipeV's overlap).
    to.upload(std::span<const V>(received), dst.data());
  }
}

}  // namespace cupipe::pipeline
