// SPDX-License-Identifier: Apache-2.0
// The host's compressed hand-overs (core/wire.hpp): the round trip (ops::wire_round_trip), and the
// packed message a link moves (ops::wire_pack, ops::wire_unpack), whose unpacked values equal the
// round trip's bitwise for every finite tensor. The references for the CUDA ops
// (backend/cuda/ops.cuh), which must give the same bits in float.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>

#include "cupipe/backend/host/host.hpp"
#include "cupipe/backend/op_checks.hpp"
#include "cupipe/core/dtype.hpp"
#include "cupipe/core/float8.hpp"
#include "cupipe/core/tensor.hpp"
#include "cupipe/core/wire.hpp"

namespace cupipe::ops {

namespace detail {

/// x rounded to bfloat16 once, to nearest even (a double through bfloat16_round_trip).
template <class A>
bfloat16 wire_bf16(A x) noexcept {
  if constexpr (std::is_same_v<A, float>) return bfloat16(x);
  else return bfloat16(float(bfloat16_round_trip(double(x))));
}

/// The largest magnitude of n values, and whether every one is finite.
template <class A>
struct WireAmax {
  A value = 0;
  bool finite = true;
};
template <class A>
WireAmax<A> wire_amax(const A* x, index_t n) noexcept {
  WireAmax<A> m;
  for (index_t i = 0; i < n; ++i) {
    m.finite = m.finite && std::isfinite(x[i]);
    m.value = std::max(m.value, std::abs(x[i]));
  }
  return m;
}

/// The e4m3 scale of a tensor whose largest magnitude is `amax`: 448 / amax, or 1 where that would
/// not be finite (a tensor of zeros, or one so small, below 448 / A's largest, that its codes are
/// signed zeros either way). The CUDA ops compute the same in float.
template <class A>
A wire_scale(A amax) noexcept {
  return amax > A(float8_e4m3::max) / std::numeric_limits<A>::max() ? A(float8_e4m3::max) / amax : A(1);
}

}  // namespace detail

/// y = x as a hand-over of precision `wire` delivers it (core/wire.hpp): bf16 rounds each value to
/// bfloat16 (nearest even); e4m3 scales by 448 / max|x|, rounds each value to FP8 E4M3 (nearest even,
/// saturating) and divides by the scale, in T's arithmetic, as the CUDA op does (a tensor too small
/// for that scale to be finite takes scale 1: detail::wire_scale). A tensor of zeros or with a
/// non-finite value passes unchanged, so a later finite check still sees it. y may alias x.
template <class T>
void wire_round_trip(backend::Host<T>&, ConstView<T> x, TensorView<T> y, Wire wire) {
  checks::wire_round_trip(x, y);
  const index_t n = x.numel();
  if (wire == Wire::bf16) {
    for (index_t i = 0; i < n; ++i) y[i] = T(float(detail::wire_bf16(x[i])));
    return;
  }
  const auto [amax, finite] = detail::wire_amax(x.data(), n);
  if (wire == Wire::full || !finite || amax == T(0)) {
    if (y.data() != x.data()) std::copy_n(x.data(), n, y.data());
    return;
  }
  const T scale = detail::wire_scale(amax);
  for (index_t i = 0; i < n; ++i) y[i] = T(float(float8_e4m3(double(x[i] * scale)))) / scale;
}

namespace detail {

/// The packed message of n values in arithmetic A (float or double) into `out` (core/wire.hpp's
/// format), computing exactly as wire_round_trip does.
template <class A>
void pack_wire(const A* x, index_t n, unsigned char* out, Wire wire) {
  if (wire == Wire::bf16) {
    for (index_t i = 0; i < n; ++i) {
      const bfloat16 b = wire_bf16(x[i]);
      std::memcpy(out + 2 * i, &b.bits, 2);
    }
    return;
  }
  const auto [amax, finite] = wire_amax(x, n);
  const double header = finite ? double(amax) : std::numeric_limits<double>::quiet_NaN();
  std::memcpy(out, &header, wire_header_bytes);
  unsigned char* codes = out + wire_header_bytes;
  if (!finite) {
    std::fill_n(codes, n, 0);
    return;
  }
  const A scale = wire_scale(amax);  // zeros: their signed codes
  for (index_t i = 0; i < n; ++i) codes[i] = float8_e4m3(double(x[i] * scale)).bits;
}

/// The n values of a packed message `in`, in arithmetic A, into y.
template <class A>
void unpack_wire(const unsigned char* in, index_t n, A* y, Wire wire) {
  if (wire == Wire::bf16) {
    for (index_t i = 0; i < n; ++i) {
      bfloat16 b;
      std::memcpy(&b.bits, in + 2 * i, 2);
      y[i] = A(float(b));
    }
    return;
  }
  double header = 0;
  std::memcpy(&header, in, wire_header_bytes);
  const unsigned char* codes = in + wire_header_bytes;
  if (std::isnan(header)) {
    std::fill_n(y, n, std::numeric_limits<A>::quiet_NaN());
    return;
  }
  const A scale = wire_scale(A(header));
  for (index_t i = 0; i < n; ++i) y[i] = A(float(float8_e4m3::from_bits(codes[i]))) / scale;
}

/// The message's bytes, with the bytes past the last code (storage rounds up) zeroed.
template <class T>
unsigned char* zero_padding(TensorView<T> packed, Wire wire, index_t n) {
  auto* bytes = reinterpret_cast<unsigned char*>(packed.data());
  const std::size_t used = wire_bytes(wire, n);
  std::fill(bytes + used, bytes + std::size_t(packed.numel()) * sizeof(T), 0);
  return bytes;
}

}  // namespace detail

/// `packed` = the message a link of precision `wire` sends for x (core/wire.hpp's format).
template <class T>
void wire_pack(backend::Host<T>&, ConstView<T> x, TensorView<T> packed, Wire wire) {
  checks::wire_pack(x, packed, wire);
  detail::pack_wire(x.data(), x.numel(), detail::zero_padding(packed, wire, x.numel()), wire);
}

/// y = the values of a packed message: wire_round_trip's values for a finite tensor, all NaN for one
/// with a value that is not finite.
template <class T>
void wire_unpack(backend::Host<T>&, ConstView<T> packed, TensorView<T> y, Wire wire) {
  checks::wire_unpack(packed, y, wire);
  detail::unpack_wire(reinterpret_cast<const unsigned char*>(packed.data()), y.numel(), y.data(), wire);
}

}  // namespace cupipe::ops
