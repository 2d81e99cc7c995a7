// SPDX-License-Identifier: Apache-2.0
// backend::Host<bfloat16, float> (issue #12): every bf16 storage op against a float64 reference run
// on the same (bf16-representable) inputs. A value the op stores in bf16 must be within half a bf16
// ulp of the reference (2^-8 relative: one rounding, to nearest), plus float's error; a value it keeps
// in the compute precision (gradients, the loss) within float's error. Rounding by truncation, a
// missing store, or bf16 accumulation all break these bounds.
#include <catch2/catch.hpp>

#include <cmath>
#include <cstdint>
#include <vector>

#include "cupipe/backend/host/ops.hpp"
#include "gradcheck.hpp"

using namespace cupipe;
using Catch::Contains;
using cupipe::ops::Transpose;
using cupipe::testing::uniform_ints;
using cupipe::testing::uniform_values;

namespace {

// OpenBLAS's cblas.h declares a ::bfloat16 of its own, so cupipe's is named in full.
using BF = cupipe::bfloat16;
using Vec = std::vector<double>;
using Ids = std::vector<std::int32_t>;
using Bf16 = backend::Host<BF, float>;
using F64 = backend::Host<double>;

/// Random values that are exactly representable in bf16, so both backends see the same input.
Vec bf16_exact(std::size_t n, Rng& rng, double low = -1, double high = 1) {
  Vec v = uniform_values(n, rng, low, high);
  for (double& x : v) x = double(float(BF(float(x))));
  return v;
}

template <class T>
std::vector<T> as(const Vec& v) {
  std::vector<T> out;
  out.reserve(v.size());
  for (double x : v) out.push_back(T(float(x)));
  return out;
}
template <>
std::vector<double> as<double>(const Vec& v) { return v; }

template <class T>
Vec to_double(const std::vector<T>& v) {
  Vec out;
  for (const T& x : v) out.push_back(double(float(x)));
  return out;
}
template <>
Vec to_double<double>(const std::vector<double>& v) { return v; }

template <class T>
TensorView<T> view(std::vector<T>& v, Shape s) { return {v.data(), s}; }
template <class T>
ConstView<T> cview(const std::vector<T>& v, Shape s) { return {v.data(), s}; }
ConstView<std::int32_t> ids_view(const Ids& v) { return {v.data(), Shape{index_t(v.size())}}; }

/// What an op produced: its values, and whether they were stored in the storage precision (bf16 on
/// the bf16 backend) or kept in the compute precision.
struct Output {
  Vec values;
  bool stored = true;
};
using Outputs = std::vector<Output>;

/// Runs `run` on both backends and checks each output against the float64 one. Stored outputs: every
/// element within 2^-8 of the reference's magnitude (half an ulp) plus `float_slack` x the output's
/// largest magnitude; compute outputs: within `float_slack` x the largest magnitude.
template <class Run>
void check_against_float64(Run&& run, double float_slack = 2e-6) {
  Bf16 bf16;
  F64 f64;
  const Outputs got = run(bf16), want = run(f64);
  REQUIRE(got.size() == want.size());
  for (std::size_t o = 0; o < got.size(); ++o) {
    CAPTURE(o);
    const Vec& g = got[o].values;
    const Vec& w = want[o].values;
    REQUIRE(g.size() == w.size());
    double scale = 0;
    for (double x : w) scale = std::max(scale, std::abs(x));
    int worst = -1;
    double worst_excess = 0;
    for (std::size_t i = 0; i < g.size(); ++i) {
      const double bound = (got[o].stored ? std::ldexp(std::abs(w[i]), -8) : 0.0) + float_slack * scale;
      const double excess = std::abs(g[i] - w[i]) - bound;
      if (excess > worst_excess) {
        worst_excess = excess;
        worst = int(i);
      }
    }
    CAPTURE(worst, worst >= 0 ? g[std::size_t(worst)] : 0.0, worst >= 0 ? w[std::size_t(worst)] : 0.0);
    CHECK(worst == -1);
  }
}

}  // namespace

TEST_CASE("bf16 storage: gemm into bf16 (one rounding) and into float (float accumulation)", "[cpu][host][bf16]") {
  const Transpose ta = GENERATE(Transpose::no, Transpose::yes);
  const Transpose tb = GENERATE(Transpose::no, Transpose::yes);
  Rng rng{std::uint64_t(7 + 2 * int(ta) + int(tb))};
  const index_t m = 13, k = 96, n = 11;
  const Vec a = bf16_exact(std::size_t(m * k), rng), b = bf16_exact(std::size_t(k * n), rng);
  const Vec c0 = bf16_exact(std::size_t(m * n), rng);
  const Shape as_ = ta == Transpose::no ? Shape{m, k} : Shape{k, m}, bs = tb == Transpose::no ? Shape{k, n} : Shape{n, k};
  check_against_float64([&]<class B>(B& be) {
    using S = typename B::value_type;
    using C = typename B::compute_type;
    const auto at = as<S>(a), bt = as<S>(b);
    auto stored = as<S>(c0);
    ops::gemm(be, ta, tb, S(1), cview(at, as_), cview(bt, bs), S(1), view(stored, Shape{m, n}));  // a layer's y += x W^T
    auto accumulated = as<C>(c0);
    ops::gemm(be, ta, tb, 0.75, cview(at, as_), cview(bt, bs), 1.0, view(accumulated, Shape{m, n}));  // dW += ...
    return Outputs{{to_double(stored), true}, {to_double(accumulated), false}};
  });
}

TEST_CASE("bf16 storage: gemm_bias adds the bias in float and rounds once, as the CUDA epilogue", "[cpu][host][bf16]") {
  Rng rng{21};
  const index_t m = 17, k = 96, n = 12;
  const Vec a = bf16_exact(std::size_t(m * k), rng), w = bf16_exact(std::size_t(n * k), rng);
  // Biases near minus the products make the sum cancel, where a rounding before the addition shows.
  const Vec bias = bf16_exact(std::size_t(n), rng, -3, 3);
  check_against_float64([&]<class B>(B& be) {
    using S = typename B::value_type;
    const auto at = as<S>(a), wt = as<S>(w), bt = as<S>(bias);
    std::vector<S> y(std::size_t(m * n));
    if constexpr (std::is_same_v<B, Bf16>) {
      ops::gemm_bias(be, Transpose::no, Transpose::yes, S(1), cview(at, Shape{m, k}), cview(wt, Shape{n, k}), cview(bt, Shape{n}),
                     view(y, Shape{m, n}));
    } else {
      ops::gemm(be, Transpose::no, Transpose::yes, S(1), cview(at, Shape{m, k}), cview(wt, Shape{n, k}), S(0), view(y, Shape{m, n}));
      ops::bias_add(be, view(y, Shape{m, n}), cview(bt, Shape{n}));
    }
    return Outputs{{to_double(y), true}};
  });
}

TEST_CASE("bf16 storage: elementwise ops, bias, residual, axpy, copy and fill round once", "[cpu][host][bf16]") {
  Rng rng{std::uint64_t(GENERATE(3, 4))};
  const index_t rows = 9, n = 37;
  const Shape s{rows, n};
  const Vec x = bf16_exact(std::size_t(rows * n), rng, -3, 3), dy = bf16_exact(x.size(), rng);
  const Vec bias = bf16_exact(std::size_t(n), rng);
  check_against_float64([&]<class B>(B& be) {
    using S = typename B::value_type;
    using C = typename B::compute_type;
    const auto xt = as<S>(x), dyt = as<S>(dy), bt = as<S>(bias);
    std::vector<S> relu_y(x.size()), relu_dx(x.size()), gelu_y(x.size()), gelu_dx(x.size()), sum(x.size());
    ops::relu_forward(be, cview(xt, s), view(relu_y, s));
    ops::relu_backward(be, cview(xt, s), cview(dyt, s), view(relu_dx, s));
    ops::gelu_forward(be, cview(xt, s), view(gelu_y, s));
    ops::gelu_backward(be, cview(xt, s), cview(dyt, s), view(gelu_dx, s));
    ops::residual_add(be, cview(xt, s), cview(dyt, s), view(sum, s));
    auto biased = xt;
    ops::bias_add(be, view(biased, s), cview(bt, Shape{n}));
    std::vector<C> dbias(static_cast<std::size_t>(n), C(0.25f));
    ops::bias_backward(be, cview(dyt, s), view(dbias, Shape{n}));
    auto y = dyt;
    ops::axpy(be, -1.25, cview(xt, s), view(y, s));
    std::vector<S> copied(x.size()), filled(x.size());
    ops::copy(be, cview(xt, s), view(copied, s));
    ops::fill(be, view(filled, s), 0.3);
    return Outputs{{to_double(relu_y)},  {to_double(relu_dx)}, {to_double(gelu_y)}, {to_double(gelu_dx)},
                   {to_double(sum)},     {to_double(biased)},  {to_double(dbias), false},
                   {to_double(y)},       {to_double(copied)},  {to_double(filled)}};
  });
}

TEST_CASE("bf16 storage: layernorm computes in float and keeps its statistics in float", "[cpu][host][bf16]") {
  Rng rng{std::uint64_t(GENERATE(5, 6))};
  const index_t rows = 7, n = 48;
  const Shape s{rows, n};
  const Vec x = bf16_exact(std::size_t(rows * n), rng, -2, 2), dy = bf16_exact(x.size(), rng);
  const Vec gamma = bf16_exact(std::size_t(n), rng, 0.5, 1.5), beta = bf16_exact(std::size_t(n), rng);
  // The backwards read the bf16 backend's float statistics in both runs: they are inputs here.
  Bf16 bf16;
  std::vector<BF> y16(x.size());
  std::vector<float> mean32(static_cast<std::size_t>(rows)), rstd32(static_cast<std::size_t>(rows));
  ops::layernorm_forward(bf16, cview(as<BF>(x), s), cview(as<BF>(gamma), Shape{n}), cview(as<BF>(beta), Shape{n}),
                         view(y16, s), view(mean32, Shape{rows}), view(rstd32, Shape{rows}), 1e-5);
  const Vec mean = to_double(mean32), rstd = to_double(rstd32);
  check_against_float64([&]<class B>(B& be) {
    using S = typename B::value_type;
    using C = typename B::compute_type;
    const auto xt = as<S>(x), dyt = as<S>(dy), gt = as<S>(gamma), bt = as<S>(beta);
    const auto mt = as<C>(mean), rt = as<C>(rstd);
    std::vector<S> y(x.size()), dx(x.size());
    std::vector<C> fmean(static_cast<std::size_t>(rows)), frstd(static_cast<std::size_t>(rows));
    std::vector<C> dgamma(static_cast<std::size_t>(n)), dbeta(static_cast<std::size_t>(n));
    ops::layernorm_forward(be, cview(xt, s), cview(gt, Shape{n}), cview(bt, Shape{n}), view(y, s), view(fmean, Shape{rows}),
                           view(frstd, Shape{rows}), 1e-5);
    ops::layernorm_backward_input(be, cview(xt, s), cview(gt, Shape{n}), cview(mt, Shape{rows}), cview(rt, Shape{rows}),
                                  cview(dyt, s), view(dx, s));
    ops::layernorm_backward_weight(be, cview(xt, s), cview(mt, Shape{rows}), cview(rt, Shape{rows}), cview(dyt, s),
                                   view(dgamma, Shape{n}), view(dbeta, Shape{n}));
    return Outputs{{to_double(y)}, {to_double(fmean), false}, {to_double(frstd), false}, {to_double(dx)},
                   {to_double(dgamma), false}, {to_double(dbeta), false}};
  }, 1e-5);
}

TEST_CASE("bf16 storage: cross-entropy's loss in float, embedding gathers exactly and accumulates in float",
          "[cpu][host][bf16]") {
  Rng rng{std::uint64_t(GENERATE(8, 9))};
  const index_t rows = 12, classes = 50, vocab = 20, dim = 9;
  const Vec z = bf16_exact(std::size_t(rows * classes), rng, -6, 6);
  const Ids labels = uniform_ints(std::size_t(rows), rng, classes), ids = uniform_ints(std::size_t(rows), rng, vocab);
  const Vec table = bf16_exact(std::size_t(vocab * dim), rng), dy = bf16_exact(std::size_t(rows * dim), rng);
  check_against_float64([&]<class B>(B& be) {
    using S = typename B::value_type;
    using C = typename B::compute_type;
    const auto zt = as<S>(z), tt = as<S>(table), dyt = as<S>(dy);
    std::vector<C> loss(1), dtable(table.size(), C(0.5f));
    std::vector<S> dz(z.size()), emb(static_cast<std::size_t>(rows * dim));
    ops::softmax_cross_entropy_forward(be, cview(zt, Shape{rows, classes}), ids_view(labels), view(loss, Shape{1}), 40);
    ops::softmax_cross_entropy_backward(be, cview(zt, Shape{rows, classes}), ids_view(labels), view(dz, Shape{rows, classes}), 40,
                                        1.5);
    ops::embedding_forward(be, ids_view(ids), cview(tt, Shape{vocab, dim}), view(emb, Shape{rows, dim}));
    ops::embedding_backward(be, ids_view(ids), cview(dyt, Shape{rows, dim}), view(dtable, Shape{vocab, dim}));
    return Outputs{{to_double(loss), false}, {to_double(dz)}, {to_double(emb)}, {to_double(dtable), false}};
  });
}

TEST_CASE("bf16 storage: the vocabulary-parallel loss's parts keep statistics and lse in float", "[cpu][host][bf16]") {
  Rng rng{std::uint64_t(GENERATE(10, 11))};
  // Columns [20, 45) of 50 classes: labels in the part and outside it.
  const index_t rows = 12, cols = 25;
  const ops::VocabPart part{20, 50};
  const Vec z = bf16_exact(std::size_t(rows * cols), rng, -6, 6);
  const Ids labels = uniform_ints(std::size_t(rows), rng, 50);
  const Vec lse = uniform_values(std::size_t(rows), rng, 4, 6);
  check_against_float64([&]<class B>(B& be) {
    using S = typename B::value_type;
    using C = typename B::compute_type;
    const auto zt = as<S>(z);
    const auto lt = as<C>(lse);
    std::vector<C> stats(static_cast<std::size_t>(rows * 3));
    std::vector<S> dz(z.size());
    ops::softmax_cross_entropy_part_stats(be, cview(zt, Shape{rows, cols}), ids_view(labels), view(stats, Shape{rows, 3}), part);
    ops::softmax_cross_entropy_part_backward(be, cview(zt, Shape{rows, cols}), ids_view(labels), cview(lt, Shape{rows}),
                                             view(dz, Shape{rows, cols}), 40, part, 1.5);
    return Outputs{{to_double(stats), false}, {to_double(dz)}};
  });
}

TEST_CASE("bf16 storage: causal attention computes in float, stores out and dqkv in bf16 and keeps lse in float",
          "[cpu][host][bf16]") {
  Rng rng{11};
  const index_t heads = 2, seq = 9, sequences = 2, C = 16;
  const index_t rows = seq * sequences;
  const Vec qkv = bf16_exact(std::size_t(rows * 3 * C), rng, -1.5, 1.5), dout = bf16_exact(std::size_t(rows * C), rng);
  // The backward reads the bf16 forward's stored out and float lse in both runs.
  Bf16 bf16;
  std::vector<BF> out16(static_cast<std::size_t>(rows * C));
  std::vector<float> lse32(static_cast<std::size_t>(rows * heads));
  ops::causal_attention_forward(bf16, cview(as<BF>(qkv), Shape{rows, 3 * C}), view(out16, Shape{rows, C}),
                                view(lse32, Shape{rows, heads}), heads, seq);
  const Vec out = to_double(out16), lse = to_double(lse32);
  check_against_float64([&]<class B>(B& be) {
    using S = typename B::value_type;
    using Cm = typename B::compute_type;
    const auto q = as<S>(qkv), o = as<S>(out), d = as<S>(dout);
    const auto l = as<Cm>(lse);
    std::vector<S> fout(out.size()), dqkv(qkv.size());
    std::vector<Cm> flse(lse.size());
    ops::causal_attention_forward(be, cview(q, Shape{rows, 3 * C}), view(fout, Shape{rows, C}), view(flse, Shape{rows, heads}),
                                  heads, seq);
    ops::causal_attention_backward(be, cview(q, Shape{rows, 3 * C}), cview(o, Shape{rows, C}), cview(l, Shape{rows, heads}),
                                   cview(d, Shape{rows, C}), view(dqkv, Shape{rows, 3 * C}), heads, seq);
    return Outputs{{to_double(fout)}, {to_double(flse), false}, {to_double(dqkv)}};
  }, 1e-5);
}

TEST_CASE("bf16 storage: AdamW on float master weights, the parameters in use their rounding", "[cpu][host][bf16]") {
  Rng rng{12};
  const index_t n = 301;
  const Vec p0 = uniform_values(std::size_t(n), rng), g = uniform_values(std::size_t(n), rng);
  Bf16 be;
  backend::Host<float> f32;
  std::vector<float> master = as<float>(p0), m(static_cast<std::size_t>(n)), v(static_cast<std::size_t>(n)), grad = as<float>(g);
  std::vector<float> ref = master, ref_m = m, ref_v = v;
  std::vector<BF> param(static_cast<std::size_t>(n));
  const ops::AdamWHyper h{.lr = 0.01, .weight_decay = 0.1};
  for (std::int64_t step = 1; step <= 3; ++step) {
    ops::adamw_update_master(be, view(master, Shape{n}), view(param, Shape{n}), cview(grad, Shape{n}), view(m, Shape{n}),
                             view(v, Shape{n}), h, step, 0.5);
    ops::adamw_update(f32, view(ref, Shape{n}), cview(grad, Shape{n}), view(ref_m, Shape{n}), view(ref_v, Shape{n}), h, step, 0.5f);
  }
  CHECK(master == ref);  // the master weights see float AdamW exactly
  CHECK(m == ref_m);
  CHECK(v == ref_v);
  int not_rounded = 0;
  for (index_t i = 0; i < n; ++i) not_rounded += param[std::size_t(i)].bits != BF(master[std::size_t(i)]).bits;
  CHECK(not_rounded == 0);
  double squares = 0;
  for (const BF& x : param) squares += double(float(x)) * double(float(x));
  CHECK(std::abs(ops::sum_of_squares(be, cview(param, Shape{n})) - squares) <= 1e-12 * squares);
}

TEST_CASE("bf16 storage: bad views are refused with the op's name", "[cpu][host][bf16][errors]") {
  Bf16 be;
  std::vector<BF> x(6), y(8);
  CHECK_THROWS_WITH(ops::relu_forward(be, cview(x, Shape{2, 3}), view(y, Shape{2, 4})), Contains("relu_forward"));
  CHECK_THROWS_WITH(ops::gelu_forward(be, ConstView<BF>{nullptr, Shape{2, 3}}, view(x, Shape{2, 3})),
                    Contains("gelu_forward") && Contains("null"));
  std::vector<float> c(4);
  CHECK_THROWS_WITH(ops::gemm(be, Transpose::no, Transpose::no, 1.0, cview(x, Shape{2, 3}), cview(x, Shape{2, 3}), 0.0,
                              view(c, Shape{2, 2})),
                    Contains("gemm") && Contains("inner extents"));
}
