// SPDX-License-Identifier: Apache-2.0
// backend::host::exp and backend::host::tanh (backend/host/vector_math.hpp) against long double over a sweep
// of every float's bit pattern, their edge values, and the GELU that uses them against double.
#include <catch2/catch.hpp>

#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "cupipe/backend/host/ops.hpp"
#include "cupipe/backend/host/vector_math.hpp"

using namespace cupipe;

namespace {

/// |got - exact| in units of the last place of `exact` rounded to float.
double ulps(float got, long double exact) {
  const float rounded = static_cast<float>(exact);
  const float magnitude = std::fabs(rounded);
  const float ulp = magnitude == 0 ? std::numeric_limits<float>::denorm_min()
                                   : std::nextafter(magnitude, std::numeric_limits<float>::infinity()) - magnitude;
  return static_cast<double>(std::fabs(static_cast<long double>(got) - exact) / ulp);
}

/// Every `stride`-th bit pattern that is a finite float.
template <class F>
void for_floats(std::uint32_t stride, F&& f) {
  for (std::uint64_t bits = 0; bits <= 0xFFFFFFFFull; bits += stride) {
    const float x = std::bit_cast<float>(static_cast<std::uint32_t>(bits));
    if (std::isfinite(x)) f(x);
  }
}

}  // namespace

TEST_CASE("backend::host::exp is within 2 ulp of e^x wherever e^x is a normal float", "[cpu][host][vector_math]") {
  double worst = 0;
  float at = 0;
  for_floats(1021, [&](float x) {
    if (x < -87.33654f || x > 88.72283f) return;
    const double u = ulps(backend::host::exp(x), std::exp(static_cast<long double>(x)));
    if (u > worst) worst = u, at = x;
  });
  CAPTURE(at);
  CHECK(worst <= 2.0);
  // Round numbers and the ends of the range.
  CHECK(backend::host::exp(0.0f) == 1.0f);
  CHECK(ulps(backend::host::exp(1.0f), std::exp(1.0L)) <= 1.0);
  CHECK(ulps(backend::host::exp(88.72f), std::exp(static_cast<long double>(88.72f))) <= 2.0);
  CHECK(std::isnormal(backend::host::exp(-87.33f)));
}

TEST_CASE("backend::host::exp gives 0 below the normal range, infinity above it and NaN for NaN", "[cpu][host][vector_math]") {
  const float inf = std::numeric_limits<float>::infinity();
  CHECK(backend::host::exp(-inf) == 0.0f);
  CHECK(backend::host::exp(-90.0f) == 0.0f);
  CHECK(backend::host::exp(-1e30f) == 0.0f);
  CHECK(backend::host::exp(89.0f) == inf);
  CHECK(backend::host::exp(inf) == inf);
  CHECK(std::isnan(backend::host::exp(std::numeric_limits<float>::quiet_NaN())));
}

TEST_CASE("backend::host::tanh is within 2 ulp of tanh for every float and keeps its edges", "[cpu][host][vector_math]") {
  double worst = 0;
  float at = 0;
  for_floats(1021, [&](float x) {
    const double u = ulps(backend::host::tanh(x), std::tanh(static_cast<long double>(x)));
    if (u > worst) worst = u, at = x;
  });
  CAPTURE(at);
  CHECK(worst <= 2.0);
  // Either side of the switch from the polynomial to the exponential form.
  for (const float x : {0.6249f, 0.625f, 0.6251f, -0.625f, 1e-30f, 9.0f, 10.0f, 50.0f})
    CHECK(ulps(backend::host::tanh(x), std::tanh(static_cast<long double>(x))) <= 2.0);
  const float inf = std::numeric_limits<float>::infinity();
  CHECK(backend::host::tanh(inf) == 1.0f);
  CHECK(backend::host::tanh(-inf) == -1.0f);
  CHECK(backend::host::tanh(0.0f) == 0.0f);
  CHECK(std::signbit(backend::host::tanh(-0.0f)));
  CHECK(std::isnan(backend::host::tanh(std::numeric_limits<float>::quiet_NaN())));
}

TEST_CASE("float GELU with backend::host::tanh is within a few float ulps of the double GELU", "[cpu][host][vector_math]") {
  // Inputs from -8 to 8 (and a few far out), each to 4 float ulps of its scale: |x| for the forward,
  // whose 1 + t cancels where tanh nears -1, and max(1, |x|) for the backward, whose 1 - t^2 does.
  std::vector<float> x;
  for (int i = -4000; i <= 4000; ++i) x.push_back(float(i) / 500.0f);
  for (const float far : {-1e4f, -30.0f, 30.0f, 1e4f}) x.push_back(far);
  const index_t n = index_t(x.size());
  std::vector<float> y(x.size()), dx(x.size()), ones(x.size(), 1.0f);
  std::vector<double> xd(x.begin(), x.end()), yd(x.size()), dxd(x.size()), onesd(x.size(), 1.0);
  backend::Host<float> bf;
  backend::Host<double> bd;
  ops::gelu_forward(bf, ConstView<float>(x.data(), Shape{n}), TensorView<float>(y.data(), Shape{n}));
  ops::gelu_backward(bf, ConstView<float>(x.data(), Shape{n}), ConstView<float>(ones.data(), Shape{n}),
                     TensorView<float>(dx.data(), Shape{n}));
  ops::gelu_forward(bd, ConstView<double>(xd.data(), Shape{n}), TensorView<double>(yd.data(), Shape{n}));
  ops::gelu_backward(bd, ConstView<double>(xd.data(), Shape{n}), ConstView<double>(onesd.data(), Shape{n}),
                     TensorView<double>(dxd.data(), Shape{n}));
  const double eps = std::numeric_limits<float>::epsilon();
  for (std::size_t i = 0; i < x.size(); ++i) {
    CAPTURE(x[i], y[i], yd[i], dx[i], dxd[i]);
    CHECK(std::fabs(y[i] - yd[i]) <= 4 * eps * (std::fabs(yd[i]) + std::fabs(xd[i])));
    CHECK(std::fabs(dx[i] - dxd[i]) <= 4 * eps * std::max(1.0, std::fabs(xd[i])));
  }
}
