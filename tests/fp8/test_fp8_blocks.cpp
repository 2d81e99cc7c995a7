// SPDX-License-Identifier: Apache-2.0
// FP8 block scaling on the host (fp8/blocks.hpp), the oracle the CUDA path will be held to:
// quantisation error within the format's half step of each block's grid; an outlier costs precision
// in its own tile only (and everywhere under one scale per tensor); ragged edges; zeros; non-finite
// values refused; the block GEMM against float64 sums, of the codes it multiplies (fp32's bound)
// and of the values they came from (the format's bound); and per-tensor delayed scaling's history.
#include <catch2/catch.hpp>

#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "cupipe/core/rng.hpp"
#include "cupipe/fp8/blocks.hpp"
#include "cupipe/fp8/delayed_scaling.hpp"

namespace {

using namespace cupipe;

/// rows x cols values, each tile of 128 along a row scaled by its own power of two (2^-6 .. 2^5).
std::vector<float> tiled_values(index_t rows, index_t cols, std::uint64_t seed) {
  Rng rng(seed);
  std::vector<float> x(std::size_t(rows * cols));
  for (index_t r = 0; r < rows; ++r)
    for (index_t c = 0; c < cols; ++c)
      x[std::size_t(r * cols + c)] = float(rng.uniform(-1.0, 1.0) * std::ldexp(1.0, int((r + c / 128) % 12) - 6));
  return x;
}

/// The most a value can move in E4M3 with its block's scale s: half a step of its binade (2^-4 of
/// it), and in the subnormal range half the subnormal step (2^-10 s).
double e4m3_bound(double x, double s) { return std::max(std::ldexp(std::abs(x), -4), std::ldexp(s, -10)) * (1 + 1e-6); }

std::vector<float> dequantized(const fp8::Quantized<float8_e4m3>& q) {
  std::vector<float> y(std::size_t(q.rows * q.cols));
  fp8::dequantize(q, TensorView<float>{y.data(), Shape{q.rows, q.cols}});
  return y;
}

}  // namespace

TEST_CASE("fp8: 1 x 128 tiles keep every value within half a step of its tile's grid", "[fp8]") {
  const index_t rows = 5, cols = 300;  // 3 tiles a row, the last 44 wide
  const std::vector<float> x = tiled_values(rows, cols, 1);
  const auto q = fp8::quantize<fp8::ActivationTiles>(ConstView<float>{x.data(), Shape{rows, cols}});
  REQUIRE(q.scale_rows() == 5);
  REQUIRE(q.scale_cols() == 3);
  const std::vector<float> y = dequantized(q);
  for (index_t r = 0; r < rows; ++r)
    for (index_t t = 0; t < 3; ++t) {
      float amax = 0;
      for (index_t c = t * 128; c < std::min(cols, (t + 1) * 128); ++c) amax = std::max(amax, std::abs(x[std::size_t(r * cols + c)]));
      const float s = q.scales[std::size_t(r * 3 + t)];
      CHECK(s == amax / 448.0f);
      for (index_t c = t * 128; c < std::min(cols, (t + 1) * 128); ++c) {
        const std::size_t i = std::size_t(r * cols + c);
        INFO("element (" << r << ", " << c << "): " << x[i] << " -> " << y[i]);
        CHECK(std::abs(double(y[i]) - double(x[i])) <= e4m3_bound(x[i], s));
        // The tile's largest magnitude is E4M3's largest code: it comes back within fp32's rounding.
        if (std::abs(x[i]) == amax) CHECK(std::abs(double(y[i]) - double(x[i])) <= std::ldexp(double(amax), -22));
      }
    }
}

TEST_CASE("fp8: an outlier costs precision in its own tile only, one scale per tensor loses everywhere", "[fp8]") {
  const index_t rows = 2, cols = 512;
  std::vector<float> x = tiled_values(rows, cols, 2);
  const auto before = fp8::quantize<fp8::ActivationTiles>(ConstView<float>{x.data(), Shape{rows, cols}});
  x[130] = 1e4f;  // row 0, tile 1
  const auto after = fp8::quantize<fp8::ActivationTiles>(ConstView<float>{x.data(), Shape{rows, cols}});
  for (index_t r = 0; r < rows; ++r)
    for (index_t c = 0; c < cols; ++c) {
      const bool own_tile = r == 0 && c / 128 == 1;
      if (own_tile) continue;
      CHECK(after.codes[std::size_t(r * cols + c)].bits == before.codes[std::size_t(r * cols + c)].bits);
      CHECK(after.scale(r, c) == before.scale(r, c));
    }
  // One scale for the whole tensor: the outlier sets it, and the small values of row 0's tile 0
  // (scaled by 2^-6, at most 1/64) fall into E4M3's subnormals or to zero.
  const auto whole = fp8::quantize<fp8::BlockScaled<2, 512>>(ConstView<float>{x.data(), Shape{rows, cols}});
  REQUIRE(whole.scales.size() == 1);
  const std::vector<float> tiled = dequantized(after), flat = dequantized(whole);
  double tiled_error = 0, flat_error = 0;
  for (index_t c = 0; c < 128; ++c) {
    tiled_error += std::abs(double(tiled[std::size_t(c)]) - x[std::size_t(c)]);
    flat_error += std::abs(double(flat[std::size_t(c)]) - x[std::size_t(c)]);
  }
  CHECK(flat_error > 20 * tiled_error);
}

TEST_CASE("fp8: 128 x 128 weight blocks with ragged edges, zeros, and what cannot be quantised", "[fp8]") {
  const index_t rows = 130, cols = 200;
  std::vector<float> w = tiled_values(rows, cols, 3);
  for (index_t r = 128; r < rows; ++r)
    for (index_t c = 128; c < cols; ++c) w[std::size_t(r * cols + c)] = (c % 2) ? -0.0f : 0.0f;  // a block of zeros
  const auto q = fp8::quantize<fp8::WeightBlocks>(ConstView<float>{w.data(), Shape{rows, cols}});
  REQUIRE(q.scale_rows() == 2);
  REQUIRE(q.scale_cols() == 2);
  CHECK(q.scales[3] == 1.0f);
  const std::vector<float> y = dequantized(q);
  for (index_t r = 0; r < rows; ++r)
    for (index_t c = 0; c < cols; ++c) {
      const std::size_t i = std::size_t(r * cols + c);
      CHECK(std::abs(double(y[i]) - double(w[i])) <= e4m3_bound(w[i], q.scale(r, c)));
      if (r >= 128 && c >= 128) CHECK(std::signbit(y[i]) == std::signbit(w[i]));
    }
  // E5M2 for gradients: a larger range, a coarser grid (2^-3 of a value at most).
  const auto g = fp8::quantize<fp8::WeightBlocks, float8_e5m2>(ConstView<float>{w.data(), Shape{rows, cols}});
  float block_amax = 0;
  for (index_t r = 0; r < 128; ++r)
    for (index_t c = 0; c < 128; ++c) block_amax = std::max(block_amax, std::abs(w[std::size_t(r * cols + c)]));
  CHECK(g.scales[0] == block_amax / 57344.0f);
  for (index_t c = 0; c < 128; ++c)
    CHECK(std::abs(double(g.value(0, c)) - w[std::size_t(c)]) <=
          std::max(std::ldexp(std::abs(double(w[std::size_t(c)])), -3), std::ldexp(double(g.scale(0, c)), -17)) * (1 + 1e-6));
  w[std::size_t(7 * cols + 9)] = std::numeric_limits<float>::quiet_NaN();
  CHECK_THROWS_WITH(fp8::quantize<fp8::WeightBlocks>(ConstView<float>{w.data(), Shape{rows, cols}}),
                    Catch::Contains("element (7, 9) of x is nan, which FP8 cannot hold"));
}

TEST_CASE("fp8: the block GEMM sums each 128 of k in fp32 and scales it, within fp32's and the format's bounds",
          "[fp8]") {
  const index_t m = 6, n = 5, k = 300;  // 3 blocks along k, the last 44 wide
  const std::vector<float> x = tiled_values(m, k, 4), w = tiled_values(n, k, 5);
  const auto qx = fp8::quantize<fp8::ActivationTiles>(ConstView<float>{x.data(), Shape{m, k}});
  const auto qw = fp8::quantize<fp8::WeightBlocks>(ConstView<float>{w.data(), Shape{n, k}});
  std::vector<float> y(std::size_t(m * n));
  fp8::gemm_nt(qx, qw, TensorView<float>{y.data(), Shape{m, n}});
  for (index_t i = 0; i < m; ++i)
    for (index_t j = 0; j < n; ++j) {
      // Of the codes' values in float64: fp32's rounding of at most k + 2 sums and products.
      double exact = 0, magnitude = 0, original = 0, original_magnitude = 0;
      for (index_t kk = 0; kk < k; ++kk) {
        const double a = qx.value(i, kk), b = qw.value(j, kk);
        exact += a * b;
        magnitude += std::abs(a * b);
        original += double(x[std::size_t(i * k + kk)]) * w[std::size_t(j * k + kk)];
        original_magnitude += std::abs(double(x[std::size_t(i * k + kk)]) * w[std::size_t(j * k + kk)]);
      }
      const double got = y[std::size_t(i * n + j)];
      INFO("y(" << i << ", " << j << ") = " << got << ", of the codes " << exact << ", of the values " << original);
      CHECK(std::abs(got - exact) <= double(k + 2) * std::ldexp(magnitude, -24));
      // Of the values before quantisation: each factor within 2^-4 of itself (or a subnormal step).
      CHECK(std::abs(got - original) <= std::ldexp(original_magnitude, -3) + 1e-6);
    }
  // The scales must change at the same k.
  const auto other = fp8::quantize<fp8::BlockScaled<1, 64>>(ConstView<float>{x.data(), Shape{m, k}});
  CHECK_THROWS_WITH(fp8::gemm_nt(other, qw, TensorView<float>{y.data(), Shape{m, n}}),
                    Catch::Contains("x's blocks are 64 wide along k and w's 128"));
}

TEST_CASE("fp8: delayed scaling quantises with the history's amax and saturates what outgrew it", "[fp8]") {
  fp8::DelayedScaling<> recipe(3);
  CHECK(recipe.scale() == 1.0f);  // nothing recorded yet
  std::vector<float> x{0.5f, -2.0f, 1.0f, 0.25f};
  const ConstView<float> xv{x.data(), Shape{2, 2}};
  float amax = 0;
  auto q = recipe.quantize(xv, &amax);
  CHECK(amax == 2.0f);
  CHECK(recipe.scale() == 1.0f);  // quantize does not record: the group's reduction comes first
  CHECK(q.value(0, 1) == -2.0f);  // at scale 1 these values are E4M3 codes themselves
  recipe.record(amax);
  CHECK(recipe.scale() == 2.0f / 448.0f);
  // The next tensor grew past the recorded amax: its largest value saturates to the largest code.
  x[1] = -8.0f;
  q = recipe.quantize(xv, &amax);
  CHECK(amax == 8.0f);
  CHECK(q.value(0, 1) == Approx(-2.0f).epsilon(1e-6));
  CHECK(q.codes[1].bits == 0xFE);
  // The scale follows the largest of the last 3 amaxes, then forgets it.
  recipe.record(8.0f);
  recipe.record(1.0f);
  recipe.record(1.0f);
  CHECK(recipe.scale() == 8.0f / 448.0f);
  recipe.record(1.0f);
  CHECK(recipe.scale() == 1.0f / 448.0f);
  // A margin of 2: four times the scale, headroom for growth.
  fp8::DelayedScaling<> headroom(3, 2);
  headroom.record(1.0f);
  CHECK(headroom.scale() == 4.0f / 448.0f);
  CHECK_THROWS_WITH(fp8::DelayedScaling<>(0), Catch::Contains("at least 1 step"));
  CHECK_THROWS_WITH(recipe.record(-1.0f), Catch::Contains("finite and >= 0"));
}
