// SPDX-License-Identifier: Apache-2.0
// A mixture of experts' token movement on the host (backend/host/ops_moe.hpp), the CUDA kernels'
// reference: a worked example by hand, the adjoint identities that tie each backward to its forward
// in float64, and the errors for a bad slot and a bad shape.
#include <catch2/catch.hpp>

#include <cstdint>
#include <vector>

#include "cupipe/backend/host/host.hpp"
#include "cupipe/backend/host/ops.hpp"
#include "moe_slots.hpp"

using namespace cupipe;

namespace {

double dot(const std::vector<double>& a, const std::vector<double>& b) {
  double s = 0;
  for (std::size_t i = 0; i < a.size(); ++i) s += a[i] * b[i];
  return s;
}

std::vector<double> random_values(Rng& rng, index_t n) {
  std::vector<double> v(static_cast<std::size_t>(n));
  for (double& x : v) x = rng.uniform(-1, 1);
  return v;
}

}  // namespace

TEST_CASE("moe_permute and moe_unpermute move rows to their slots and back, by hand", "[cpu][host][moe]") {
  backend::Host<double> be;
  // 3 tokens of 2 columns, 2 choices each: token 0's second and token 2's first are dropped.
  const std::vector<double> x{1, 2, 3, 4, 5, 6};
  const std::vector<std::int32_t> slots{0, -1, 2, 1, -1, 3};
  const std::vector<double> gates{0.5, 0.25, 0.75, 0.125, 1, 2};
  const ConstView<std::int32_t> s{slots.data(), Shape{3, 2}};
  std::vector<double> xs(8, -9);
  ops::moe_permute(be, ConstView<double>{x.data(), Shape{3, 2}}, s, TensorView<double>{xs.data(), Shape{4, 2}});
  CHECK(xs == std::vector<double>{1, 2, 3, 4, 3, 4, 5, 6});

  const std::vector<double> o{10, 20, 30, 40, 50, 60, 70, 80};  // the experts' outputs, by slot
  std::vector<double> y(6, -9);
  ops::moe_unpermute(be, ConstView<double>{o.data(), Shape{4, 2}}, s, ConstView<double>{gates.data(), Shape{3, 2}},
                     TensorView<double>{y.data(), Shape{3, 2}});
  // y_0 = 0.5 o_0; y_1 = 0.75 o_2 + 0.125 o_1; y_2 = 2 o_3.
  CHECK(y == std::vector<double>{5, 10, 37.5 + 3.75, 45 + 5, 140, 160});

  const std::vector<double> dy{1, -1, 2, 0, 0, 3};
  std::vector<double> d_o(8, -9), dgates(6, -9);
  ops::moe_unpermute_backward(be, ConstView<double>{dy.data(), Shape{3, 2}}, ConstView<double>{o.data(), Shape{4, 2}}, s,
                              ConstView<double>{gates.data(), Shape{3, 2}}, TensorView<double>{d_o.data(), Shape{4, 2}},
                              TensorView<double>{dgates.data(), Shape{3, 2}});
  CHECK(d_o == std::vector<double>{0.5, -0.5, 0.25, 0, 1.5, 0, 0, 6});
  CHECK(dgates == std::vector<double>{-10, 0, 100, 60, 0, 240});

  std::vector<double> dx{1, 1, 1, 1, 1, 1};
  ops::moe_permute_backward(be, ConstView<double>{o.data(), Shape{4, 2}}, s, TensorView<double>{dx.data(), Shape{3, 2}});
  CHECK(dx == std::vector<double>{11, 21, 81, 101, 71, 81});
}

TEST_CASE("each moe backward is its forward's adjoint, in float64", "[cpu][host][moe]") {
  const index_t k = GENERATE(1, 2, 3);
  const index_t n = 40, c = 7;
  Rng rng(std::uint64_t(11 + k));
  index_t kept = 0;
  const std::vector<std::int32_t> slots = testing::random_moe_slots(rng, n, k, kept);
  REQUIRE(kept > 0);
  backend::Host<double> be;
  const ConstView<std::int32_t> s{slots.data(), Shape{n, k}};
  const Shape tokens{n, c}, rows{kept, c}, choices{n, k};
  // <permute(x), dxs> = <x, permute_backward(dxs)>.
  const auto x = random_values(rng, n * c), dxs = random_values(rng, kept * c);
  std::vector<double> xs(std::size_t(kept * c)), dx(std::size_t(n * c), 0.0);
  ops::moe_permute(be, ConstView<double>{x.data(), tokens}, s, TensorView<double>{xs.data(), rows});
  ops::moe_permute_backward(be, ConstView<double>{dxs.data(), rows}, s, TensorView<double>{dx.data(), tokens});
  CHECK(dot(xs, dxs) == Approx(dot(x, dx)).epsilon(1e-12));
  // y = unpermute(o, gates) is linear in o and in gates: <y, dy> = <o, d_o> = <gates, dgates>.
  const auto o = random_values(rng, kept * c), gates = random_values(rng, n * k), dy = random_values(rng, n * c);
  std::vector<double> y(std::size_t(n * c)), d_o(std::size_t(kept * c)), dgates(std::size_t(n * k));
  ops::moe_unpermute(be, ConstView<double>{o.data(), rows}, s, ConstView<double>{gates.data(), choices},
                     TensorView<double>{y.data(), tokens});
  ops::moe_unpermute_backward(be, ConstView<double>{dy.data(), tokens}, ConstView<double>{o.data(), rows}, s,
                              ConstView<double>{gates.data(), choices}, TensorView<double>{d_o.data(), rows},
                              TensorView<double>{dgates.data(), choices});
  CHECK(dot(y, dy) == Approx(dot(o, d_o)).epsilon(1e-12));
  CHECK(dot(y, dy) == Approx(dot(gates, dgates)).epsilon(1e-12));
  for (std::size_t i = 0; i < slots.size(); ++i)
    if (slots[i] < 0) CHECK(dgates[i] == 0.0);
}

TEST_CASE("the moe ops name a slot outside the rows and a view of the wrong shape", "[cpu][host][moe][errors]") {
  backend::Host<float> be;
  const std::vector<float> x(6, 1.0f), gates(6, 1.0f);
  std::vector<float> xs(8), y(6);
  const std::vector<std::int32_t> slots{0, -1, 2, 4, -1, 3};  // 4 is past the 4 rows
  const ConstView<std::int32_t> s{slots.data(), Shape{3, 2}};
  CHECK_THROWS_WITH(ops::moe_permute(be, ConstView<float>{x.data(), Shape{3, 2}}, s, TensorView<float>{xs.data(), Shape{4, 2}}),
                    Catch::StartsWith("moe_permute: slot 4 at choice 3 is outside the 4 expert-sorted rows (and not -1, dropped)"));
  CHECK_THROWS_WITH(ops::moe_unpermute(be, ConstView<float>{xs.data(), Shape{4, 2}}, s, ConstView<float>{gates.data(), Shape{2, 3}},
                                       TensorView<float>{y.data(), Shape{3, 2}}),
                    Catch::Contains("moe_unpermute: gates expected shape"));
}
