// SPDX-License-Identifier: Apache-2.0
// The host ops' float loops compiled for AVX2 and AVX-512F (backend::host::vectorised) give the same bits
// as the baseline clone, op by op, on inputs with NaN, infinities, huge and tiny values, odd lengths
// and misaligned starts; and the choice of instruction set (CUPIPE_HOST_ISA, set_vector_isa) is
// checked. This file is its own program, built at -O3 (tests/host/CMakeLists.txt): at CI's -O1 GCC
// does not vectorise, and every clone would be the same scalar code.
#include <catch2/catch.hpp>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "cupipe/backend/host/ops.hpp"
#include "cupipe/backend/host/vector_math.hpp"

using namespace cupipe;
using backend::host::VectorIsa;

namespace {

/// The instruction sets this CPU runs, narrowest first.
std::vector<VectorIsa> runnable_isas() {
  std::vector<VectorIsa> out;
  for (VectorIsa isa : {VectorIsa::baseline, VectorIsa::avx2, VectorIsa::avx512})
    if (isa <= backend::host::widest_vector_isa()) out.push_back(isa);
  return out;
}

/// Sets the instruction set for a scope, then goes back to the widest.
struct IsaScope {
  explicit IsaScope(VectorIsa isa) { backend::host::set_vector_isa(isa); }
  ~IsaScope() { backend::host::set_vector_isa(backend::host::widest_vector_isa()); }
  IsaScope(const IsaScope&) = delete;
  IsaScope& operator=(const IsaScope&) = delete;
};

/// Normal values of scale `scale`, with every 97th element one of the special values (NaN, +-inf,
/// +-0, huge, subnormal, GELU's and exp's saturation points), so the clones' selects are exercised.
std::vector<float> values(std::size_t n, std::mt19937& rng, float scale = 2.0f) {
  std::normal_distribution<float> normal(0.0f, scale);
  const float special[] = {std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity(),
                           -std::numeric_limits<float>::infinity(), 0.0f, -0.0f, 3e38f, -3e38f, 1e-40f, -1e-40f,
                           10.0f, -10.0f, 88.8f, -87.4f, 0.625f, -0.625f};
  std::vector<float> v(n);
  for (std::size_t i = 0; i < n; ++i) v[i] = i % 97 == 5 ? special[(i / 97) % std::size(special)] : normal(rng);
  return v;
}

/// Finite values only (for ops whose reductions would turn one NaN into a whole row of them).
std::vector<float> finite_values(std::size_t n, std::mt19937& rng, float scale = 1.0f) {
  std::normal_distribution<float> normal(0.0f, scale);
  std::vector<float> v(n);
  for (float& x : v) x = normal(rng);
  return v;
}

using Outputs = std::vector<std::vector<float>>;

/// Runs `op` (filling and returning its outputs) under every runnable instruction set and requires
/// each clone's outputs to be bitwise the baseline's.
template <class Op>
void same_bits_on_every_isa(const char* what, Op&& op) {
  Outputs baseline;
  {
    IsaScope scope(VectorIsa::baseline);
    baseline = op();
  }
  for (VectorIsa isa : runnable_isas()) {
    if (isa == VectorIsa::baseline) continue;
    IsaScope scope(isa);
    const Outputs got = op();
    REQUIRE(got.size() == baseline.size());
    for (std::size_t k = 0; k < got.size(); ++k) {
      INFO(what << ", output " << k << ", " << backend::host::name(isa) << " against baseline");
      REQUIRE(got[k].size() == baseline[k].size());
      std::size_t differing = 0, first = got[k].size();
      for (std::size_t i = 0; i < got[k].size(); ++i)
        if (std::memcmp(&got[k][i], &baseline[k][i], sizeof(float)) != 0) {
          ++differing;
          if (first == got[k].size()) first = i;
        }
      INFO("differing elements: " << differing << ", the first at " << first);
      CHECK(differing == 0);
    }
  }
}

template <class T>
TensorView<T> view(std::vector<T>& v, Shape s, std::size_t offset = 0) {
  return {v.data() + offset, s};
}
template <class T>
ConstView<T> cview(const std::vector<T>& v, Shape s, std::size_t offset = 0) {
  return {v.data() + offset, s};
}

}  // namespace

TEST_CASE("every instruction-set clone of the float ops gives the baseline's bits", "[cpu][host][vector_isa]") {
  WARN("this CPU runs up to " << backend::host::name(backend::host::widest_vector_isa()) << "; clones compared: "
                              << runnable_isas().size() - 1);
  std::mt19937 rng(20261128);
  backend::Host<float> be;
  // Odd sizes and a start one float past an aligned one: every clone runs a peeled head and a tail.
  const index_t rows = 37, cols = 131, n = rows * cols;
  const std::size_t off = 1;
  const std::vector<float> x = values(std::size_t(n) + off, rng), dy = values(std::size_t(n) + off, rng),
                           b = values(std::size_t(cols) + off, rng);

  same_bits_on_every_isa("gelu_forward, gelu_backward", [&] {
    std::vector<float> y(x.size()), dx(x.size());
    ops::gelu_forward(be, cview(x, Shape{n}, off), view(y, Shape{n}, off));
    ops::gelu_backward(be, cview(x, Shape{n}, off), cview(dy, Shape{n}, off), view(dx, Shape{n}, off));
    return Outputs{y, dx};
  });
  same_bits_on_every_isa("relu_forward, relu_backward", [&] {
    std::vector<float> y(x.size()), dx(x.size());
    ops::relu_forward(be, cview(x, Shape{n}, off), view(y, Shape{n}, off));
    ops::relu_backward(be, cview(x, Shape{n}, off), cview(dy, Shape{n}, off), view(dx, Shape{n}, off));
    return Outputs{y, dx};
  });
  same_bits_on_every_isa("bias_add, bias_backward, residual_add, axpy", [&] {
    std::vector<float> y = x, db(b.size(), 0.5f), sum(x.size()), acc = dy;
    ops::bias_add(be, view(y, Shape{rows, cols}, off), cview(b, Shape{cols}, off));
    ops::bias_backward(be, cview(dy, Shape{rows, cols}, off), view(db, Shape{cols}, off));
    ops::residual_add(be, cview(x, Shape{n}, off), cview(dy, Shape{n}, off), view(sum, Shape{n}, off));
    ops::axpy(be, Scalar<float>(-0.37f), cview(x, Shape{n}, off), view(acc, Shape{n}, off));
    return Outputs{y, db, sum, acc};
  });

  const std::vector<float> xf = finite_values(std::size_t(n) + off, rng, 3.0f), gf = finite_values(std::size_t(n) + off, rng),
                           gamma = finite_values(std::size_t(cols), rng), beta = finite_values(std::size_t(cols), rng);
  same_bits_on_every_isa("layernorm forward and backward", [&] {
    const std::size_t r = std::size_t(rows), c = std::size_t(cols);
    std::vector<float> y(xf.size()), mean(r), rstd(r), dx(xf.size()), dgamma(c, 0.25f), dbeta(c, -0.25f);
    ops::layernorm_forward(be, cview(xf, Shape{rows, cols}, off), cview(gamma, Shape{cols}), cview(beta, Shape{cols}),
                           view(y, Shape{rows, cols}, off), view(mean, Shape{rows}), view(rstd, Shape{rows}), 1e-5);
    ops::layernorm_backward_input(be, cview(xf, Shape{rows, cols}, off), cview(gamma, Shape{cols}), cview(mean, Shape{rows}),
                                  cview(rstd, Shape{rows}), cview(gf, Shape{rows, cols}, off), view(dx, Shape{rows, cols}, off));
    ops::layernorm_backward_weight(be, cview(xf, Shape{rows, cols}, off), cview(mean, Shape{rows}), cview(rstd, Shape{rows}),
                                   cview(gf, Shape{rows, cols}, off), view(dgamma, Shape{cols}), view(dbeta, Shape{cols}));
    return Outputs{y, mean, rstd, dx, dgamma, dbeta};
  });

  // Two sequences of 75 tokens (query blocks of 64 and 11), 3 heads of 5: rows of every length.
  const index_t heads = 3, D = 5, C = heads * D, T = 75, r = 2 * T;
  const std::vector<float> qkv = finite_values(std::size_t(r * 3 * C), rng, 1.5f), dout = finite_values(std::size_t(r * C), rng);
  same_bits_on_every_isa("causal attention forward and backward", [&] {
    std::vector<float> out(dout.size()), lse(std::size_t(r * heads)), dqkv(qkv.size());
    ops::causal_attention_forward(be, cview(qkv, Shape{r, 3 * C}), view(out, Shape{r, C}), view(lse, Shape{r, heads}), heads, T);
    ops::causal_attention_backward(be, cview(qkv, Shape{r, 3 * C}), cview(out, Shape{r, C}), cview(lse, Shape{r, heads}),
                                   cview(dout, Shape{r, C}), view(dqkv, Shape{r, 3 * C}), heads, T);
    return Outputs{out, lse, dqkv};
  });

  same_bits_on_every_isa("sgd_update (Nesterov), adamw_update, three steps each", [&] {
    std::vector<float> p = xf, velocity(xf.size()), q = xf, m(xf.size()), v(xf.size());
    ops::SgdHyper sgd{.lr = 0.05, .momentum = 0.9, .weight_decay = 1e-3, .nesterov = true};
    ops::AdamWHyper adamw{.lr = 1e-2, .beta1 = 0.9, .beta2 = 0.999, .eps = 1e-8, .weight_decay = 0.1};
    for (std::int64_t step = 1; step <= 3; ++step) {
      ops::sgd_update(be, view(p, Shape{n}, off), cview(gf, Shape{n}, off), view(velocity, Shape{n}, off), sgd, Scalar<float>(0.5f));
      ops::adamw_update(be, view(q, Shape{n}, off), cview(gf, Shape{n}, off), view(m, Shape{n}, off), view(v, Shape{n}, off), adamw,
                        step, Scalar<float>(0.5f));
    }
    return Outputs{p, velocity, q, m, v};
  });
}

TEST_CASE("the instruction set: set_vector_isa, CUPIPE_HOST_ISA, and their errors", "[cpu][host][vector_isa]") {
  const VectorIsa widest = backend::host::widest_vector_isa();
  for (VectorIsa isa : runnable_isas()) {
    IsaScope scope(isa);
    CHECK(backend::host::vector_isa() == isa);
  }
  if (widest < VectorIsa::avx512)
    REQUIRE_THROWS_WITH(backend::host::set_vector_isa(VectorIsa::avx512), Catch::Contains("set_vector_isa=avx512: this CPU runs at most"));

  CHECK(backend::host::parse_vector_isa("avx2", "X") == VectorIsa::avx2);
  REQUIRE_THROWS_WITH(backend::host::parse_vector_isa("sse4", "CUPIPE_HOST_ISA"),
                      Catch::Contains("CUPIPE_HOST_ISA=sse4: expected baseline, avx2 or avx512"));

  // The environment is read at the first vector_isa() of a process; forget the choice to read it again.
  auto from_environment = [](const char* value) {
    ::setenv("CUPIPE_HOST_ISA", value, 1);
    backend::host::detail::chosen_vector_isa().store(-1);
    return backend::host::vector_isa();
  };
  CHECK(from_environment("baseline") == VectorIsa::baseline);
  CHECK(from_environment("") == widest);  // empty: not set
  // A bad value throws at every call (an op would fail with it), not once.
  REQUIRE_THROWS_WITH(from_environment("AVX2"), Catch::Contains("CUPIPE_HOST_ISA=AVX2: expected baseline, avx2 or avx512"));
  REQUIRE_THROWS_WITH(backend::host::vector_isa(), Catch::Contains("CUPIPE_HOST_ISA=AVX2"));
  std::vector<float> a(3, 1.0f), y(3);
  backend::Host<float> be;
  REQUIRE_THROWS_WITH(ops::gelu_forward(be, ConstView<float>{a.data(), Shape{3}}, TensorView<float>{y.data(), Shape{3}}),
                      Catch::Contains("CUPIPE_HOST_ISA=AVX2"));
  ::unsetenv("CUPIPE_HOST_ISA");
  backend::host::detail::chosen_vector_isa().store(-1);
  CHECK(backend::host::vector_isa() == widest);
}
