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
//
// Run-time instruction sets (vectorised()): a build for generic x86-64 vectorises with SSE2 only, 4
// floats a lane group. The host ops' float loops are compiled a second and third time for AVX2 and
// AVX-512F and the widest this CPU runs is picked once, at the first call. Every clone computes the
// same bits: the loops are element-wise (no reductions the compiler could reorder) and cupipe::host
// builds with -ffp-contract=off, so no clone fuses a multiply and an add the others round twice
// (tests/host/test_vector_isa.cpp compares every clone against the baseline, bitwise).
#pragma once

#include <atomic>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <string_view>
#include <type_traits>

#include "cupipe/core/error.hpp"

namespace cupipe::backend::host {

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
  const float e = backend::host::exp(saturated ? 20.0f : twice);
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
  if constexpr (std::is_same_v<T, float> && !arithmetic_rewritten) return backend::host::tanh(x);
  else return std::tanh(x);
}

/// e^x for the host ops' element type: the vectorisable one for float, libm's otherwise.
template <class T>
T exp_of(T x) noexcept {
  if constexpr (std::is_same_v<T, float> && !arithmetic_rewritten) return backend::host::exp(x);
  else return std::exp(x);
}

// ---------------------------------------------------------------------------------------------
// The vector instruction set of the host's float loops, chosen at run time.

/// Whether the float loops are compiled for AVX2 and AVX-512F beside the baseline: x86-64 with GCC
/// or Clang (their target attribute). Define it 0 to build the baseline only.
#ifndef CUPIPE_HOST_ISA_DISPATCH
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define CUPIPE_HOST_ISA_DISPATCH 1
#else
#define CUPIPE_HOST_ISA_DISPATCH 0
#endif
#endif

/// The instruction sets a vectorised() loop can run with, narrowest first.
enum class VectorIsa : int { baseline = 0, avx2 = 1, avx512 = 2 };

inline constexpr std::string_view name(VectorIsa isa) noexcept {
  switch (isa) {
    case VectorIsa::avx2: return "avx2";
    case VectorIsa::avx512: return "avx512";
    default: return "baseline";
  }
}

/// "baseline", "avx2" or "avx512" as a VectorIsa; anything else throws, naming `what` (the setting).
inline VectorIsa parse_vector_isa(std::string_view text, std::string_view what) {
  for (VectorIsa isa : {VectorIsa::baseline, VectorIsa::avx2, VectorIsa::avx512})
    if (text == name(isa)) return isa;
  CUPIPE_THROW(what, "=", text, ": expected baseline, avx2 or avx512");
}

/// The widest instruction set this CPU and its OS run (both checked by the compiler's
/// __builtin_cpu_supports); baseline where CUPIPE_HOST_ISA_DISPATCH is 0.
inline VectorIsa widest_vector_isa() noexcept {
#if CUPIPE_HOST_ISA_DISPATCH
  static const VectorIsa widest = [] {
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f")) return VectorIsa::avx512;
    if (__builtin_cpu_supports("avx2")) return VectorIsa::avx2;
    return VectorIsa::baseline;
  }();
  return widest;
#else
  return VectorIsa::baseline;
#endif
}

namespace detail {
/// The chosen VectorIsa, or -1 before the first vector_isa() or set_vector_isa().
inline std::atomic<int>& chosen_vector_isa() noexcept {
  static std::atomic<int> chosen{-1};
  return chosen;
}

inline VectorIsa runnable(VectorIsa isa, std::string_view what) {
  CUPIPE_REQUIRE(isa <= widest_vector_isa(), what, "=", name(isa), ": this CPU runs at most ", name(widest_vector_isa()),
                 CUPIPE_HOST_ISA_DISPATCH ? "" : " (this build has CUPIPE_HOST_ISA_DISPATCH=0)");
  return isa;
}

#if CUPIPE_HOST_ISA_DISPATCH
// The clones: `body` inlines into each (it is marked CUPIPE_VECTOR_BODY; its target is the default,
// a subset of theirs, so both compilers inline it) and is compiled there for the wider target. The
// body comes by value: its captures are then this frame's own, and the compiler keeps them in
// registers (through a reference, a float store in the loop might alias a captured float, and GCC
// reloaded AdamW's hyper-parameters every element: the MLP's step 28% slower).
template <class Body>
[[gnu::target("avx2")]] void run_avx2(Body body) {
  body();
}
template <class Body>
[[gnu::target("avx512f")]] void run_avx512(Body body) {
  body();
}
#endif
}  // namespace detail

/// The instruction set the float loops use: set_vector_isa()'s if called, else the environment
/// variable CUPIPE_HOST_ISA's (read at the first call), else the widest the CPU runs. A
/// CUPIPE_HOST_ISA that names no set, or one this CPU lacks, throws here, at every call.
inline VectorIsa vector_isa() {
  const int chosen = detail::chosen_vector_isa().load(std::memory_order_relaxed);
  if (chosen >= 0) return VectorIsa(chosen);
  VectorIsa isa = widest_vector_isa();
  if (const char* env = std::getenv("CUPIPE_HOST_ISA"); env != nullptr && *env != 0)
    isa = detail::runnable(parse_vector_isa(env, "CUPIPE_HOST_ISA"), "CUPIPE_HOST_ISA");
  detail::chosen_vector_isa().store(int(isa), std::memory_order_relaxed);
  return isa;
}

/// Makes the float loops use `isa` from now on (for a comparison, or to rule the vector code out
/// while debugging); throws if this CPU does not run it. The results do not change, only the speed.
inline void set_vector_isa(VectorIsa isa) {
  detail::chosen_vector_isa().store(int(detail::runnable(isa, "set_vector_isa")), std::memory_order_relaxed);
}

/// Marks a lambda given to vectorised() so that it inlines into each clone.
#define CUPIPE_VECTOR_BODY __attribute__((always_inline))

/// Runs `body()`, compiled for vector_isa(), when T is float; any other T runs the baseline (double
/// is the finite-difference oracle's type and gains little from the width). `body` is a lambda that
/// captures by value ([=]: pointers, views and scalars), for the reason given at run_avx2.
template <class T, class Body>
void vectorised(Body body) {
#if CUPIPE_HOST_ISA_DISPATCH
  if constexpr (std::is_same_v<T, float>) {
    switch (vector_isa()) {
      case VectorIsa::avx512: detail::run_avx512(body); return;
      case VectorIsa::avx2: detail::run_avx2(body); return;
      default: break;
    }
  }
#endif
  body();
}

}  // namespace cupipe::backend::host
