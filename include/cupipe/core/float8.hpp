// SPDX-License-Identifier: Apache-2.0
// The OCP 8-bit floating point specification's two formats (NVIDIA's __nv_fp8_e4m3, __nv_fp8_e5m2):
// - E4M3: 1 sign bit, 4 exponent bits (bias 7), 3 mantissa bits; no infinities, S.1111.111 is NaN, so
//   the largest finite value is 448 and the smallest subnormal 2^-9;
// - E5M2: 1 sign bit, 5 exponent bits (bias 15), 2 mantissa bits, IEEE-like: S.11111.00 is an
//   infinity and S.11111.{01,10,11} NaN; the largest finite value is 57344 and the smallest
//   subnormal 2^-16.
// Conversion rounds to nearest, ties to even, and saturates: a finite value or an infinity beyond the
// largest becomes +-largest (CUDA's __NV_SATFINITE), NaN stays NaN. This is the host's reference for
// the CUDA conversions (cuda_fp8.h), so both give the same bits for every value but NaN: the host
// keeps a NaN's sign (E4M3 S.1111.111, E5M2 S.11111.10), CUDA's float conversion gives 0x7F.
// Also the round trip of a double through bfloat16 (the float one is core/dtype.hpp's bfloat16).
#pragma once

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>

namespace cupipe {

namespace detail {
/// |a| (finite, >= 0) rounded to nearest even on the grid of a binary format with `mantissa_bits`
/// stored bits and smallest normal exponent `min_exponent` (its subnormals spaced 2^(min_exponent -
/// mantissa_bits)). No overflow handling: the caller bounds the result.
inline double round_to_format(double a, int mantissa_bits, int min_exponent) noexcept {
  if (a == 0) return a;
  const int exponent = std::max(std::ilogb(a), min_exponent);
  const double spacing = std::ldexp(1.0, exponent - mantissa_bits);
  return std::nearbyint(a / spacing) * spacing;  // a / spacing is exact; nearbyint rounds ties to even
}

/// An OCP 8-bit format of E exponent bits and M mantissa bits. `Ieee` (E5M2): the top exponent holds
/// the infinities (mantissa 0) and NaNs; otherwise (E4M3) only S.1111.111 is NaN and the rest of the
/// top exponent holds finite values.
template <int E, int M, bool Ieee>
struct float8 {
  static constexpr int bias = (1 << (E - 1)) - 1;
  static constexpr int min_exponent = 1 - bias;  ///< of the normals; subnormals are spaced 2^(min_exponent - M)
  static constexpr int top = (1 << E) - 1;       ///< the exponent field of the NaNs
  /// The largest finite value: the top exponent's second-largest mantissa (E4M3), or the exponent
  /// below the top with every mantissa bit set (E5M2).
  static constexpr double max = [] {
    const int exponent = (Ieee ? top - 1 : top) - bias, mantissa = Ieee ? (1 << M) - 1 : (1 << M) - 2;
    double v = 1.0 + double(mantissa) / double(1 << M);
    for (int i = 0; i < exponent; ++i) v *= 2;
    return v;
  }();

  std::uint8_t bits = 0;

  float8() = default;
  /// Round to nearest even, saturating to +-max (an infinity too); NaN gives a NaN code, sign kept.
  explicit float8(double value) noexcept {
    const std::uint8_t sign = std::signbit(value) ? 0x80 : 0x00;
    if (std::isnan(value)) {
      bits = std::uint8_t(sign | (Ieee ? (top << M) | (1 << (M - 1)) : 0x7F));
      return;
    }
    const double a = std::fabs(value);
    const double q = a >= max ? max : round_to_format(a, M, min_exponent);
    if (q == 0) {
      bits = sign;
      return;
    }
    const int exponent = std::ilogb(q);
    if (exponent < min_exponent) {  // subnormal: 0.m x 2^min_exponent
      bits = std::uint8_t(sign | std::uint8_t(std::ldexp(q, M - min_exponent)));
    } else {
      const int mantissa = int(std::ldexp(q, M - exponent)) - (1 << M);
      bits = std::uint8_t(sign | ((exponent + bias) << M) | mantissa);
    }
  }
  /// The bits of +max: S.1111.110 (E4M3), S.11110.11 (E5M2).
  static constexpr std::uint8_t max_bits = Ieee ? std::uint8_t(((top - 1) << M) | ((1 << M) - 1))
                                                : std::uint8_t((top << M) | ((1 << M) - 2));

  /// float8(double(value)), bit for bit, from the float's bits: what quantising a tensor calls per
  /// element (the double constructor's ilogb and ldexp cost several times more). The mantissa is
  /// rounded to M bits, ties to even, on the float's own bits; below the smallest normal the value
  /// is rounded to a multiple of the smallest subnormal by adding and subtracting 2^23.
  static float8 from_float(float value) noexcept {
    std::uint32_t u = std::bit_cast<std::uint32_t>(value);
    const std::uint8_t sign = std::uint8_t((u >> 24) & 0x80);
    u &= 0x7FFFFFFFu;
    if (u > 0x7F800000u) return float8(double(value));                 // NaN: the constructor keeps its sign
    if (std::bit_cast<float>(u) >= float(max)) return from_bits(sign | max_bits);  // saturate (an infinity too)
    constexpr int shift = 23 - M;
    if (int(u >> 23) - 127 < min_exponent) {
      // Multiples of 2^(min_exponent - M); a count of 2^M is the smallest normal, whose bits it is.
      const float steps = std::bit_cast<float>(u) * std::ldexp(1.0f, M - min_exponent);  // < 2^M, exact
      return from_bits(std::uint8_t(sign | int((steps + 8388608.0f) - 8388608.0f)));  // nearest even
    }
    u += ((1u << (shift - 1)) - 1) + ((u >> shift) & 1u);  // round to nearest even at bit `shift`
    const int exponent = int(u >> 23) - 127;
    return from_bits(std::uint8_t(sign | ((exponent + bias) << M) | ((u >> shift) & ((1u << M) - 1))));
  }

  static float8 from_bits(std::uint8_t b) noexcept {
    float8 out;
    out.bits = b;
    return out;
  }
  explicit operator float() const noexcept {
    const int exponent = (bits >> M) & top, mantissa = bits & ((1 << M) - 1);
    const float sign = bits & 0x80 ? -1.0f : 1.0f;
    if (exponent == top && (Ieee || mantissa == (1 << M) - 1))
      return Ieee && mantissa == 0 ? sign * std::numeric_limits<float>::infinity() : std::numeric_limits<float>::quiet_NaN();
    if (exponent == 0) return sign * std::ldexp(float(mantissa), min_exponent - M);
    return sign * std::ldexp(float((1 << M) + mantissa), exponent - bias - M);
  }
};

}  // namespace detail

using float8_e4m3 = detail::float8<4, 3, false>;
using float8_e5m2 = detail::float8<5, 2, true>;
static_assert(float8_e4m3::max == 448 && float8_e5m2::max == 57344);


/// A double rounded to bfloat16 (nearest even; beyond the largest bfloat16 an infinity) and back,
/// in one rounding (not through float, which would round twice).
inline double bfloat16_round_trip(double value) noexcept {
  if (!std::isfinite(value)) return value;
  const double a = std::fabs(value);
  constexpr double largest = 0x1.FEp127;  // (2 - 2^-7) 2^127
  const double q = detail::round_to_format(a, 7, -126);
  return std::copysign(q > largest ? std::numeric_limits<double>::infinity() : q, value);
}

}  // namespace cupipe
