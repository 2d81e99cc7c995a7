// SPDX-License-Identifier: Apache-2.0
// FP8 E4M3 (the OCP 8-bit floating point specification's E4M3, NVIDIA's __nv_fp8_e4m3): 1 sign bit,
// 4 exponent bits (bias 7), 3 mantissa bits; no infinities, S.1111.111 is NaN, so the largest finite
// value is 448 and the smallest subnormal 2^-9. Conversion rounds to nearest, ties to even, and
// saturates: a finite value or an infinity beyond 448 becomes +-448 (CUDA's __NV_SATFINITE), NaN stays
// NaN. This is the host's reference for the CUDA conversions (cuda_fp8.h), so both give the same bits.
// Also the round trip of a double through bfloat16 (the float one is core/dtype.hpp's bfloat16).
#pragma once

#include <algorithm>
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
}  // namespace detail

struct float8_e4m3 {
  std::uint8_t bits = 0;
  static constexpr double max = 448;

  float8_e4m3() = default;
  /// Round to nearest even, saturating to +-448; NaN gives the NaN code (sign kept).
  explicit float8_e4m3(double value) noexcept {
    const std::uint8_t sign = std::signbit(value) ? 0x80 : 0x00;
    if (std::isnan(value)) {
      bits = sign | 0x7F;
      return;
    }
    const double a = std::fabs(value);
    const double q = a >= max ? max : detail::round_to_format(a, 3, -6);
    if (q == 0) {
      bits = sign;
      return;
    }
    const int exponent = std::ilogb(q);
    if (exponent < -6) {  // subnormal: 0.mmm x 2^-6
      bits = std::uint8_t(sign | std::uint8_t(std::ldexp(q, 9)));
    } else {
      const int mantissa = int(std::ldexp(q, 3 - exponent)) - 8;
      bits = std::uint8_t(sign | ((exponent + 7) << 3) | mantissa);
    }
  }
  static float8_e4m3 from_bits(std::uint8_t b) noexcept {
    float8_e4m3 out;
    out.bits = b;
    return out;
  }
  explicit operator float() const noexcept {
    const int exponent = (bits >> 3) & 0xF, mantissa = bits & 0x7;
    const float sign = bits & 0x80 ? -1.0f : 1.0f;
    if (exponent == 15 && mantissa == 7) return std::numeric_limits<float>::quiet_NaN();
    if (exponent == 0) return sign * std::ldexp(float(mantissa), -9);
    return sign * std::ldexp(float(8 + mantissa), exponent - 10);
  }
};

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
