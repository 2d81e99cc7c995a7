// SPDX-License-Identifier: Apache-2.0
// Host ops: float and double agree on every op; optimizer updates follow PyTorch's documented rules
// over several steps; bad input throws a cupipe::error naming the op and the shapes or values.
#include <catch2/catch.hpp>

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <utility>
#include <vector>

#include "cupipe/backend/host/ops.hpp"
#include "gradcheck.hpp"

using namespace cupipe;
using Catch::Contains;
using cupipe::ops::Transpose;
using cupipe::testing::cast_all;
using cupipe::testing::relative_error;
using cupipe::testing::uniform_ints;
using cupipe::testing::uniform_values;

namespace {

using Vec = std::vector<double>;
using Ids = std::vector<std::int32_t>;
using Outputs = std::vector<Vec>;

template <class T>
TensorView<T> view(std::vector<T>& v, Shape s) { return {v.data(), s}; }
template <class T>
ConstView<T> cview(const std::vector<T>& v, Shape s) { return {v.data(), s}; }
ConstView<std::int32_t> ids_view(const Ids& v) { return {v.data(), Shape{index_t(v.size())}}; }

/// Random values that are exactly representable as float, so both precisions see the same input.
Vec float_exact(std::size_t n, Rng& rng, double low = -1, double high = 1) {
  Vec v = uniform_values(n, rng, low, high);
  for (double& x : v) x = double(float(x));
  return v;
}

/// Runs `run` (a generic lambda taking backend::Host<T>&, returning its outputs as doubles) in float
/// and in double, and checks every output agrees to `tolerance` (relative, over the whole output).
template <class Run>
void check_float_double_agree(Run&& run, double tolerance = 1e-5) {
  backend::Host<float> host_float;
  backend::Host<double> host_double;
  const Outputs f = run(host_float), d = run(host_double);
  REQUIRE(f.size() == d.size());
  for (std::size_t i = 0; i < f.size(); ++i) {
    CAPTURE(i);
    REQUIRE(f[i].size() == d[i].size());
    CHECK(relative_error(f[i], d[i]) <= tolerance);
  }
}

template <class T>
Vec as_double(const std::vector<T>& v) { return cast_all<double>(v); }

}  // namespace

// ---------------------------------------------------------------------------------------------
// float vs double

TEST_CASE("float and double agree: gemm, all transposes, alpha and beta", "[cpu][host][precision]") {
  const auto seed = GENERATE(take(2, random(1, 1000000)));
  const Transpose ta = GENERATE(Transpose::no, Transpose::yes);
  const Transpose tb = GENERATE(Transpose::no, Transpose::yes);
  Rng rng{std::uint64_t(seed)};
  const index_t m = 9 + index_t(rng.below(8)), k = 20 + index_t(rng.below(30)), n = 5 + index_t(rng.below(8));
  const Vec a = float_exact(std::size_t(m * k), rng), b = float_exact(std::size_t(k * n), rng);
  const Vec c0 = float_exact(std::size_t(m * n), rng);
  const Shape as = ta == Transpose::no ? Shape{m, k} : Shape{k, m}, bs = tb == Transpose::no ? Shape{k, n} : Shape{n, k};
  check_float_double_agree([&]<class T>(backend::Host<T>& be) {
    const auto ta_ = cast_all<T>(a), tb_ = cast_all<T>(b);
    auto c = cast_all<T>(c0);
    ops::gemm(be, ta, tb, T(0.75), cview(ta_, as), cview(tb_, bs), T(-0.5), view(c, Shape{m, n}));
    return Outputs{as_double(c)};
  });
}

TEST_CASE("float and double agree: elementwise ops, bias, residual, axpy, copy, fill", "[cpu][host][precision]") {
  Rng rng{std::uint64_t(GENERATE(take(2, random(1, 1000000))))};
  const index_t rows = 7, n = 13;
  const Shape s{rows, n};
  const Vec x = float_exact(std::size_t(rows * n), rng, -3, 3), dy = float_exact(x.size(), rng);
  const Vec bias = float_exact(std::size_t(n), rng);
  check_float_double_agree([&]<class T>(backend::Host<T>& be) {
    const auto xt = cast_all<T>(x), dyt = cast_all<T>(dy), bt = cast_all<T>(bias);
    std::vector<T> relu_y(x.size()), relu_dx(x.size()), gelu_y(x.size()), gelu_dx(x.size()), sum(x.size());
    ops::relu_forward(be, cview(xt, s), view(relu_y, s));
    ops::relu_backward(be, cview(xt, s), cview(dyt, s), view(relu_dx, s));
    ops::gelu_forward(be, cview(xt, s), view(gelu_y, s));
    ops::gelu_backward(be, cview(xt, s), cview(dyt, s), view(gelu_dx, s));
    ops::residual_add(be, cview(xt, s), cview(dyt, s), view(sum, s));
    auto biased = xt;
    ops::bias_add(be, view(biased, s), cview(bt, Shape{n}));
    std::vector<T> dbias(static_cast<std::size_t>(n));
    ops::bias_backward(be, cview(dyt, s), view(dbias, Shape{n}));
    auto y = dyt;
    ops::axpy(be, T(-1.25), cview(xt, s), view(y, s));
    std::vector<T> copied(x.size()), filled(x.size());
    ops::copy(be, cview(xt, s), view(copied, s));
    ops::fill(be, view(filled, s), T(0.5));
    return Outputs{as_double(relu_y), as_double(relu_dx), as_double(gelu_y), as_double(gelu_dx), as_double(sum),
                   as_double(biased), as_double(dbias), as_double(y), as_double(copied), as_double(filled)};
  });
}

TEST_CASE("float and double agree: layernorm forward and both backwards", "[cpu][host][precision]") {
  Rng rng{std::uint64_t(GENERATE(take(2, random(1, 1000000))))};
  const index_t rows = 6, n = 24;
  const Shape s{rows, n};
  const Vec x = float_exact(std::size_t(rows * n), rng, -2, 2), dy = float_exact(x.size(), rng);
  const Vec gamma = float_exact(std::size_t(n), rng, 0.5, 1.5), beta = float_exact(std::size_t(n), rng);
  check_float_double_agree([&]<class T>(backend::Host<T>& be) {
    const auto xt = cast_all<T>(x), dyt = cast_all<T>(dy), gt = cast_all<T>(gamma), bt = cast_all<T>(beta);
    std::vector<T> y(x.size()), mean(static_cast<std::size_t>(rows)), rstd(static_cast<std::size_t>(rows)), dx(x.size());
    std::vector<T> dgamma(static_cast<std::size_t>(n)), dbeta(static_cast<std::size_t>(n));
    ops::layernorm_forward(be, cview(xt, s), cview(gt, Shape{n}), cview(bt, Shape{n}), view(y, s),
                           view(mean, Shape{rows}), view(rstd, Shape{rows}), 1e-5);
    ops::layernorm_backward_input(be, cview(xt, s), cview(gt, Shape{n}), cview(mean, Shape{rows}),
                                  cview(rstd, Shape{rows}), cview(dyt, s), view(dx, s));
    ops::layernorm_backward_weight(be, cview(xt, s), cview(mean, Shape{rows}), cview(rstd, Shape{rows}),
                                   cview(dyt, s), view(dgamma, Shape{n}), view(dbeta, Shape{n}));
    return Outputs{as_double(y), as_double(mean), as_double(rstd), as_double(dx), as_double(dgamma), as_double(dbeta)};
  });
}

TEST_CASE("causal attention with document borders runs each document as a sequence of its own",
          "[cpu][host][attention][documents]") {
  // Two sequences of 70 rows: documents of 1, 65 and 4 rows, then 70 (one document: the borders of
  // the sequence itself).
  Rng rng{std::uint64_t(GENERATE(3, 4))};
  const index_t heads = 2, D = 3, C = heads * D, T = 70, rows = 2 * T;
  const std::vector<std::pair<index_t, index_t>> docs{{0, 1}, {1, 65}, {66, 4}, {70, 70}};  // (first row, length)
  std::vector<std::int32_t> starts(std::size_t(rows), 0);
  for (const auto& [first, length] : docs)
    for (index_t r = first; r < first + length; ++r) starts[std::size_t(r)] = std::int32_t(first % T);
  const DocumentStarts documents{starts.data(), rows};
  Vec qkv = float_exact(std::size_t(rows * 3 * C), rng, -1.5, 1.5);
  const Vec dout = float_exact(std::size_t(rows * C), rng);
  backend::Host<double> be;
  const auto run = [&](const Vec& q, const DocumentStarts& borders) {
    Vec out(std::size_t(rows * C)), lse(std::size_t(rows * heads)), dqkv(q.size());
    ops::causal_attention_forward(be, cview(q, Shape{rows, 3 * C}), view(out, Shape{rows, C}), view(lse, Shape{rows, heads}),
                                  heads, T, borders);
    ops::causal_attention_backward(be, cview(q, Shape{rows, 3 * C}), cview(out, Shape{rows, C}), cview(lse, Shape{rows, heads}),
                                   cview(dout, Shape{rows, C}), view(dqkv, Shape{rows, 3 * C}), heads, T, borders);
    return Outputs{out, lse, dqkv};
  };
  const Outputs packed = run(qkv, documents);
  // Each document alone, as a sequence of its length: the same bits.
  for (const auto& [first, length] : docs) {
    CAPTURE(first, length);
    const Vec q(qkv.begin() + first * 3 * C, qkv.begin() + (first + length) * 3 * C);
    Vec out(std::size_t(length * C)), lse(std::size_t(length * heads)), dqkv(q.size());
    ops::causal_attention_forward(be, cview(q, Shape{length, 3 * C}), view(out, Shape{length, C}),
                                  view(lse, Shape{length, heads}), heads, length);
    ops::causal_attention_backward(be, cview(q, Shape{length, 3 * C}), cview(out, Shape{length, C}),
                                   cview(lse, Shape{length, heads}), ConstView<double>{dout.data() + first * C, Shape{length, C}},
                                   view(dqkv, Shape{length, 3 * C}), heads, length);
    CHECK(std::equal(out.begin(), out.end(), packed[0].begin() + first * C));
    CHECK(std::equal(lse.begin(), lse.end(), packed[1].begin() + first * heads));
    CHECK(std::equal(dqkv.begin(), dqkv.end(), packed[2].begin() + first * 3 * C));
  }
  // The second sequence is one document: the same as no borders there; the first is not.
  const Outputs whole = run(qkv, {});
  CHECK(std::equal(whole[0].begin() + T * C, whole[0].end(), packed[0].begin() + T * C));
  CHECK_FALSE(std::equal(whole[0].begin(), whole[0].begin() + T * C, packed[0].begin()));
  // A document's keys are out of another's reach: changing the first document moves nothing after it.
  for (index_t i = 0; i < 3 * C; ++i) qkv[std::size_t(i)] += 0.5;
  const Outputs moved = run(qkv, documents);
  CHECK(std::equal(moved[0].begin() + C, moved[0].end(), packed[0].begin() + C));
  CHECK_FALSE(std::equal(moved[0].begin(), moved[0].begin() + C, packed[0].begin()));
  // Borders that do not describe the rows: refused, naming the row.
  starts[3] = 2;
  CHECK_THROWS_WITH(run(qkv, documents), Contains("causal_attention_forward") && Contains("row 3") && Contains("document start 2"));
}

TEST_CASE("float and double agree: causal attention over several query blocks, and GELU in place",
          "[cpu][host][precision][attention]") {
  Rng rng{std::uint64_t(GENERATE(take(2, random(1, 1000000))))};
  // Two sequences of 130 tokens: query blocks of 64, 64 and 2 (ops::attention_query_block), in float
  // through cblas_sgemm and backend::host::exp, in double through cblas_dgemm and libm.
  const index_t heads = 3, D = 4, C = heads * D, T = 130, rows = 2 * T;
  const Vec qkv = float_exact(std::size_t(rows * 3 * C), rng, -1.5, 1.5), dout = float_exact(std::size_t(rows * C), rng);
  check_float_double_agree([&]<class T_>(backend::Host<T_>& be) {
    const auto q = cast_all<T_>(qkv), g = cast_all<T_>(dout);
    std::vector<T_> out(dout.size()), lse(static_cast<std::size_t>(rows * heads)), dqkv(qkv.size());
    ops::causal_attention_forward(be, cview(q, Shape{rows, 3 * C}), view(out, Shape{rows, C}), view(lse, Shape{rows, heads}),
                                  heads, T);
    ops::causal_attention_backward(be, cview(q, Shape{rows, 3 * C}), cview(out, Shape{rows, C}), cview(lse, Shape{rows, heads}),
                                   cview(g, Shape{rows, C}), view(dqkv, Shape{rows, 3 * C}), heads, T);
    return Outputs{as_double(out), as_double(lse), as_double(dqkv)};
  });
  // GELU's ops take their output in place of an input (the layers' paired backward does): the same
  // values as into a separate buffer.
  const index_t n = 301;
  const Vec x = float_exact(std::size_t(n), rng, -6, 6), dy = float_exact(std::size_t(n), rng);
  const auto xf = cast_all<float>(x), dyf = cast_all<float>(dy);
  backend::Host<float> be;
  std::vector<float> y(xf.size()), dx(xf.size());
  ops::gelu_forward(be, cview(xf, Shape{n}), view(y, Shape{n}));
  ops::gelu_backward(be, cview(xf, Shape{n}), cview(dyf, Shape{n}), view(dx, Shape{n}));
  auto in_place = xf;
  ops::gelu_forward(be, cview(in_place, Shape{n}), view(in_place, Shape{n}));
  CHECK(in_place == y);
  auto grad_in_place = dyf;
  ops::gelu_backward(be, cview(xf, Shape{n}), cview(grad_in_place, Shape{n}), view(grad_in_place, Shape{n}));
  CHECK(grad_in_place == dx);
}

TEST_CASE("float and double agree: softmax cross-entropy and embedding", "[cpu][host][precision]") {
  Rng rng{std::uint64_t(GENERATE(take(2, random(1, 1000000))))};
  const index_t rows = 9, classes = 10, vocab = 12, dim = 7;
  const Vec z = float_exact(std::size_t(rows * classes), rng, -4, 4);
  const Ids labels = uniform_ints(std::size_t(rows), rng, classes), ids = uniform_ints(std::size_t(rows), rng, vocab);
  const Vec table = float_exact(std::size_t(vocab * dim), rng), dy = float_exact(std::size_t(rows * dim), rng);
  check_float_double_agree([&]<class T>(backend::Host<T>& be) {
    const auto zt = cast_all<T>(z), tt = cast_all<T>(table), dyt = cast_all<T>(dy);
    std::vector<T> loss(1), dz(z.size()), emb(static_cast<std::size_t>(rows * dim)), dtable(table.size());
    ops::softmax_cross_entropy_forward(be, cview(zt, Shape{rows, classes}), ids_view(labels), view(loss, Shape{1}), 32);
    ops::softmax_cross_entropy_backward(be, cview(zt, Shape{rows, classes}), ids_view(labels),
                                        view(dz, Shape{rows, classes}), 32, T(1.5));
    ops::embedding_forward(be, ids_view(ids), cview(tt, Shape{vocab, dim}), view(emb, Shape{rows, dim}));
    ops::embedding_backward(be, ids_view(ids), cview(dyt, Shape{rows, dim}), view(dtable, Shape{vocab, dim}));
    return Outputs{as_double(loss), as_double(dz), as_double(emb), as_double(dtable)};
  });
}

TEST_CASE("vocabulary parts of embedding and cross-entropy add up to the whole vocabulary's ops",
          "[cpu][host][tensor_parallel]") {
  // P parts of a vocabulary in one process, as P tensor-parallel ranks hold them: the parts' embedding
  // rows sum to the whole lookup, each part's table gradient is its rows of the whole one, and the
  // cross-entropy rebuilt from the parts' (max, sum, label logit) rows equals the whole loss, with
  // each part's logit gradient its columns of the whole one.
  const int parts = GENERATE(1, 2, 3);
  Rng rng{std::uint64_t(17 + parts)};
  const index_t rows = 11, vocab = 12, dim = 5, part_rows = vocab / parts;
  backend::Host<double> be;
  const Vec table = uniform_values(std::size_t(vocab * dim), rng, -1, 1), dy = uniform_values(std::size_t(rows * dim), rng, -1, 1);
  const Vec z = uniform_values(std::size_t(rows * vocab), rng, -6, 6);
  const Ids ids = uniform_ints(std::size_t(rows), rng, vocab), labels = uniform_ints(std::size_t(rows), rng, vocab);
  Vec whole_y(std::size_t(rows * dim)), whole_dtable(table.size(), 0.0), loss(1), whole_dz(z.size());
  ops::embedding_forward(be, ids_view(ids), cview(table, Shape{vocab, dim}), view(whole_y, Shape{rows, dim}));
  ops::embedding_backward(be, ids_view(ids), cview(dy, Shape{rows, dim}), view(whole_dtable, Shape{vocab, dim}));
  ops::softmax_cross_entropy_forward(be, cview(z, Shape{rows, vocab}), ids_view(labels), view(loss, Shape{1}), rows + 2);
  ops::softmax_cross_entropy_backward(be, cview(z, Shape{rows, vocab}), ids_view(labels), view(whole_dz, Shape{rows, vocab}),
                                      rows + 2);

  Vec summed_y(whole_y.size(), 0.0);
  std::vector<Vec> stats(static_cast<std::size_t>(parts), Vec(static_cast<std::size_t>(rows * 3)));
  std::vector<Vec> part_z(static_cast<std::size_t>(parts));
  for (int t = 0; t < parts; ++t) {
    const ops::VocabPart part{t * part_rows, vocab};
    const Vec part_table(table.begin() + t * part_rows * dim, table.begin() + (t + 1) * part_rows * dim);
    Vec y(whole_y.size(), std::nan("")), dtable(part_table.size(), 0.0);
    ops::embedding_forward(be, ids_view(ids), cview(part_table, Shape{part_rows, dim}), view(y, Shape{rows, dim}), part);
    for (std::size_t i = 0; i < y.size(); ++i) summed_y[i] += y[i];
    ops::embedding_backward(be, ids_view(ids), cview(dy, Shape{rows, dim}), view(dtable, Shape{part_rows, dim}), part);
    CHECK(dtable == Vec(whole_dtable.begin() + t * part_rows * dim, whole_dtable.begin() + (t + 1) * part_rows * dim));
    Vec& zt = part_z[std::size_t(t)];
    for (index_t r = 0; r < rows; ++r)
      zt.insert(zt.end(), z.begin() + r * vocab + t * part_rows, z.begin() + r * vocab + (t + 1) * part_rows);
    ops::softmax_cross_entropy_part_stats(be, cview(zt, Shape{rows, part_rows}), ids_view(labels),
                                          view(stats[std::size_t(t)], Shape{rows, 3}), part);
  }
  CHECK(summed_y == whole_y);  // one part holds each id; the others add exact zeros

  Vec lse(static_cast<std::size_t>(rows));
  double total = 0;
  for (index_t r = 0; r < rows; ++r) {
    double max = -INFINITY, sum = 0, label = 0;
    for (const Vec& s : stats) max = std::max(max, s[std::size_t(r * 3)]);
    for (const Vec& s : stats) sum += std::exp(s[std::size_t(r * 3)] - max) * s[std::size_t(r * 3 + 1)];
    for (const Vec& s : stats) label += s[std::size_t(r * 3 + 2)];
    lse[std::size_t(r)] = max + std::log(sum);
    total += lse[std::size_t(r)] - label;
  }
  CHECK(std::abs(total / double(rows + 2) - loss[0]) <= 1e-14 * std::abs(loss[0]));
  for (int t = 0; t < parts; ++t) {
    Vec dz(std::size_t(rows * part_rows));
    ops::softmax_cross_entropy_part_backward(be, cview(part_z[std::size_t(t)], Shape{rows, part_rows}), ids_view(labels),
                                             cview(lse, Shape{rows}), view(dz, Shape{rows, part_rows}), rows + 2,
                                             ops::VocabPart{t * part_rows, vocab});
    Vec expected;
    for (index_t r = 0; r < rows; ++r)
      expected.insert(expected.end(), whole_dz.begin() + r * vocab + t * part_rows, whole_dz.begin() + r * vocab + (t + 1) * part_rows);
    CHECK(relative_error(dz, expected) <= 1e-14);
  }

  // Ids and labels are checked against the whole vocabulary; a part must fit inside it.
  Vec y(whole_y.size()), st(std::size_t(rows * 3));
  const Vec half(table.begin(), table.begin() + 6 * dim);
  const Ids too_big{0, 12, 3};
  CHECK_THROWS_WITH(ops::embedding_forward(be, ids_view(too_big), cview(half, Shape{6, dim}), view(y, Shape{3, dim}),
                                           ops::VocabPart{6, 12}),
                    Contains("embedding_forward: token id 12 at row 1") && Contains("vocabulary [0, 12)"));
  CHECK_THROWS_WITH(ops::embedding_backward(be, ids_view(Ids{1, 2, 3}), cview(dy, Shape{3, dim}), view(whole_dtable, Shape{6, dim}),
                                            ops::VocabPart{7, 12}),
                    Contains("embedding_backward: a vocabulary part of 6 entries from 7 does not fit a vocabulary of 12"));
  const Vec z6(std::size_t(3 * 6), 0.5);
  CHECK_THROWS_WITH(ops::softmax_cross_entropy_part_stats(be, cview(z6, Shape{3, 6}), ids_view(too_big), view(st, Shape{3, 3}),
                                                          ops::VocabPart{0, 12}),
                    Contains("softmax_cross_entropy_part_stats: label 12 at row 1 is outside [0, 12)"));
  CHECK_THROWS_WITH(ops::softmax_cross_entropy_part_stats(be, cview(z6, Shape{3, 6}), ids_view(too_big), view(st, Shape{3, 2}),
                                                          ops::VocabPart{0, 12}),
                    Contains("softmax_cross_entropy_part_stats") && Contains("stats"));
}

// ---------------------------------------------------------------------------------------------
// Optimizer updates, against the update rules as PyTorch documents them (torch.optim.SGD, AdamW).

namespace {

struct SgdReference {
  ops::SgdHyper h;
  Vec buffer;
  bool first = true;
  // torch.optim.SGD, dampening 0: the momentum buffer starts as the first gradient.
  void step(Vec& p, const Vec& grad, double scale) {
    if (buffer.empty()) buffer.assign(p.size(), 0);
    for (std::size_t i = 0; i < p.size(); ++i) {
      double g = grad[i] * scale;
      if (h.weight_decay != 0) g += h.weight_decay * p[i];
      if (h.momentum != 0) {
        buffer[i] = first ? g : h.momentum * buffer[i] + g;
        g = h.nesterov ? g + h.momentum * buffer[i] : buffer[i];
      }
      p[i] -= h.lr * g;
    }
    first = false;
  }
};

struct AdamWReference {
  ops::AdamWHyper h;
  Vec m, v;
  int t = 0;
  // torch.optim.AdamW (single-tensor form): decoupled decay, then the bias-corrected Adam step.
  void step(Vec& p, const Vec& grad, double scale) {
    if (m.empty()) m.assign(p.size(), 0), v.assign(p.size(), 0);
    ++t;
    const double bc1 = 1 - std::pow(h.beta1, t), bc2 = 1 - std::pow(h.beta2, t);
    for (std::size_t i = 0; i < p.size(); ++i) {
      const double g = grad[i] * scale;
      p[i] *= 1 - h.lr * h.weight_decay;
      m[i] = h.beta1 * m[i] + (1 - h.beta1) * g;
      v[i] = h.beta2 * v[i] + (1 - h.beta2) * g * g;
      const double denom = std::sqrt(v[i]) / std::sqrt(bc2) + h.eps;
      p[i] -= h.lr / bc1 * m[i] / denom;
    }
  }
};

}  // namespace

TEST_CASE("sgd_update follows torch.optim.SGD over several steps", "[cpu][host][optim]") {
  struct Case {
    double momentum, weight_decay;
    bool nesterov;
  };
  const Case c = GENERATE(Case{0.0, 0.0, false}, Case{0.0, 0.05, false}, Case{0.9, 0.0, false}, Case{0.9, 0.01, true},
                          Case{0.5, 0.1, false});
  CAPTURE(c.momentum, c.weight_decay, c.nesterov);
  const ops::SgdHyper h{0.1, c.momentum, c.weight_decay, c.nesterov};
  const double scale = 0.5;  // e.g. 1 / (microbatches) or a loss-scale undo
  Rng rng(7);
  const index_t n = 33;
  const Vec p0 = float_exact(std::size_t(n), rng);
  std::vector<Vec> grads;
  for (int step = 0; step < 5; ++step) grads.push_back(float_exact(std::size_t(n), rng));

  SgdReference ref{h, {}, true};
  Vec expected = p0;
  for (const Vec& g : grads) ref.step(expected, g, scale);
  REQUIRE(relative_error(expected, p0) > 1e-3);  // the steps did move the parameters

  auto run = [&]<class T>(backend::Host<T>& be) {
    auto p = cast_all<T>(p0);
    std::vector<T> velocity(static_cast<std::size_t>(n));
    for (const Vec& g : grads) {
      const auto gt = cast_all<T>(g);
      ops::sgd_update(be, view(p, Shape{n}), cview(gt, Shape{n}), view(velocity, Shape{n}), h, T(scale));
    }
    return as_double(p);
  };
  backend::Host<double> hd;
  backend::Host<float> hf;
  CHECK(relative_error(run(hd), expected) <= 1e-14);
  CHECK(relative_error(run(hf), expected) <= 1e-5);
}

TEST_CASE("adamw_update follows torch.optim.AdamW over several steps", "[cpu][host][optim]") {
  const ops::AdamWHyper h = GENERATE(ops::AdamWHyper{1e-2, 0.9, 0.999, 1e-8, 0.01},
                                     ops::AdamWHyper{3e-2, 0.8, 0.99, 1e-6, 0.1},
                                     ops::AdamWHyper{1e-3, 0.9, 0.95, 1e-8, 0.0});
  CAPTURE(h.lr, h.beta1, h.beta2, h.eps, h.weight_decay);
  const double scale = 0.25;
  Rng rng(11);
  const index_t n = 29;
  const Vec p0 = float_exact(std::size_t(n), rng);
  std::vector<Vec> grads;
  for (int step = 0; step < 6; ++step) grads.push_back(float_exact(std::size_t(n), rng));

  AdamWReference ref{h, {}, {}, 0};
  Vec expected = p0;
  for (const Vec& g : grads) ref.step(expected, g, scale);
  REQUIRE(relative_error(expected, p0) > 1e-3);

  auto run = [&]<class T>(backend::Host<T>& be) {
    auto p = cast_all<T>(p0);
    std::vector<T> m(static_cast<std::size_t>(n)), v(static_cast<std::size_t>(n));
    std::int64_t step = 0;
    for (const Vec& g : grads) {
      const auto gt = cast_all<T>(g);
      ops::adamw_update(be, view(p, Shape{n}), cview(gt, Shape{n}), view(m, Shape{n}), view(v, Shape{n}), h, ++step,
                        T(scale));
    }
    return as_double(p);
  };
  backend::Host<double> hd;
  backend::Host<float> hf;
  CHECK(relative_error(run(hd), expected) <= 1e-13);
  CHECK(relative_error(run(hf), expected) <= 1e-5);
}

TEST_CASE("sum_of_squares accumulates in double", "[cpu][host][optim]") {
  Rng rng(3);
  const Vec x = float_exact(1000, rng, -10, 10);
  // The documented order: element i into partial sum i % 4, then (s0 + s1) + (s2 + s3).
  double partial[4] = {0, 0, 0, 0};
  for (std::size_t i = 0; i < x.size(); ++i) partial[i % 4] += x[i] * x[i];
  const double expected = (partial[0] + partial[1]) + (partial[2] + partial[3]);
  double sequential = 0;
  for (double v : x) sequential += v * v;
  CHECK(std::abs(expected - sequential) <= 1e-12 * sequential);
  backend::Host<double> hd;
  backend::Host<float> hf;
  const auto xf = cast_all<float>(x);
  CHECK(ops::sum_of_squares(hd, cview(x, Shape{1000})) == expected);
  // float input, double accumulation: products of floats are exact in double, so the same sum.
  CHECK(ops::sum_of_squares(hf, cview(xf, Shape{1000})) == expected);
  CHECK(ops::sum_of_squares(hd, ConstView<double>{nullptr, Shape{0}}) == 0.0);
}

// ---------------------------------------------------------------------------------------------
// Bad input: every op names itself and the shapes or values involved, and writes nothing.

TEST_CASE("bad shapes throw cupipe::error naming the op and both shapes", "[cpu][host][errors]") {
  backend::Host<double> be;
  Vec a(12, 1.0), b(12, 1.0), c(12, 7.0), w(12, 1.0);

  SECTION("gemm") {
    REQUIRE_THROWS_AS(ops::gemm(be, Transpose::no, Transpose::no, 1.0, cview(a, Shape{3, 4}), cview(b, Shape{6, 2}), 0.0,
                                view(c, Shape{3, 2})),
                      cupipe::error);
    REQUIRE_THROWS_WITH(ops::gemm(be, Transpose::no, Transpose::no, 1.0, cview(a, Shape{3, 4}), cview(b, Shape{6, 2}),
                                  0.0, view(c, Shape{3, 2})),
                        Contains("gemm") && Contains("(3, 4)") && Contains("(6, 2)") &&
                            Contains("inner extents 4 and 6 must be equal"));
    REQUIRE_THROWS_WITH(ops::gemm(be, Transpose::no, Transpose::yes, 1.0, cview(a, Shape{3, 4}), cview(b, Shape{2, 4}),
                                  0.0, view(c, Shape{3, 3})),
                        Contains("gemm") && Contains("c must be (3, 2) but is (3, 3)"));
    REQUIRE_THROWS_WITH(ops::gemm(be, Transpose::no, Transpose::no, 1.0, ConstView<double>{nullptr, Shape{3, 4}},
                                  cview(b, Shape{4, 2}), 0.0, view(c, Shape{3, 2})),
                        Contains("gemm: null operand"));
    CHECK(c == Vec(12, 7.0));
  }
  SECTION("bias, activations, residual, axpy, copy") {
    REQUIRE_THROWS_WITH(ops::bias_add(be, view(c, Shape{2, 5}), cview(b, Shape{4})),
                        Contains("bias_add") && Contains("expected shape (5,) but got (4,)"));
    REQUIRE_THROWS_WITH(ops::bias_add(be, view(c, Shape{2, 5}), ConstView<double>{nullptr, Shape{5}}),
                        Contains("bias_add: bias of shape (5,) is a null pointer"));
    REQUIRE_THROWS_WITH(ops::bias_backward(be, cview(a, Shape{2, 5}), view(c, Shape{6})),
                        Contains("bias_backward") && Contains("(5,)") && Contains("(6,)"));
    REQUIRE_THROWS_WITH(ops::relu_forward(be, cview(a, Shape{2, 3}), view(c, Shape{3, 2})),
                        Contains("relu_forward") && Contains("(2, 3)") && Contains("(3, 2)"));
    REQUIRE_THROWS_WITH(ops::relu_backward(be, cview(a, Shape{2, 3}), cview(b, Shape{3, 2}), view(c, Shape{2, 3})),
                        Contains("relu_backward") && Contains("(2, 3)") && Contains("(3, 2)"));
    REQUIRE_THROWS_WITH(ops::gelu_forward(be, cview(a, Shape{4, 3}), view(c, Shape{12})),
                        Contains("gelu_forward") && Contains("(4, 3)") && Contains("(12,)"));
    REQUIRE_THROWS_WITH(ops::gelu_backward(be, cview(a, Shape{4, 3}), cview(b, Shape{4, 3}), view(c, Shape{3, 4})),
                        Contains("gelu_backward") && Contains("(4, 3)") && Contains("(3, 4)"));
    REQUIRE_THROWS_WITH(ops::residual_add(be, cview(a, Shape{2, 6}), cview(b, Shape{6, 2}), view(c, Shape{2, 6})),
                        Contains("residual_add") && Contains("(2, 6)") && Contains("(6, 2)"));
    REQUIRE_THROWS_WITH(ops::axpy(be, 2.0, cview(a, Shape{12}), view(c, Shape{11})),
                        Contains("axpy") && Contains("(12,)") && Contains("(11,)"));
    REQUIRE_THROWS_WITH(ops::copy(be, cview(a, Shape{12}), view(c, Shape{3, 4})),
                        Contains("copy") && Contains("(12,)") && Contains("(3, 4)"));
    CHECK(c == Vec(12, 7.0));
  }
  SECTION("layernorm") {
    Vec mean(3), rstd(3);
    REQUIRE_THROWS_WITH(ops::layernorm_forward(be, cview(a, Shape{3, 4}), cview(w, Shape{5}), cview(b, Shape{4}),
                                               view(c, Shape{3, 4}), view(mean, Shape{3}), view(rstd, Shape{3}), 1e-5),
                        Contains("layernorm_forward") && Contains("gamma") && Contains("(4,)") && Contains("(5,)"));
    REQUIRE_THROWS_WITH(ops::layernorm_forward(be, cview(a, Shape{3, 4}), cview(w, Shape{4}), cview(b, Shape{4}),
                                               view(c, Shape{3, 4}), view(mean, Shape{2}), view(rstd, Shape{3}), 1e-5),
                        Contains("layernorm_forward") && Contains("mean") && Contains("(3,)") && Contains("(2,)"));
    REQUIRE_THROWS_WITH(ops::layernorm_backward_input(be, cview(a, Shape{3, 4}), cview(w, Shape{4}),
                                                      cview(mean, Shape{3}), cview(rstd, Shape{3}),
                                                      cview(b, Shape{4, 3}), view(c, Shape{3, 4})),
                        Contains("layernorm_backward_input") && Contains("(3, 4)") && Contains("(4, 3)"));
    REQUIRE_THROWS_WITH(ops::layernorm_backward_weight(be, cview(a, Shape{3, 4}), cview(mean, Shape{3}),
                                                       cview(rstd, Shape{3}), cview(b, Shape{3, 4}),
                                                       view(c, Shape{4}), view(w, Shape{3})),
                        Contains("layernorm_backward_weight") && Contains("dbeta") && Contains("(4,)") &&
                            Contains("(3,)"));
    CHECK(c == Vec(12, 7.0));
  }
  SECTION("optimizers") {
    Vec m(12), v(12);
    REQUIRE_THROWS_WITH(ops::sgd_update(be, view(c, Shape{12}), cview(a, Shape{11}), view(m, Shape{12}),
                                        ops::SgdHyper{}, 1.0),
                        Contains("sgd_update") && Contains("(12,)") && Contains("(11,)"));
    REQUIRE_THROWS_WITH(ops::adamw_update(be, view(c, Shape{3, 4}), cview(a, Shape{3, 4}), view(m, Shape{4, 3}),
                                          view(v, Shape{3, 4}), ops::AdamWHyper{}, 1, 1.0),
                        Contains("adamw_update") && Contains("(3, 4)") && Contains("(4, 3)"));
    REQUIRE_THROWS_WITH(ops::adamw_update(be, view(c, Shape{12}), cview(a, Shape{12}), view(m, Shape{12}),
                                          view(v, Shape{12}), ops::AdamWHyper{}, 0, 1.0),
                        Contains("adamw_update: step counts from 1, got 0"));
    CHECK(c == Vec(12, 7.0));
  }
}

TEST_CASE("labels and token ids out of range throw cupipe::error naming the op and the value", "[cpu][host][errors]") {
  backend::Host<double> be;
  Vec logits(15, 0.25), dlogits(15, 7.0), loss(1, 7.0);
  const Shape s{3, 5};

  SECTION("softmax cross-entropy labels") {
    const Ids too_big{0, 5, 1}, negative{0, 1, -1}, too_few{0, 1};
    REQUIRE_THROWS_AS(ops::softmax_cross_entropy_forward(be, cview(logits, s), ids_view(too_big), view(loss, Shape{1}), 3),
                      cupipe::error);
    REQUIRE_THROWS_WITH(
        ops::softmax_cross_entropy_forward(be, cview(logits, s), ids_view(too_big), view(loss, Shape{1}), 3),
        Contains("softmax_cross_entropy_forward") && Contains("label 5 at row 1") && Contains("[0, 5)") &&
            Contains("(3, 5)"));
    REQUIRE_THROWS_WITH(
        ops::softmax_cross_entropy_backward(be, cview(logits, s), ids_view(negative), view(dlogits, s), 3),
        Contains("softmax_cross_entropy_backward") && Contains("label -1 at row 2") && Contains("(3, 5)"));
    REQUIRE_THROWS_WITH(
        ops::softmax_cross_entropy_forward(be, cview(logits, s), ids_view(too_few), view(loss, Shape{1}), 3),
        Contains("softmax_cross_entropy_forward") && Contains("labels expected shape (3,) but got (2,)"));
    const Ids fine{0, 1, 2};
    REQUIRE_THROWS_WITH(ops::softmax_cross_entropy_forward(be, cview(logits, s), ids_view(fine), view(loss, Shape{1}), 0),
                        Contains("normalizer must be positive, got 0"));
    REQUIRE_THROWS_WITH(
        ops::softmax_cross_entropy_backward(be, cview(logits, s), ids_view(fine), view(dlogits, Shape{5, 3}), 3),
        Contains("softmax_cross_entropy_backward") && Contains("(3, 5)") && Contains("(5, 3)"));
    CHECK(dlogits == Vec(15, 7.0));
    CHECK(loss[0] == 7.0);
  }
  SECTION("embedding token ids") {
    Vec table(20, 1.0), y(12, 7.0), dtable(20, 7.0);
    const Ids too_big{1, 10, 3}, negative{-4, 1, 2};
    REQUIRE_THROWS_AS(ops::embedding_forward(be, ids_view(too_big), cview(table, Shape{10, 2}), view(y, Shape{3, 2})),
                      cupipe::error);
    REQUIRE_THROWS_WITH(ops::embedding_forward(be, ids_view(too_big), cview(table, Shape{10, 2}), view(y, Shape{3, 2})),
                        Contains("embedding_forward: token id 10 at row 1") && Contains("vocabulary [0, 10)"));
    REQUIRE_THROWS_WITH(ops::embedding_backward(be, ids_view(negative), cview(y, Shape{3, 2}), view(dtable, Shape{10, 2})),
                        Contains("embedding_backward: token id -4 at row 0") && Contains("[0, 10)"));
    REQUIRE_THROWS_WITH(ops::embedding_forward(be, ids_view(Ids{1, 2, 3}), cview(table, Shape{10, 2}), view(y, Shape{3, 4})),
                        Contains("embedding_forward") && Contains("(3, 2)") && Contains("(3, 4)"));
    CHECK(y == Vec(12, 7.0));
    CHECK(dtable == Vec(20, 7.0));
  }
}

TEST_CASE("a null input throws cupipe::error naming the op, before anything is written", "[cpu][host][errors]") {
  backend::Host<double> be;
  const ConstView<double> null23{nullptr, Shape{2, 3}}, null3{nullptr, Shape{3}};
  const ConstView<std::int32_t> null_ids{nullptr, Shape{2}};
  Vec a(6, 1.0), out(6, 7.0), m(6), v(6), stats(2);
  const Ids ids{0, 1};
  const Shape s{2, 3};
  // (A macro: Catch's combined matchers keep pointers to their parts, so they cannot be returned.)
#define NULL_NAMED(op) Contains(op) && Contains("is a null pointer")
  REQUIRE_THROWS_WITH(ops::bias_add(be, TensorView<double>{nullptr, s}, cview(a, Shape{3})), NULL_NAMED("bias_add"));
  REQUIRE_THROWS_WITH(ops::bias_backward(be, null23, view(out, Shape{3})), NULL_NAMED("bias_backward"));
  REQUIRE_THROWS_WITH(ops::relu_forward(be, null23, view(out, s)), NULL_NAMED("relu_forward"));
  REQUIRE_THROWS_WITH(ops::relu_backward(be, null23, cview(a, s), view(out, s)), NULL_NAMED("relu_backward"));
  REQUIRE_THROWS_WITH(ops::gelu_forward(be, null23, view(out, s)), NULL_NAMED("gelu_forward"));
  REQUIRE_THROWS_WITH(ops::gelu_backward(be, null23, cview(a, s), view(out, s)), NULL_NAMED("gelu_backward"));
  REQUIRE_THROWS_WITH(ops::residual_add(be, null23, cview(a, s), view(out, s)), NULL_NAMED("residual_add"));
  REQUIRE_THROWS_WITH(ops::axpy(be, 1.0, null23, view(out, s)), NULL_NAMED("axpy"));
  REQUIRE_THROWS_WITH(ops::copy(be, null23, view(out, s)), NULL_NAMED("copy"));
  REQUIRE_THROWS_WITH(ops::fill(be, TensorView<double>{nullptr, s}, 1.0), NULL_NAMED("fill"));
  REQUIRE_THROWS_WITH(ops::sum_of_squares(be, null23), NULL_NAMED("sum_of_squares"));
  REQUIRE_THROWS_WITH(ops::layernorm_forward(be, null23, cview(a, Shape{3}), cview(a, Shape{3}), view(out, s),
                                             view(stats, Shape{2}), view(m, Shape{2}), 1e-5),
                      NULL_NAMED("layernorm_forward"));
  REQUIRE_THROWS_WITH(ops::layernorm_backward_input(be, null23, cview(a, Shape{3}), cview(a, Shape{2}),
                                                    cview(a, Shape{2}), cview(a, s), view(out, s)),
                      NULL_NAMED("layernorm_backward_input"));
  REQUIRE_THROWS_WITH(ops::layernorm_backward_weight(be, null23, cview(a, Shape{2}), cview(a, Shape{2}), cview(a, s),
                                                     view(out, Shape{3}), view(m, Shape{3})),
                      NULL_NAMED("layernorm_backward_weight"));
  Vec loss(1, 7.0);
  REQUIRE_THROWS_WITH(ops::softmax_cross_entropy_forward(be, null23, ids_view(ids), view(loss, Shape{1}), 2),
                      NULL_NAMED("softmax_cross_entropy_forward"));
  REQUIRE_THROWS_WITH(ops::softmax_cross_entropy_backward(be, null23, ids_view(ids), view(out, s), 2),
                      NULL_NAMED("softmax_cross_entropy_backward"));
  REQUIRE_THROWS_WITH(ops::embedding_forward(be, null_ids, cview(a, s), view(out, s)), NULL_NAMED("embedding_forward"));
  REQUIRE_THROWS_WITH(ops::embedding_forward(be, ids_view(ids), null23, view(out, s)), NULL_NAMED("embedding_forward"));
  REQUIRE_THROWS_WITH(ops::embedding_backward(be, ids_view(ids), cview(a, s), TensorView<double>{nullptr, s}),
                      NULL_NAMED("embedding_backward"));
  REQUIRE_THROWS_WITH(ops::sgd_update(be, TensorView<double>{nullptr, Shape{6}}, cview(a, Shape{6}), view(m, Shape{6}),
                                      ops::SgdHyper{}, 1.0),
                      NULL_NAMED("sgd_update"));
  REQUIRE_THROWS_WITH(ops::adamw_update(be, TensorView<double>{nullptr, Shape{6}}, cview(a, Shape{6}), view(m, Shape{6}),
                                        view(v, Shape{6}), ops::AdamWHyper{}, 1, 1.0),
                      NULL_NAMED("adamw_update"));
  CHECK(out == Vec(6, 7.0));
  CHECK(loss[0] == 7.0);
  // An empty view may be null: nothing to read.
  CHECK(ops::sum_of_squares(be, ConstView<double>{nullptr, Shape{0, 3}}) == 0.0);
#undef NULL_NAMED
}

TEST_CASE("host backend: under the poison every new buffer starts as 0xFF bytes, a reused one too",
          "[cpu][host][memory]") {
  struct Restore {
    bool was = backend::host_poison();
    ~Restore() { backend::set_host_poison(was); }
  } restore;
  backend::Host<float> be;
  backend::set_host_poison(true);
  // Large enough for HostBlockCache (a freed block waits there and comes back), and small.
  for (const index_t count : {index_t(HostBlockCache::smallest / sizeof(float)) + 3, index_t(5)}) {
    CAPTURE(count);
    for (int round = 0; round < 2; ++round) {
      auto a = be.allocate<float>(count, MemoryTag::activations);
      for (index_t i = 0; i < count; ++i) REQUIRE(std::isnan(a[i]));
      for (index_t i = 0; i < count; ++i) a[i] = 1.0f;  // what the next round must not see
    }
    auto ids = be.allocate<std::int32_t>(count, MemoryTag::workspace);
    for (index_t i = 0; i < count; ++i) REQUIRE(ids[i] == -1);
    auto wide = be.allocate<double>(count, MemoryTag::workspace);
    for (index_t i = 0; i < count; ++i) REQUIRE(std::isnan(wide[i]));
  }
  // Accounted as before.
  const std::int64_t before = be.memory.in_use(MemoryTag::activations);
  {
    auto a = be.allocate<float>(10, MemoryTag::activations);
    CHECK(be.memory.in_use(MemoryTag::activations) == before + std::int64_t(10 * sizeof(float)));
  }
  CHECK(be.memory.in_use(MemoryTag::activations) == before);
}

TEST_CASE("host backend: CUPIPE_HOST_POISON is read once and a bad value is refused", "[cpu][host][memory][errors]") {
  struct Restore {
    bool was = backend::host_poison();
    ~Restore() {
      backend::set_host_poison(was);
      ::setenv("CUPIPE_HOST_POISON", was ? "1" : "0", 1);
    }
  } restore;
  const auto read = [](const char* value) {
    if (value) ::setenv("CUPIPE_HOST_POISON", value, 1);
    else ::unsetenv("CUPIPE_HOST_POISON");
    backend::detail::host_poison_state().store(-1);
    return backend::host_poison();
  };
  CHECK(read("1"));
  CHECK_FALSE(read("0"));
  CHECK_FALSE(read(nullptr));
  CHECK_FALSE(read(""));
  CHECK_THROWS_WITH(read("yes"), Contains("CUPIPE_HOST_POISON=yes: expected 1"));
  CHECK_THROWS_WITH(backend::host_poison(), Contains("CUPIPE_HOST_POISON=yes"));  // every call, not once
  backend::set_host_poison(true);  // set_host_poison wins over the environment
  CHECK(backend::host_poison());
}
