// SPDX-License-Identifier: Apache-2.0
// Packed sequences (core/documents.hpp): the borders read from token ids, their checks and their
// cumulative lengths; the attention and the position embedding with document borders against
// finite differences in float64; and a GPT body on packed rows against the same documents run one
// per row (each at the start of its own sequence, the rest padding whose output gradient is 0),
// to 1e-12 relative: outputs, input gradients and every parameter's gradient.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <utility>
#include <span>
#include <string>
#include <vector>

#include "cupipe/backend/host/ops.hpp"
#include "cupipe/core/documents.hpp"
#include "cupipe/gpt/model.hpp"
#include "cupipe/layers/layers.hpp"
#include "gradcheck.hpp"

using namespace cupipe;
using cupipe::testing::dot;
using cupipe::testing::numeric_gradient;
using cupipe::testing::random_params;
using cupipe::testing::relative_error;
using cupipe::testing::uniform_ints;
using cupipe::testing::uniform_values;

namespace {

using Vec = std::vector<double>;
using Ids = std::vector<std::int32_t>;

/// A LayerSeq's forward and fused backward on `be` (its documents as set): the output, the
/// parameters' gradient and the input's (values input only).
struct Run {
  Vec out, grads, dx;
};
template <class Seq, class Input>
Run run(backend::Host<double>& be, const Vec& params, Input x, const Vec& dy) {
  const index_t rows = x.rows();
  Vec record(std::size_t(Seq::record_elements(rows)));
  Seq::forward(be, params.data(), x, record.data());
  const auto y = Seq::output(record.data(), rows);
  Run r;
  r.out.assign(y.data(), y.data() + y.numel());
  r.grads.assign(params.size(), 0.0);
  Vec grad_record(std::size_t(std::max<index_t>(Seq::grad_record_elements(rows), 1)));
  r.dx.assign(std::size_t(rows * Seq::in_features), 0.0);
  TensorView<double> dx_view{};
  if constexpr (!Seq::takes_token_ids) dx_view = TensorView<double>{r.dx.data(), Shape{rows, Seq::in_features}};
  Seq::backward(be, params.data(), x, record.data(), ConstView<double>{dy.data(), Shape{rows, Seq::out_features}}, dx_view,
                r.grads.data(), grad_record.data(), true);
  return r;
}

/// d sum(r * output) / d (parameters, values input) of Seq with document borders `starts`, against
/// central differences.
template <class Seq>
void check_gradients_with_documents(std::uint64_t seed, const Ids& starts) {
  Rng rng(seed);
  backend::Host<double> be;
  const auto rows = index_t(starts.size());
  be.documents = {starts.data(), rows};
  Vec params = random_params<Seq>(seed, rng);
  Vec values;
  Ids ids;
  if constexpr (Seq::takes_token_ids) ids = uniform_ints(std::size_t(rows), rng, Seq::first_layer::vocabulary);
  else values = uniform_values(std::size_t(rows * Seq::in_features), rng);
  const auto input = [&] {
    if constexpr (Seq::takes_token_ids) return ConstView<std::int32_t>{ids.data(), Shape{rows, 1}};
    else return ConstView<double>{values.data(), Shape{rows, Seq::in_features}};
  };
  const Vec r = uniform_values(std::size_t(rows * Seq::out_features), rng);
  const auto loss = [&] { return dot(r, std::span<const double>(run<Seq>(be, params, input(), r).out)); };
  const auto analytic = run<Seq>(be, params, input(), r);
  CAPTURE(Seq::describe(), seed);
  const Vec numeric = numeric_gradient(std::span<double>(params.data(), std::size_t(Seq::param_count)), loss);
  CHECK(relative_error(Vec(analytic.grads.begin(), analytic.grads.begin() + Seq::param_count), numeric) <= 1e-6);
  if constexpr (!Seq::takes_token_ids) CHECK(relative_error(analytic.dx, numeric_gradient(values, loss)) <= 1e-6);
}

/// The largest |a - b| over max |b| of the rows `rows` (each `width` values) of a and of b's
/// `rows_b`: the same documents' rows side by side.
double rows_error(const Vec& a, const std::vector<index_t>& rows_a, const Vec& b, const std::vector<index_t>& rows_b, index_t width) {
  double worst = 0, scale = 1e-300;
  for (std::size_t i = 0; i < rows_a.size(); ++i)
    for (index_t c = 0; c < width; ++c) {
      const double x = a[std::size_t(rows_a[i] * width + c)], y = b[std::size_t(rows_b[i] * width + c)];
      worst = std::max(worst, std::abs(x - y));
      scale = std::max(scale, std::abs(y));
    }
  return worst / scale;
}

}  // namespace

TEST_CASE("Document borders from token ids, their checks and cumulative lengths", "[cpu][layers][documents]") {
  // Two sequences of 6; token 9 begins a document.
  const Ids ids{4, 9, 5, 5, 9, 1, /**/ 9, 2, 3, 9, 9, 7};
  const Ids starts = document_starts(ids, 6, 9);
  CHECK(starts == Ids{0, 1, 1, 1, 4, 4, /**/ 0, 0, 0, 3, 4, 4});
  const DocumentStarts d{starts.data(), 12};
  CHECK(cumulative_lengths(d, 12, 6) == Ids{0, 1, 4, 6, 9, 10, 12});
  CHECK(cumulative_lengths(DocumentStarts{}, 12, 6) == Ids{0, 6, 12});
  std::vector<std::pair<index_t, index_t>> seen;
  d.each_document(6, 6, [&](index_t first, index_t length) { seen.emplace_back(first, length); });
  CHECK(seen == std::vector<std::pair<index_t, index_t>>{{6, 3}, {9, 1}, {10, 2}});
  CHECK(d.position(3, 6) == 2);
  CHECK(d.position(11, 6) == 1);
  CHECK(d.slice(6, 6).start[3] == 3);
  CHECK_THROWS_WITH(d.slice(6, 7), Catch::Contains("rows [6, 13) are outside the 12 rows given"));
  CHECK_THROWS_WITH(document_starts(ids, 5, 9), Catch::Contains("12 token ids are not whole sequences of 5"));
  CHECK_NOTHROW(check_documents(d, 12, 6, "test"));
  CHECK_THROWS_WITH(check_documents(d, 6, 6, "test"), Catch::Contains("document starts for 12 rows, but the batch has 6"));
  Ids bad = starts;
  bad[6] = 2;  // a sequence's first token starts its document
  CHECK_THROWS_WITH(check_documents({bad.data(), 12}, 12, 6, "test"),
                    Catch::Contains("row 6 (token 0 of sequence 1) has document start 2"));
  bad = starts;
  bad[3] = 2;  // neither the previous start (1) nor its own index (3)
  CHECK_THROWS_WITH(check_documents({bad.data(), 12}, 12, 6, "test"), Catch::Contains("row 3 (token 3 of sequence 0)"));
}

TEST_CASE("Attention and position embedding with document borders: gradients match finite differences",
          "[cpu][layers][gradcheck][documents]") {
  const auto seed = std::uint64_t(GENERATE(take(2, random(1, 1000000))));
  // Two sequences of 6: documents of 3, 2 and 1 tokens; then 1 and 5.
  const Ids starts{0, 0, 0, 3, 3, 5, /**/ 0, 1, 1, 1, 1, 1};
  check_gradients_with_documents<LayerSeq<0, 8, CausalSelfAttention<8, 2, 6>>>(seed, starts);
  check_gradients_with_documents<LayerSeq<0, 1, TokenPositionEmbedding<11, 6, 8>>>(seed, starts);
  constexpr gpt::Config six{11, 6, 2, 2, 8};
  check_gradients_with_documents<gpt::Model<six>::body>(seed, starts);
}

TEST_CASE("A GPT body on packed rows equals the same documents run one per row, to 1e-12", "[cpu][layers][documents][gpt]") {
  constexpr gpt::Config config{13, 8, 2, 2, 8};
  using Body = gpt::Model<config>::body;
  constexpr index_t T = config.context, V = config.vocab;
  Rng rng(41);
  const Vec params = random_params<Body>(41, rng);
  // Two packed rows: documents of 3 and 5 tokens, then 2, 4 and 2.
  const std::vector<index_t> lengths{3, 5, 2, 4, 2};
  const Ids starts{0, 0, 0, 3, 3, 3, 3, 3, /**/ 0, 0, 2, 2, 2, 2, 6, 6};
  const Ids packed_ids = uniform_ints(16, rng, V);
  const Vec packed_dy = uniform_values(std::size_t(16 * V), rng);
  // One document per row, at its start, the rest padding (token 0, output gradient 0).
  const auto docs = index_t(lengths.size());
  Ids padded_ids(std::size_t(docs * T), 0);
  Vec padded_dy(std::size_t(docs * T * V), 0.0);
  std::vector<index_t> packed_rows, padded_rows;
  for (index_t d = 0, at = 0; d < docs; at += lengths[std::size_t(d)], ++d)
    for (index_t t = 0; t < lengths[std::size_t(d)]; ++t) {
      packed_rows.push_back(at + t);
      padded_rows.push_back(d * T + t);
      padded_ids[std::size_t(d * T + t)] = packed_ids[std::size_t(at + t)];
      for (index_t c = 0; c < V; ++c) padded_dy[std::size_t((d * T + t) * V + c)] = packed_dy[std::size_t((at + t) * V + c)];
    }
  backend::Host<double> be;
  be.documents = {starts.data(), 16};
  const auto packed = run<Body>(be, params, ConstView<std::int32_t>{packed_ids.data(), Shape{16, 1}}, packed_dy);
  be.documents = {};
  const auto apart = run<Body>(be, params, ConstView<std::int32_t>{padded_ids.data(), Shape{docs * T, 1}}, padded_dy);
  CHECK(rows_error(packed.out, packed_rows, apart.out, padded_rows, V) <= 1e-12);
  CHECK(relative_error(packed.grads, apart.grads) <= 1e-12);
  // Without the borders the packed rows attend across documents: the outputs are not the same.
  const auto crossing = run<Body>(be, params, ConstView<std::int32_t>{packed_ids.data(), Shape{16, 1}}, packed_dy);
  CHECK(rows_error(crossing.out, packed_rows, apart.out, padded_rows, V) > 1e-3);
  // A microbatch whose borders are another's size is refused, naming the layer.
  be.documents = {starts.data(), 8};
  CHECK_THROWS_WITH(run<Body>(be, params, ConstView<std::int32_t>{packed_ids.data(), Shape{16, 1}}, packed_dy),
                    Catch::Contains("document starts for 8 rows, but the batch has 16"));
}
