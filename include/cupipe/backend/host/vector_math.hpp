// SPDX-License-Identifier: Apache-2.0
// exp and tanh for float that a compiler vectorises. libm's expf and tanhf are calls, so a loop over
// them runs one element at a time: in a host GPT step (gpt::tiny, perf on the 2-core VM) tanhf and the
// expm1f it calls took 26% of the samples, all of it GELU. These are straight-line arithmetic with no
// calls, branches or errno (selects become blends), so GELU's loops run 4 or 8 lanes wide.
//
// Accuracy: within 2 ulp of the exact result for every float (tests/host/test_vector_math.cpp checks a
// sweep of the whole range against long double). Unlike libm, exp() returns 0 where the exact result
// is subnormal (below about -87.34). double keeps libm: the float64 finite-difference checks of the
// layers stay exact. Code built with -ffast-math gets libm for float too (arithmetic_rewritten).
#pragma once

#include <bit>
#include <cmath>
#include <cstdint>
#include <type_traits>

namespace cupipe::host_math {

/// e^x. x = n ln2 + r with |r| <= ln2 / 2 (Cody and Waite's two-part ln2, so n ln2 is exact), then
/// 2^n e^r with e^r = 1 + r + r^2 q(r), q a degree-4 polynomial fitted for relative error (3e-9 before
/// rounding). 0 below -87.34 (and for -inf), infinity above 88.72, NaN for NaN.
inline float exp(float x) noexcept {
  constexpr float lo = -87.33654f, hi = 88.72283f;  // e^lo is the least normal float, e^hi the largest float
  constexpr float log2e = 1.44269504088896341f;
  constexpr float ln2_hi = 0.693145751953125f;  // ln 2 to 16 bits: n ln2_hi is exact for |n| <= 2^8
  constexpr float ln2_lo = 1.42860682030941723212e-6f;
  constexpr float round_magic = 12582912.0f;  // 1.5 * 2^23: adding it rounds to an integer in the low bits
  // Every comparison is made unconditionally and only selects depend on it: GCC will not if-convert a
  // comparison that runs only on one side of another (under its default -ftrapping-math).
  const bool below = x < lo, above = x > hi, nan = x != x;
  float xc = below ? lo : x;  // NaN stays NaN through both
  xc = above ? hi : xc;
  const float shifted = xc * log2e + round_magic;
  const float n = shifted - round_magic;
  // The integer n from the bits of `shifted`, not a float-to-int conversion (undefined for NaN).
  const std::int32_t ni = std::bit_cast<std::int32_t>(shifted) - std::bit_cast<std::int32_t>(round_magic);
  const float r = (xc - n * ln2_hi) - n * ln2_lo;
  const float q = 0.49999993412261057f +
                  r * (0.16666520105546168f + r * (0.04166839425915349f + r * (0.008368780622233674f + r * 0.0013814464752443837f)));
  const float er = 1.0f + r + r * r * q;
  // 2^n for n in [-126, 128]: 2^128 is not a float, so n = 128 scales by 2^127 and then by 2.
  const std::int32_t top = ni > 127 ? 1 : 0;
  const float scale = std::bit_cast<float>(static_cast<std::uint32_t>(ni - top + 127) << 23);  // (NaN: any bits, unused)
  float result = er * scale * (top ? 2.0f : 1.0f);
  result = below ? 0.0f : result;
  result = above ? HUGE_VALF : result;
  return nan ? x : result;
}

/// tanh(x). Below |x| = 0.625 an odd polynomial, x + x^3 p(x^2) with p of degree 4 fitted for relative
/// error (5e-9); above it 1 - 2 / (e^{2|x|} + 1), which cancels little there (the result is over 0.55).
/// |x| beyond 10 gives +-1, as tanh rounds to in float; the sign of -0 is kept; NaN stays NaN.
inline float tanh(float x) noexcept {
  const float a = std::fabs(x);
  const float y = a * a;
  const float near_zero =
      a + a * y * (-0.33333283926446755f + y * (0.1333149131230018f + y * (-0.05374349986589807f +
                                                                            y * (0.020650592377087256f - y * 0.005717050118153045f))));
  const float twice = 2.0f * a;
  const bool saturated = twice > 20.0f, small = a < 0.625f;
  const float e = host_math::exp(saturated ? 20.0f : twice);
  const float away = 1.0f - 2.0f / (e + 1.0f);
  return std::copysign(small ? near_zero : away, x);
}

/// Whether this translation unit lets the compiler rewrite floating-point arithmetic (-ffast-math,
/// -ffinite-math-only): it could fold exp()'s rounding step (x + magic - magic) away, or drop its NaN
/// test, so tanh_of and exp_of use libm there.
#if defined(__FAST_MATH__) || (defined(__FINITE_MATH_ONLY__) && __FINITE_MATH_ONLY__)
inline constexpr bool arithmetic_rewritten = true;
#else
inline constexpr bool arithmetic_rewritten = false;
#endif

/// tanh for the host ops' element type: the vectorisable one for float, libm's otherwise.
template <class T>
T tanh_of(T x) noexcept {
  if constexpr (std::is_same_v<T, float> && !arithmetic_rewritten) return host_math::tanh(x);
  else return std::tanh(x);
}

/// e^x for the host ops' element type: the vectorisable one for float, libm's otherwise.
template <class T>
T exp_of(T x) noexcept {
  if constexpr (std::is_same_v<T, float> && !arithmetic_rewritten) return host_math::exp(x);
  else return std::exp(x);
}

}  // namespace cupipe::host_math
