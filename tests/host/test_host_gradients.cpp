// SPDX-License-Identifier: Apache-2.0
// Every host op's backward against central finite differences in float64, and every forward against
// a naive double reference. Each scalar checked is sum(r * output) with a random r, so the backward
// sees a generic upstream gradient.
#include <catch2/catch.hpp>

#include <cmath>
#include <cstdint>
#include <numbers>
#include <vector>

#include "cupipe/backend/host/ops.hpp"
#include "gradcheck.hpp"

using namespace cupipe;
using cupipe::ops::Transpose;
using cupipe::testing::dot;
using cupipe::testing::numeric_gradient;
using cupipe::testing::relative_error;
using cupipe::testing::uniform_ints;
using cupipe::testing::uniform_values;

namespace {

constexpr double grad_tolerance = 1e-6;

using Vec = std::vector<double>;
using Ids = std::vector<std::int32_t>;

TensorView<double> view(Vec& v, Shape s) { return {v.data(), s}; }
ConstView<double> cview(const Vec& v, Shape s) { return {v.data(), s}; }
ConstView<std::int32_t> ids_view(const Ids& v) { return {v.data(), Shape{index_t(v.size())}}; }

index_t between(Rng& rng, index_t low, index_t high) { return low + index_t(rng.below(std::uint64_t(high - low + 1))); }

Transpose flip(Transpose t) { return t == Transpose::yes ? Transpose::no : Transpose::yes; }

}  // namespace

TEST_CASE("gemm: forward matches a triple loop and its gradients match finite differences", "[cpu][host][gemm]") {
  const auto seed = GENERATE(take(4, random(1, 1000000)));
  const Transpose ta = GENERATE(Transpose::no, Transpose::yes);
  const Transpose tb = GENERATE(Transpose::no, Transpose::yes);
  Rng rng{std::uint64_t(seed)};
  const index_t m = between(rng, 1, 7), k = between(rng, 1, 7), n = between(rng, 1, 7);
  const double alpha = rng.uniform(-2, 2), beta = rng.uniform(-1.5, 1.5);
  CAPTURE(seed, int(ta), int(tb), m, k, n, alpha, beta);

  const Shape a_shape = ta == Transpose::no ? Shape{m, k} : Shape{k, m};
  const Shape b_shape = tb == Transpose::no ? Shape{k, n} : Shape{n, k};
  Vec a = uniform_values(std::size_t(m * k), rng), b = uniform_values(std::size_t(k * n), rng);
  Vec c0 = uniform_values(std::size_t(m * n), rng), r = uniform_values(std::size_t(m * n), rng);
  backend::Host<double> be;

  auto run = [&] {
    Vec c = c0;
    ops::gemm(be, ta, tb, alpha, cview(a, a_shape), cview(b, b_shape), beta, view(c, Shape{m, n}));
    return c;
  };

  // Forward: c[i][j] = alpha * sum_p op(a)[i][p] op(b)[p][j] + beta * c0[i][j].
  const auto op_a = [&](index_t i, index_t p) { return ta == Transpose::no ? a[i * k + p] : a[p * m + i]; };
  const auto op_b = [&](index_t p, index_t j) { return tb == Transpose::no ? b[p * n + j] : b[j * k + p]; };
  Vec expected(static_cast<std::size_t>(m * n));
  for (index_t i = 0; i < m; ++i)
    for (index_t j = 0; j < n; ++j) {
      double s = 0;
      for (index_t p = 0; p < k; ++p) s += op_a(i, p) * op_b(p, j);
      expected[i * n + j] = alpha * s + beta * c0[i * n + j];
    }
  CHECK(relative_error(run(), expected) <= 1e-14);

  // Backward, written with gemm as layers write it: d op(a) = alpha r op(b)^T, d op(b) = alpha op(a)^T r.
  Vec da(a.size()), db(b.size());
  if (ta == Transpose::no)
    ops::gemm(be, Transpose::no, flip(tb), alpha, cview(r, Shape{m, n}), cview(b, b_shape), 0.0, view(da, a_shape));
  else
    ops::gemm(be, tb, Transpose::yes, alpha, cview(b, b_shape), cview(r, Shape{m, n}), 0.0, view(da, a_shape));
  if (tb == Transpose::no)
    ops::gemm(be, flip(ta), Transpose::no, alpha, cview(a, a_shape), cview(r, Shape{m, n}), 0.0, view(db, b_shape));
  else
    ops::gemm(be, Transpose::yes, ta, alpha, cview(r, Shape{m, n}), cview(a, a_shape), 0.0, view(db, b_shape));
  Vec dc0 = r;
  for (double& x : dc0) x *= beta;

  const auto loss = [&] { return dot(r, run()); };
  CHECK(relative_error(da, numeric_gradient(a, loss)) <= grad_tolerance);
  CHECK(relative_error(db, numeric_gradient(b, loss)) <= grad_tolerance);
  CHECK(relative_error(dc0, numeric_gradient(c0, loss)) <= grad_tolerance);
}

TEST_CASE("bias_add and bias_backward: exact forward, accumulating gradient", "[cpu][host]") {
  const auto seed = GENERATE(take(4, random(1, 1000000)));
  Rng rng{std::uint64_t(seed)};
  const index_t rows = between(rng, 1, 9), n = between(rng, 1, 9);
  Vec y0 = uniform_values(std::size_t(rows * n), rng), bias = uniform_values(std::size_t(n), rng);
  const Vec r = uniform_values(std::size_t(rows * n), rng);
  backend::Host<double> be;
  auto run = [&] {
    Vec y = y0;
    ops::bias_add(be, view(y, Shape{rows, n}), cview(bias, Shape{n}));
    return y;
  };
  const Vec y = run();
  for (index_t i = 0; i < rows; ++i)
    for (index_t j = 0; j < n; ++j) REQUIRE(y[i * n + j] == y0[i * n + j] + bias[j]);

  // bias_backward accumulates: start from a non-zero gradient and subtract it afterwards.
  const Vec start = uniform_values(std::size_t(n), rng);
  Vec dbias = start;
  ops::bias_backward(be, cview(r, Shape{rows, n}), view(dbias, Shape{n}));
  for (index_t j = 0; j < n; ++j) dbias[j] -= start[j];
  const auto loss = [&] { return dot(r, run()); };
  CHECK(relative_error(dbias, numeric_gradient(bias, loss)) <= grad_tolerance);
  CHECK(relative_error(r, numeric_gradient(y0, loss)) <= grad_tolerance);
}

TEST_CASE("relu: forward is max(x, 0) and backward matches finite differences away from the kink", "[cpu][host]") {
  const auto seed = GENERATE(take(4, random(1, 1000000)));
  Rng rng{std::uint64_t(seed)};
  const index_t rows = between(rng, 1, 8), n = between(rng, 1, 8);
  const Shape s{rows, n};
  Vec x = cupipe::testing::values_away_from_zero(std::size_t(rows * n), rng);
  const Vec r = uniform_values(x.size(), rng);
  backend::Host<double> be;
  auto run = [&] {
    Vec y(x.size());
    ops::relu_forward(be, cview(x, s), view(y, s));
    return y;
  };
  const Vec y = run();
  for (std::size_t i = 0; i < x.size(); ++i) REQUIRE(y[i] == std::max(x[i], 0.0));
  Vec dx(x.size());
  ops::relu_backward(be, cview(x, s), cview(r, s), view(dx, s));
  CHECK(relative_error(dx, numeric_gradient(x, [&] { return dot(r, run()); })) <= grad_tolerance);

  // NaN propagates (as torch.relu), so a diverged model reaches the loss's finiteness check.
  const Vec special{std::nan(""), INFINITY, -INFINITY, -0.0};
  Vec out(4, 7.0);
  ops::relu_forward(be, cview(special, Shape{4}), view(out, Shape{4}));
  CHECK(std::isnan(out[0]));
  CHECK(out[1] == INFINITY);
  CHECK(out[2] == 0.0);
  CHECK(out[3] == 0.0);
  CHECK_FALSE(std::signbit(out[3]));  // -0 maps to +0, as before the loop was vectorised
}

TEST_CASE("gelu: tanh-form forward and backward matches finite differences", "[cpu][host]") {
  const auto seed = GENERATE(take(4, random(1, 1000000)));
  Rng rng{std::uint64_t(seed)};
  const index_t rows = between(rng, 1, 8), n = between(rng, 1, 8);
  const Shape s{rows, n};
  Vec x = uniform_values(std::size_t(rows * n), rng, -4, 4);
  const Vec r = uniform_values(x.size(), rng);
  backend::Host<double> be;
  auto run = [&] {
    Vec y(x.size());
    ops::gelu_forward(be, cview(x, s), view(y, s));
    return y;
  };
  const Vec y = run();
  for (std::size_t i = 0; i < x.size(); ++i) {
    const double v = x[i];
    const double tanh_form = 0.5 * v * (1 + std::tanh(std::sqrt(2 / std::numbers::pi) * (v + 0.044715 * v * v * v)));
    const double erf_form = 0.5 * v * (1 + std::erf(v / std::sqrt(2.0)));  // what the tanh form approximates
    REQUIRE(y[i] == Approx(tanh_form).epsilon(1e-14).margin(1e-15));
    REQUIRE(std::abs(y[i] - erf_form) < 1e-3);
  }
  Vec dx(x.size());
  ops::gelu_backward(be, cview(x, s), cview(r, s), view(dx, s));
  CHECK(relative_error(dx, numeric_gradient(x, [&] { return dot(r, run()); })) <= grad_tolerance);
}

TEST_CASE("layernorm: forward matches the formula, and input and weight gradients match finite differences",
          "[cpu][host][layernorm]") {
  const auto seed = GENERATE(take(5, random(1, 1000000)));
  Rng rng{std::uint64_t(seed)};
  // At least 3 columns: with 2 the output is +-gamma + beta whatever the input (up to eps), so dx is
  // O(eps / var^1.5) and a relative comparison with finite differences measures only their noise
  // (the case below checks that it is that small).
  const index_t rows = between(rng, 1, 6), n = between(rng, 3, 9);
  const double offset = rng.uniform(-3, 3);  // rows whose mean is far from zero
  const double eps = 1e-5;
  const Shape s{rows, n};
  Vec x = uniform_values(std::size_t(rows * n), rng, offset - 1, offset + 1);
  Vec gamma = uniform_values(std::size_t(n), rng, -1.5, 1.5), beta = uniform_values(std::size_t(n), rng);
  const Vec r = uniform_values(x.size(), rng);
  backend::Host<double> be;
  Vec mean(static_cast<std::size_t>(rows)), rstd(static_cast<std::size_t>(rows));
  auto run = [&] {
    Vec y(x.size());
    ops::layernorm_forward(be, cview(x, s), cview(gamma, Shape{n}), cview(beta, Shape{n}), view(y, s),
                           view(mean, Shape{rows}), view(rstd, Shape{rows}), eps);
    return y;
  };

  // Forward: y = (x - mean) / sqrt(biased var + eps) * gamma + beta, row by row.
  const Vec y = run();
  Vec expected(x.size());
  for (index_t i = 0; i < rows; ++i) {
    double mu = 0, var = 0;
    for (index_t j = 0; j < n; ++j) mu += x[i * n + j] / double(n);
    for (index_t j = 0; j < n; ++j) var += (x[i * n + j] - mu) * (x[i * n + j] - mu) / double(n);
    CHECK(mean[i] == Approx(mu).epsilon(1e-13));
    CHECK(rstd[i] == Approx(1 / std::sqrt(var + eps)).epsilon(1e-12));
    for (index_t j = 0; j < n; ++j) expected[i * n + j] = (x[i * n + j] - mu) / std::sqrt(var + eps) * gamma[j] + beta[j];
  }
  CHECK(relative_error(y, expected) <= 1e-13);

  run();  // mean and rstd of the unperturbed x
  Vec dx(x.size());
  ops::layernorm_backward_input(be, cview(x, s), cview(gamma, Shape{n}), cview(mean, Shape{rows}),
                                cview(rstd, Shape{rows}), cview(r, s), view(dx, s));
  // The weight gradients accumulate: start them from non-zero values.
  const Vec gamma_start = uniform_values(std::size_t(n), rng), beta_start = uniform_values(std::size_t(n), rng);
  Vec dgamma = gamma_start, dbeta = beta_start;
  ops::layernorm_backward_weight(be, cview(x, s), cview(mean, Shape{rows}), cview(rstd, Shape{rows}), cview(r, s),
                                 view(dgamma, Shape{n}), view(dbeta, Shape{n}));
  for (index_t j = 0; j < n; ++j) {
    dgamma[j] -= gamma_start[j];
    dbeta[j] -= beta_start[j];
  }
  const auto loss = [&] { return dot(r, run()); };
  CHECK(relative_error(dx, numeric_gradient(x, loss)) <= grad_tolerance);
  CHECK(relative_error(dgamma, numeric_gradient(gamma, loss)) <= grad_tolerance);
  CHECK(relative_error(dbeta, numeric_gradient(beta, loss)) <= grad_tolerance);
}

TEST_CASE("layernorm over 2 columns: the output ignores the input, and so does the input gradient", "[cpu][host][layernorm]") {
  // y = +-gamma + beta for any two distinct values; dx is O(eps / var^1.5): zero to within that.
  const double eps = 1e-5;
  const Vec x{0.3, -0.7, 2.0, 2.5}, gamma{1.5, -0.5}, beta{0.1, 0.2}, r{0.9, -0.4, 0.25, 0.6};
  const Shape s{2, 2};
  backend::Host<double> be;
  Vec y(4), mean(2), rstd(2), dx(4);
  ops::layernorm_forward(be, cview(x, s), cview(gamma, Shape{2}), cview(beta, Shape{2}), view(y, s), view(mean, Shape{2}),
                         view(rstd, Shape{2}), eps);
  CHECK(y[0] == Approx(gamma[0] + beta[0]).margin(1e-3));  // x0 > x1: +gamma0, -gamma1
  CHECK(y[1] == Approx(-gamma[1] + beta[1]).margin(1e-3));
  CHECK(y[2] == Approx(-gamma[0] + beta[0]).margin(1e-3));
  CHECK(y[3] == Approx(gamma[1] + beta[1]).margin(1e-3));
  ops::layernorm_backward_input(be, cview(x, s), cview(gamma, Shape{2}), cview(mean, Shape{2}), cview(rstd, Shape{2}),
                                cview(r, s), view(dx, s));
  for (std::size_t i = 0; i < 4; ++i) CHECK(std::abs(dx[i]) < 1e-3);
  // ... but not exactly zero: the formula is the derivative, not a special case.
  CHECK(std::abs(dx[0]) > 0);
}

TEST_CASE("softmax cross-entropy: forward matches log-sum-exp, gradient matches finite differences",
          "[cpu][host][xent]") {
  const auto seed = GENERATE(take(5, random(1, 1000000)));
  Rng rng{std::uint64_t(seed)};
  const index_t rows = between(rng, 1, 6), classes = between(rng, 2, 8);
  const index_t normalizer = rows + between(rng, 1, 5);  // a microbatch of a larger batch
  const double dloss = rng.uniform(0.5, 2);
  const Shape s{rows, classes};
  Vec z = uniform_values(std::size_t(rows * classes), rng, -3, 3);
  const Ids labels = uniform_ints(std::size_t(rows), rng, classes);
  backend::Host<double> be;
  auto run = [&](const Vec& logits) {
    Vec loss(1);
    ops::softmax_cross_entropy_forward(be, cview(logits, s), ids_view(labels), view(loss, Shape{1}), normalizer);
    return loss[0];
  };

  double expected = 0;
  for (index_t i = 0; i < rows; ++i) {
    double sum = 0;
    for (index_t j = 0; j < classes; ++j) sum += std::exp(z[i * classes + j]);
    expected += std::log(sum) - z[i * classes + labels[std::size_t(i)]];
  }
  expected /= double(normalizer);
  CHECK(run(z) == Approx(expected).epsilon(1e-13));

  // Shift invariance, and no overflow with huge logits.
  Vec shifted = z;
  for (double& v : shifted) v += 1000;
  CHECK(run(shifted) == Approx(expected).epsilon(1e-10));

  Vec dz(z.size());
  ops::softmax_cross_entropy_backward(be, cview(z, s), ids_view(labels), view(dz, s), normalizer, dloss);
  Vec numeric = numeric_gradient(z, [&] { return run(z); });
  for (double& g : numeric) g *= dloss;
  CHECK(relative_error(dz, numeric) <= grad_tolerance);
}

TEST_CASE("embedding: forward gathers rows, and backward accumulates repeated ids", "[cpu][host][embedding]") {
  const auto seed = GENERATE(take(4, random(1, 1000000)));
  Rng rng{std::uint64_t(seed)};
  const index_t vocab = between(rng, 2, 10), dim = between(rng, 1, 6), n = between(rng, 1, 12);
  Vec table = uniform_values(std::size_t(vocab * dim), rng);
  Ids ids = uniform_ints(std::size_t(n), rng, vocab);
  ids[0] = std::int32_t(vocab - 1);  // the last row is reachable
  if (n > 1) ids[std::size_t(n - 1)] = ids[0];  // and at least one id repeats
  const Vec r = uniform_values(std::size_t(n * dim), rng);
  backend::Host<double> be;
  auto run = [&] {
    Vec y(static_cast<std::size_t>(n * dim));
    ops::embedding_forward(be, ids_view(ids), cview(table, Shape{vocab, dim}), view(y, Shape{n, dim}));
    return y;
  };
  const Vec y = run();
  for (index_t i = 0; i < n; ++i)
    for (index_t j = 0; j < dim; ++j) REQUIRE(y[i * dim + j] == table[ids[std::size_t(i)] * dim + j]);

  Vec dtable(table.size());
  ops::embedding_backward(be, ids_view(ids), cview(r, Shape{n, dim}), view(dtable, Shape{vocab, dim}));
  CHECK(relative_error(dtable, numeric_gradient(table, [&] { return dot(r, run()); })) <= grad_tolerance);
}

TEST_CASE("residual_add and axpy: forward and gradients", "[cpu][host]") {
  const auto seed = GENERATE(take(3, random(1, 1000000)));
  Rng rng{std::uint64_t(seed)};
  const index_t rows = between(rng, 1, 6), n = between(rng, 1, 6);
  const Shape s{rows, n};
  Vec a = uniform_values(std::size_t(rows * n), rng), b = uniform_values(a.size(), rng);
  const Vec r = uniform_values(a.size(), rng);
  const double alpha = rng.uniform(-2, 2);
  backend::Host<double> be;

  SECTION("residual_add: y = a + b, in place too; both inputs receive dy") {
    auto run = [&] {
      Vec y(a.size());
      ops::residual_add(be, cview(a, s), cview(b, s), view(y, s));
      return y;
    };
    const Vec y = run();
    for (std::size_t i = 0; i < a.size(); ++i) REQUIRE(y[i] == a[i] + b[i]);
    Vec in_place = a;
    ops::residual_add(be, cview(in_place, s), cview(b, s), view(in_place, s));
    CHECK(in_place == y);
    const auto loss = [&] { return dot(r, run()); };
    CHECK(relative_error(r, numeric_gradient(a, loss)) <= grad_tolerance);
    CHECK(relative_error(r, numeric_gradient(b, loss)) <= grad_tolerance);
  }
  SECTION("axpy: y = y0 + alpha x; dx = alpha dy (an axpy itself), dy0 = dy") {
    auto run = [&] {
      Vec y = b;
      ops::axpy(be, alpha, cview(a, s), view(y, s));
      return y;
    };
    const Vec y = run();
    for (std::size_t i = 0; i < a.size(); ++i) REQUIRE(y[i] == Approx(b[i] + alpha * a[i]).epsilon(1e-15));
    Vec dx(a.size(), 0.0);
    ops::axpy(be, alpha, cview(r, s), view(dx, s));
    const auto loss = [&] { return dot(r, run()); };
    CHECK(relative_error(dx, numeric_gradient(a, loss)) <= grad_tolerance);
    CHECK(relative_error(r, numeric_gradient(b, loss)) <= grad_tolerance);
  }
}

namespace {

/// Causal attention the textbook way, in double: for each sequence and head, the full (T, T) score
/// matrix, masked above the diagonal, softmaxed row by row, times V.
Vec naive_attention(const Vec& qkv, index_t rows, index_t C, index_t heads, index_t T) {
  const index_t D = C / heads;
  Vec out(std::size_t(rows * C), 0.0);
  auto at = [&](index_t row, index_t part, index_t h, index_t d) { return qkv[std::size_t(row * 3 * C + part * C + h * D + d)]; };
  for (index_t s0 = 0; s0 < rows; s0 += T)
    for (index_t h = 0; h < heads; ++h) {
      std::vector<Vec> p(std::size_t(T), Vec(std::size_t(T), 0.0));
      for (index_t t = 0; t < T; ++t) {
        double sum = 0;
        for (index_t u = 0; u < T; ++u) {
          if (u > t) continue;  // the mask
          double dot = 0;
          for (index_t d = 0; d < D; ++d) dot += at(s0 + t, 0, h, d) * at(s0 + u, 1, h, d);
          p[std::size_t(t)][std::size_t(u)] = std::exp(dot / std::sqrt(double(D)));
          sum += p[std::size_t(t)][std::size_t(u)];
        }
        for (index_t u = 0; u <= t; ++u) p[std::size_t(t)][std::size_t(u)] /= sum;
        for (index_t d = 0; d < D; ++d) {
          double o = 0;
          for (index_t u = 0; u <= t; ++u) o += p[std::size_t(t)][std::size_t(u)] * at(s0 + u, 2, h, d);
          out[std::size_t((s0 + t) * C + h * D + d)] = o;
        }
      }
    }
  return out;
}

}  // namespace

TEST_CASE("causal attention: forward matches the masked-softmax formula, backward matches finite differences",
          "[cpu][host][attention]") {
  const auto seed = std::uint64_t(GENERATE(take(2, random(1, 1000000))));
  Rng rng(seed);
  backend::Host<double> be;
  // (heads, head_dim, T, sequences): T = 1, odd T, one head and several; T = 130 runs three blocks of
  // queries (64, 64, 2: ops::attention_query_block), whose keys, dk and dv span the blocks.
  static_assert(ops::attention_query_block == 64, "T = 130 below is meant to end in a partial third block");
  for (const auto& [heads, D, T, S] :
       {std::array<index_t, 4>{1, 4, 1, 3}, {2, 3, 7, 2}, {4, 2, 5, 1}, {3, 2, 8, 2}, {2, 2, 130, 2}}) {
    const index_t C = heads * D, rows = T * S;
    Vec qkv = uniform_values(std::size_t(rows * 3 * C), rng, -1.5, 1.5), out(std::size_t(rows * C)),
        lse(std::size_t(rows * heads));
    auto forward = [&] {
      ops::causal_attention_forward(be, cview(qkv, Shape{rows, 3 * C}), view(out, Shape{rows, C}),
                                    view(lse, Shape{rows, heads}), heads, T);
    };
    forward();
    CAPTURE(seed, heads, D, T, S);
    CHECK(relative_error(out, naive_attention(qkv, rows, C, heads, T)) <= 1e-14);
    // Query 0 of each sequence attends only to itself: its output is its own v, and its lse its score.
    for (index_t s0 = 0; s0 < rows; s0 += T)
      for (index_t d = 0; d < C; ++d) CHECK(out[std::size_t(s0 * C + d)] == qkv[std::size_t(s0 * 3 * C + 2 * C + d)]);

    const Vec r = uniform_values(out.size(), rng);
    Vec dqkv(qkv.size(), 7.0);  // overwritten, not accumulated
    ops::causal_attention_backward(be, cview(qkv, Shape{rows, 3 * C}), cview(out, Shape{rows, C}),
                                   cview(lse, Shape{rows, heads}), cview(r, Shape{rows, C}), view(dqkv, Shape{rows, 3 * C}),
                                   heads, T);
    const Vec numeric = numeric_gradient(qkv, [&] {
      forward();
      return dot(r, out);
    });
    CHECK(relative_error(dqkv, numeric) <= grad_tolerance);
  }
}

TEST_CASE("causal attention: shapes that are not whole sequences or heads are refused", "[cpu][host][attention][errors]") {
  backend::Host<double> be;
  Vec qkv(6 * 12), out(6 * 4), lse(6 * 2);
  auto run = [&](index_t rows, index_t cols, index_t heads, index_t T) {
    ops::causal_attention_forward(be, cview(qkv, Shape{rows, cols}), view(out, Shape{rows, cols / 3}),
                                  view(lse, Shape{rows, heads}), heads, T);
  };
  CHECK_NOTHROW(run(6, 12, 2, 3));
  CHECK_THROWS_WITH(run(6, 12, 2, 4), Catch::Contains("qkv has 6 rows, not whole sequences of 4 tokens"));
  CHECK_THROWS_WITH(run(6, 12, 3, 3), Catch::Contains("not 3 * C with C a multiple of 3 heads"));
  CHECK_THROWS_WITH(run(6, 12, 0, 3), Catch::Contains("must be positive"));
}
