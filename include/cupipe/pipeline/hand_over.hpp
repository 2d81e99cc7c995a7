// SPDX-License-Identifier: Apache-2.0
// The hand-over between two stages of a pipeline whose workers have different backends
// (backend::PerWorker): an activation or a gradient leaves one worker in its storage type and memory
// space and arrives in the next worker's. Between two contexts of one backend type it is that
// backend's transfer(); otherwise each value converts as convert_value says, in host memory when
// either side cannot be read by the host (a device stage), directly when both can.
#pragma once

#include <algorithm>
#include <cstddef>
#include <span>
#include <type_traits>
#include <vector>

#include "cupipe/core/dtype.hpp"
#include "cupipe/core/error.hpp"
#include "cupipe/core/tensor.hpp"

namespace cupipe::pipeline {

/// One value of type U in type V. Widening (bf16 to float or double, float to double) is exact;
/// double to float rounds to nearest even; to bf16 the value goes through float (round to nearest
/// even at each step: double to bf16 rounds twice, as `bfloat16(float(x))` does in C++).
template <class V, class U>
V convert_value(U u) noexcept {
  if constexpr (std::is_same_v<U, V>) return u;
  else if constexpr (std::is_same_v<U, bfloat16>) return V(float(u));
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
    to.upload(std::span<const V>(received), dst.data());  // upload and download wait for their copies
  }
}

}  // namespace cupipe::pipeline
