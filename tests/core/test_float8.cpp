// SPDX-License-Identifier: Apache-2.0
// FP8 E4M3 against the OCP 8-bit floating point specification: every one of the 256 codes decoded
// from the bit layout, every code round-tripped, every tie between neighbours rounded to the even
// code, saturation at 448 and NaN; bfloat16's rounding of doubles; and the hand-over round trip
// (ops::wire_round_trip) and its packed message (ops::wire_pack, wire_unpack) on the host, whose
// CUDA twins tests/cuda checks against them.
#include <catch2/catch.hpp>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "cupipe/backend/host/ops.hpp"
#include "cupipe/backend/host/ops_bf16.hpp"
#include "cupipe/core/rng.hpp"
#include "cupipe/core/float8.hpp"
#include "cupipe/core/wire.hpp"

namespace {

using cupipe::float8_e4m3;

/// The specification's value of code `c`: (-1)^s 2^(e-7) (1 + m/8) for e > 0, (-1)^s 2^-6 (m/8) for
/// e = 0; S.1111.111 is NaN (E4M3 has no infinities).
double spec_value(int c) {
  const int s = c >> 7, e = (c >> 3) & 0xF, m = c & 7;
  if (e == 15 && m == 7) return std::numeric_limits<double>::quiet_NaN();
  const double magnitude = e == 0 ? std::ldexp(m / 8.0, -6) : std::ldexp(1 + m / 8.0, e - 7);
  return s ? -magnitude : magnitude;
}

TEST_CASE("float8_e4m3 decodes every code as the OCP specification", "[core][float8]") {
  for (int c = 0; c < 256; ++c) {
    const float value = float(float8_e4m3::from_bits(std::uint8_t(c)));
    const double expected = spec_value(c);
    if (std::isnan(expected)) CHECK(std::isnan(value));
    else CHECK(double(value) == expected);
  }
  CHECK(float(float8_e4m3::from_bits(0x7E)) == 448.0f);
  CHECK(float(float8_e4m3::from_bits(0x01)) == std::ldexp(1.0f, -9));
  CHECK(float(float8_e4m3::from_bits(0x38)) == 1.0f);
}

TEST_CASE("float8_e4m3 encodes every value to its own code, ties to even, saturating", "[core][float8]") {
  for (int c = 0; c < 256; ++c) {
    const double v = spec_value(c);
    if (std::isnan(v)) {
      CHECK((float8_e4m3(v).bits & 0x7F) == 0x7F);
      continue;
    }
    CHECK(float8_e4m3(v).bits == c);
  }
  // Between neighbouring positive codes c and c + 1: below the midpoint rounds down, above it up,
  // and the midpoint goes to the code with an even mantissa.
  for (int c = 0; c < 0x7E; ++c) {
    const double lo = spec_value(c), hi = spec_value(c + 1), mid = (lo + hi) / 2;
    CHECK(float8_e4m3(std::nextafter(mid, lo)).bits == c);
    CHECK(float8_e4m3(std::nextafter(mid, hi)).bits == c + 1);
    CHECK(float8_e4m3(mid).bits == (c % 2 == 0 ? c : c + 1));
    CHECK(float8_e4m3(-mid).bits == (0x80 | (c % 2 == 0 ? c : c + 1)));
  }
  CHECK(float8_e4m3(449.0).bits == 0x7E);
  CHECK(float8_e4m3(1e30).bits == 0x7E);
  CHECK(float8_e4m3(std::numeric_limits<double>::infinity()).bits == 0x7E);
  CHECK(float8_e4m3(-std::numeric_limits<double>::infinity()).bits == 0xFE);
  CHECK(float8_e4m3(std::ldexp(1.0, -11)).bits == 0x00);  // a quarter of the smallest subnormal
  CHECK(float8_e4m3(-0.0).bits == 0x80);
}

/// E5M2's value of code `c` by the specification: (-1)^s 2^(e-15) (1 + m/4) for 0 < e < 31,
/// (-1)^s 2^-14 (m/4) for e = 0; e = 31 is an infinity for m = 0 and NaN otherwise.
double spec_value_e5m2(int c) {
  const int s = c >> 7, e = (c >> 2) & 0x1F, m = c & 3;
  if (e == 31) return m == 0 ? (s ? -1 : 1) * std::numeric_limits<double>::infinity() : std::numeric_limits<double>::quiet_NaN();
  const double magnitude = e == 0 ? std::ldexp(m / 4.0, -14) : std::ldexp(1 + m / 4.0, e - 15);
  return s ? -magnitude : magnitude;
}

TEST_CASE("float8_e5m2 decodes every code as the OCP specification", "[core][float8]") {
  using cupipe::float8_e5m2;
  for (int c = 0; c < 256; ++c) {
    const float value = float(float8_e5m2::from_bits(std::uint8_t(c)));
    const double expected = spec_value_e5m2(c);
    if (std::isnan(expected)) CHECK(std::isnan(value));
    else CHECK(double(value) == expected);
  }
  CHECK(float(float8_e5m2::from_bits(0x7B)) == 57344.0f);
  CHECK(float(float8_e5m2::from_bits(0x01)) == std::ldexp(1.0f, -16));
  CHECK(float(float8_e5m2::from_bits(0x3C)) == 1.0f);
  CHECK(std::isinf(float(float8_e5m2::from_bits(0xFC))));
}

TEST_CASE("float8_e5m2 encodes every value to its own code, ties to even, saturating", "[core][float8]") {
  using cupipe::float8_e5m2;
  for (int c = 0; c < 256; ++c) {
    const double v = spec_value_e5m2(c);
    if (std::isnan(v)) {
      const std::uint8_t got = float8_e5m2(v).bits;
      CHECK(((got >> 2) & 0x1F) == 31);
      CHECK((got & 3) != 0);
      continue;
    }
    if (std::isinf(v)) {
      CHECK(float8_e5m2(v).bits == (c & 0x80) + 0x7B);  // saturating: an infinity becomes the largest
      continue;
    }
    CHECK(float8_e5m2(v).bits == c);
  }
  for (int c = 0; c < 0x7B; ++c) {
    const double lo = spec_value_e5m2(c), hi = spec_value_e5m2(c + 1), mid = (lo + hi) / 2;
    CHECK(float8_e5m2(std::nextafter(mid, lo)).bits == c);
    CHECK(float8_e5m2(std::nextafter(mid, hi)).bits == c + 1);
    CHECK(float8_e5m2(mid).bits == (c % 2 == 0 ? c : c + 1));
    CHECK(float8_e5m2(-mid).bits == (0x80 | (c % 2 == 0 ? c : c + 1)));
  }
  CHECK(float8_e5m2(61440.0).bits == 0x7B);  // the midpoint to 2^16 saturates
  CHECK(float8_e5m2(1e30).bits == 0x7B);
  CHECK(float8_e5m2(-1e30).bits == 0xFB);
  CHECK(float8_e5m2(std::ldexp(1.0, -17)).bits == 0x00);  // half the smallest subnormal: ties to 0
  CHECK(float8_e5m2(std::ldexp(1.5, -17)).bits == 0x01);
  CHECK(float8_e5m2(-0.0).bits == 0x80);
}

namespace {

/// Every float at and around the format's grid (each value, the midpoints between neighbours and
/// the floats either side of each), around its largest value, the float extremes, and a million
/// floats drawn across every exponent: from_float must give the double constructor's bits for each.
template <class F>
void check_from_float() {
  std::vector<float> probes{0.0f, std::numeric_limits<float>::denorm_min(), std::numeric_limits<float>::min(),
                            std::numeric_limits<float>::max(), std::numeric_limits<float>::infinity(),
                            float(F::max), std::nextafter(float(F::max), 0.0f), std::nextafter(float(F::max), 1e30f)};
  std::vector<float> grid;
  for (int b = 0; b < 128; ++b) {
    const float v = float(F::from_bits(std::uint8_t(b)));
    if (std::isfinite(v)) grid.push_back(v);
  }
  std::sort(grid.begin(), grid.end());
  for (std::size_t i = 0; i < grid.size(); ++i) {
    const float next = i + 1 < grid.size() ? grid[i + 1] : 2 * grid[i];
    for (const float v : {grid[i], 0.5f * (grid[i] + next)})
      for (const float w : {v, std::nextafter(v, 0.0f), std::nextafter(v, 1e30f)}) probes.push_back(w);
  }
  cupipe::Rng rng(8);
  for (int i = 0; i < 1000000; ++i)
    probes.push_back(std::bit_cast<float>(std::uint32_t(rng.below(0x7F800000))));  // every finite magnitude
  int mismatched = 0;
  for (const float p : probes)
    for (const float v : {p, -p}) {
      const std::uint8_t fast = F::from_float(v).bits, exact = F(double(v)).bits;
      if (fast != exact && ++mismatched <= 5) FAIL_CHECK(v << ": from_float " << int(fast) << ", the constructor " << int(exact));
    }
  CHECK(mismatched == 0);
  CHECK(F::from_float(std::numeric_limits<float>::quiet_NaN()).bits == F(std::nan("")).bits);
  CHECK(F::from_float(-std::numeric_limits<float>::infinity()).bits == (0x80 | F::max_bits));
}

}  // namespace

TEST_CASE("float8 from_float: the double constructor's bits for every float on and around the grid", "[core][float8]") {
  check_from_float<float8_e4m3>();
  check_from_float<cupipe::float8_e5m2>();
}

TEST_CASE("bfloat16_round_trip rounds a double once, to nearest even", "[core][float8]") {
  CHECK(cupipe::bfloat16_round_trip(1.0) == 1.0);
  const double ulp = std::ldexp(1.0, -7);  // bfloat16's spacing in [1, 2)
  CHECK(cupipe::bfloat16_round_trip(1.0 + ulp / 2) == 1.0);              // tie: the even one
  CHECK(cupipe::bfloat16_round_trip(1.0 + 3 * ulp / 2) == 1.0 + 2 * ulp);  // tie: the even one
  // Just above a tie: one rounding goes up; rounding through float first would land on the tie.
  const double above = 1.0 + ulp / 2 + std::ldexp(1.0, -40);
  CHECK(cupipe::bfloat16_round_trip(above) == 1.0 + ulp);
  CHECK(std::isinf(cupipe::bfloat16_round_trip(1e39)));
  CHECK(cupipe::bfloat16_round_trip(-3.0) == -3.0);
}

TEST_CASE("wire_round_trip: full copies, bf16 rounds each value, e4m3 scales to 448 and rounds", "[core][float8]") {
  cupipe::backend::Host<double> be;
  std::vector<double> x{0.1, -2.5, 3.0e-3, 7.0, -7.25, 1e-6, 0.0, 6.9999};
  std::vector<double> y(x.size());
  const cupipe::ConstView<double> xv{x.data(), cupipe::Shape{2, 4}};
  const cupipe::TensorView<double> yv{y.data(), cupipe::Shape{2, 4}};
  wire_round_trip(be, xv, yv, cupipe::Wire::full);
  CHECK(y == x);
  wire_round_trip(be, xv, yv, cupipe::Wire::bf16);
  for (std::size_t i = 0; i < x.size(); ++i) CHECK(y[i] == cupipe::bfloat16_round_trip(x[i]));
  wire_round_trip(be, xv, yv, cupipe::Wire::e4m3);
  const double scale = 448.0 / 7.25;
  CHECK(y[4] == -7.25);  // the largest magnitude maps to 448 exactly
  for (std::size_t i = 0; i < x.size(); ++i) {
    // Each value is an E4M3 code over the scale, the nearest one: within half a step of E4M3's grid.
    const double q = y[i] * scale;
    CHECK(std::abs(double(float(float8_e4m3(q))) - q) <= 1e-12 * std::abs(q));
    CHECK(std::abs(y[i] - x[i]) <= std::max(std::abs(x[i]) / 16, std::ldexp(1.0, -10) / scale));
  }
  CHECK(y[6] == 0.0);
  // A tensor with a non-finite value passes unchanged (the finite checks after it still see it).
  x[2] = std::numeric_limits<double>::infinity();
  wire_round_trip(be, xv, yv, cupipe::Wire::e4m3);
  CHECK(y[0] == x[0]);
  CHECK(std::isinf(y[2]));
}

/// Values over ten binary orders of magnitude, both signs, some exact zeros of either sign.
template <class T>
std::vector<T> spread_values(std::size_t n, std::uint64_t seed) {
  cupipe::Rng rng(seed);
  std::vector<T> x(n);
  for (std::size_t i = 0; i < n; ++i) x[i] = T(rng.uniform(-1.0, 1.0) * std::ldexp(1.0, int(i % 11) - 5));
  x[3] = T(0.0);
  x[5] = T(-0.0);
  return x;
}

template <class T>
bool same_bits(const std::vector<T>& a, const std::vector<T>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0;
}

/// unpack(pack(x)) for storage T on backend B.
template <class B, class T>
std::vector<T> through_message(B& be, const std::vector<T>& x, cupipe::Wire wire, std::vector<T>* packed_out = nullptr) {
  const auto n = cupipe::index_t(x.size());
  std::vector<T> packed(std::size_t(cupipe::wire_elements<T>(wire, n))), y(x.size());
  std::memset(packed.data(), 0xFF, packed.size() * sizeof(T));  // so that unwritten bytes show
  wire_pack(be, cupipe::ConstView<T>{x.data(), cupipe::Shape{n}}, cupipe::TensorView<T>{packed.data(), cupipe::Shape{cupipe::index_t(packed.size())}}, wire);
  wire_unpack(be, cupipe::ConstView<T>{packed.data(), cupipe::Shape{cupipe::index_t(packed.size())}}, cupipe::TensorView<T>{y.data(), cupipe::Shape{n}}, wire);
  if (packed_out) *packed_out = packed;
  return y;
}

template <class B, class T>
std::vector<T> round_tripped(B& be, const std::vector<T>& x, cupipe::Wire wire) {
  std::vector<T> y(x.size());
  const cupipe::Shape s{cupipe::index_t(x.size())};
  wire_round_trip(be, cupipe::ConstView<T>{x.data(), s}, cupipe::TensorView<T>{y.data(), s}, wire);
  return y;
}

TEST_CASE("wire_pack's message: its size, and unpacked, wire_round_trip's values bitwise", "[core][float8]") {
  using cupipe::Wire;
  // A quarter of float's bytes plus the 8-byte header; an eighth of double's; bf16 a half and a quarter.
  CHECK(cupipe::wire_bytes(Wire::e4m3, 7) == 15);  // the 8-byte header and one code each
  CHECK(cupipe::wire_bytes(Wire::bf16, 7) == 14);
  CHECK(cupipe::wire_elements<float>(Wire::e4m3, 4096) == 1026);
  CHECK(cupipe::wire_elements<double>(Wire::e4m3, 4096) == 513);
  CHECK(cupipe::wire_elements<float>(Wire::bf16, 4096) == 2048);
  CHECK(cupipe::wire_elements<float>(Wire::bf16, 7) == 4);  // 14 bytes round up to whole floats
  CHECK(cupipe::wire_elements<cupipe::bfloat16>(Wire::e4m3, 7) == 8);
  CHECK_FALSE(cupipe::wire_packs<cupipe::bfloat16>(Wire::bf16));
  CHECK_FALSE(cupipe::wire_packs<float>(Wire::full));

  cupipe::backend::Host<float> hf;
  cupipe::backend::Host<double> hd;
  for (const std::size_t n : {std::size_t(1), std::size_t(7), std::size_t(64), std::size_t(1001)}) {
    for (const Wire wire : {Wire::bf16, Wire::e4m3}) {
      const auto xf = spread_values<float>(std::max<std::size_t>(n, 6), 11 + n);
      CHECK(same_bits(through_message(hf, xf, wire), round_tripped(hf, xf, wire)));
      const auto xd = spread_values<double>(std::max<std::size_t>(n, 6), 17 + n);
      CHECK(same_bits(through_message(hd, xd, wire), round_tripped(hd, xd, wire)));
    }
  }
  // The header holds the largest magnitude; zeros keep their sign; a zero tensor stays zeros.
  std::vector<float> packed;
  const std::vector<float> x{0.5f, -3.0f, 0.0f, -0.0f, 1e-3f};
  const auto y = through_message(hf, x, Wire::e4m3, &packed);
  double header = 0;
  std::memcpy(&header, packed.data(), sizeof header);
  CHECK(header == 3.0);
  CHECK(y[1] == -3.0f);
  CHECK(std::signbit(y[3]));
  CHECK_FALSE(std::signbit(y[2]));
  const std::vector<float> zeros{0.0f, -0.0f, 0.0f};
  CHECK(same_bits(through_message(hf, zeros, Wire::e4m3), zeros));
  // A tensor too small for 448 / amax to be finite in float takes scale 1: signed zeros, not NaN,
  // in the round trip and the message alike.
  const std::vector<float> tiny{1e-37f, -1e-37f, 5e-38f};
  const std::vector<float> tiny_round = round_tripped(hf, tiny, Wire::e4m3);
  CHECK(same_bits(tiny_round, std::vector<float>{0.0f, -0.0f, 0.0f}));
  CHECK(same_bits(through_message(hf, tiny, Wire::e4m3), tiny_round));
  // Bytes past the last code are zero, so equal tensors make equal messages.
  const auto* bytes = reinterpret_cast<const unsigned char*>(packed.data());
  for (std::size_t i = 8 + x.size(); i < packed.size() * sizeof(float); ++i) CHECK(bytes[i] == 0);
}

TEST_CASE("wire_pack: bf16 storage packs e4m3 as its round trip computes, and a non-finite tensor arrives as NaN",
          "[core][float8]") {
  using cupipe::Wire;
  cupipe::ops::HostBf16 hb;
  std::vector<cupipe::bfloat16> xb;
  for (const float v : spread_values<float>(301, 5)) xb.push_back(cupipe::bfloat16(v));
  CHECK(same_bits(through_message(hb, xb, Wire::e4m3), round_tripped(hb, xb, Wire::e4m3)));
  // A bf16 link over bf16 storage sends the values themselves: packing it is refused.
  std::vector<cupipe::bfloat16> out(xb.size());
  const cupipe::Shape s{cupipe::index_t(xb.size())};
  CHECK_THROWS_WITH(wire_pack(hb, cupipe::ConstView<cupipe::bfloat16>{xb.data(), s}, cupipe::TensorView<cupipe::bfloat16>{out.data(), s}, Wire::bf16),
                    Catch::Contains("sends the values themselves"));

  cupipe::backend::Host<float> hf;
  std::vector<float> x = spread_values<float>(40, 3);
  std::vector<float> wrong(5);
  CHECK_THROWS_WITH(wire_pack(hf, cupipe::ConstView<float>{x.data(), cupipe::Shape{40}}, cupipe::TensorView<float>{wrong.data(), cupipe::Shape{5}}, Wire::e4m3),
                    Catch::Contains("40 values as e4m3 take 12 elements of storage, but the packed message has 5"));
  x[7] = std::numeric_limits<float>::infinity();
  for (const float v : through_message(hf, x, Wire::e4m3)) CHECK(std::isnan(v));
  // bf16 keeps an infinity as itself.
  CHECK(std::isinf(through_message(hf, x, Wire::bf16)[7]));
}

TEST_CASE("parse_wire and parse_wires name the choices", "[core][float8]") {
  CHECK(cupipe::parse_wire("e4m3") == cupipe::Wire::e4m3);
  CHECK(cupipe::parse_wire("bf16") == cupipe::Wire::bf16);
  CHECK_THROWS_WITH(cupipe::parse_wire("fp8"), Catch::Contains("not one of full, bf16, e4m3"));
  CHECK(cupipe::parse_wires("full").empty());
  CHECK(cupipe::parse_wires("full,e4m3,bf16") == std::vector<cupipe::Wire>{cupipe::Wire::full, cupipe::Wire::e4m3, cupipe::Wire::bf16});
  CHECK_THROWS_WITH(cupipe::parse_wires("bf16,"), Catch::Contains("'' is not one of"));
}

}  // namespace
