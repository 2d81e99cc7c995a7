// SPDX-License-Identifier: Apache-2.0
// Layers and whole models against central finite differences in float64: every layer alone, and
// Sequential models through LayerSeq (input gradient too) and through Network (the loss included).
// Also: the zero-bubble split (B then W) reproduces the fused backward bit for bit, and float and
// double Networks agree.
#include <catch2/catch.hpp>

#include <cstdint>
#include <cstring>
#include <span>
#include <vector>

#include "cupipe/backend/host/ops.hpp"
#include "cupipe/layers/layers.hpp"
#include "gradcheck.hpp"

using namespace cupipe;
using cupipe::testing::cast_all;
using cupipe::testing::dot;
using cupipe::testing::numeric_gradient;
using cupipe::testing::relative_error;
using cupipe::testing::uniform_ints;
using cupipe::testing::uniform_values;

namespace {

constexpr double grad_tolerance = 1e-6;
using Vec = std::vector<double>;
using Ids = std::vector<std::int32_t>;

/// The input of a sequence: int32 token ids (rows, 1) for an Embedding, else values (rows, in).
template <class Seq>
struct Input {
  Vec values;
  Ids ids;
  index_t rows = 0;

  Input(index_t n, Rng& rng, bool away_from_zero = false) : rows(n) {
    if constexpr (Seq::takes_token_ids) {
      using First = typename Seq::first_layer;
      ids = uniform_ints(std::size_t(n), rng, First::params(1)[0].rows);  // the vocabulary
    } else {
      values = away_from_zero ? cupipe::testing::values_away_from_zero(std::size_t(n * Seq::in_features), rng)
                              : uniform_values(std::size_t(n * Seq::in_features), rng);
    }
  }
  auto view() const {
    if constexpr (Seq::takes_token_ids) return ConstView<std::int32_t>{ids.data(), Shape{rows, 1}};
    else return ConstView<double>{values.data(), Shape{rows, Seq::in_features}};
  }
};

/// Random parameters: the layer's own init, shifted, so that no gradient is special (LayerNorm's
/// gamma of ones and beta of zeros would hide a swapped dgamma and dbeta).
template <class Seq>
Vec random_params(std::uint64_t seed, Rng& rng) {
  Vec p(std::size_t(std::max<index_t>(Seq::param_count, 1)));  // never null, even with no parameters
  Seq::init(std::span<double>(p.data(), std::size_t(Seq::param_count)), seed);
  for (double& x : p) x += rng.uniform(-0.5, 0.5);
  return p;
}

/// Checks d sum(r * output) / d (parameters, input) of a LayerSeq against finite differences, with
/// the fused backward (with_weight_grads = true) and a non-empty dx.
template <class Seq>
void check_sequence_gradients(std::uint64_t seed, index_t rows, bool away_from_zero = false) {
  Rng rng(seed);
  backend::Host<double> be;
  Vec params = random_params<Seq>(seed, rng);
  Input<Seq> input(rows, rng, away_from_zero);
  const Vec r = uniform_values(std::size_t(rows * Seq::out_features), rng);
  Vec record(std::size_t(Seq::record_elements(rows)));
  auto loss = [&] {
    Seq::forward(be, params.data(), input.view(), record.data());
    const auto out = Seq::output(record.data(), rows);
    return dot(r, std::span<const double>(out.data(), std::size_t(out.numel())));
  };

  loss();
  Vec grads(params.size()), grad_record(std::size_t(std::max<index_t>(Seq::grad_record_elements(rows), 1)));
  Vec dx(std::size_t(rows * Seq::in_features));
  TensorView<double> dx_view{};
  if constexpr (!Seq::takes_token_ids) dx_view = TensorView<double>{dx.data(), Shape{rows, Seq::in_features}};
  Seq::backward(be, params.data(), input.view(), record.data(), ConstView<double>{r.data(), Shape{rows, Seq::out_features}},
                dx_view, grads.data(), grad_record.data(), true);

  CAPTURE(Seq::describe(), seed, rows);
  if constexpr (Seq::param_count > 0) {
    const Vec numeric = numeric_gradient(std::span<double>(params.data(), std::size_t(Seq::param_count)), loss);
    CHECK(relative_error(Vec(grads.begin(), grads.begin() + Seq::param_count), numeric) <= grad_tolerance);
  }
  if constexpr (!Seq::takes_token_ids) CHECK(relative_error(dx, numeric_gradient(input.values, loss)) <= grad_tolerance);
}

using Mlp = Sequential<Linear<5, 7>, GELU, LayerNorm<7>, ReLU, Linear<7, 3>>;
using TokenModel = Sequential<Embedding<11, 6>, LayerNorm<6>, GELU, Linear<6, 4>, SoftmaxCrossEntropy<4>>;

}  // namespace

TEST_CASE("every layer alone: parameter and input gradients match finite differences", "[cpu][layers][gradcheck]") {
  const auto seed = std::uint64_t(GENERATE(take(3, random(1, 1000000))));
  const index_t rows = 1 + index_t(seed % 5);
  check_sequence_gradients<LayerSeq<0, 5, Linear<5, 7>>>(seed, rows);
  check_sequence_gradients<LayerSeq<0, 6, ReLU>>(seed, rows, /*away_from_zero=*/true);
  check_sequence_gradients<LayerSeq<0, 6, GELU>>(seed, rows);
  check_sequence_gradients<LayerSeq<0, 7, LayerNorm<7>>>(seed, rows);
  check_sequence_gradients<LayerSeq<0, 1, Embedding<11, 6>>>(seed, rows + 6);  // ids repeat
}

TEST_CASE("SoftmaxCrossEntropy layer: gradient matches finite differences, normalizer != rows",
          "[cpu][layers][gradcheck]") {
  const auto seed = std::uint64_t(GENERATE(take(3, random(1, 1000000))));
  Rng rng(seed);
  using Loss = SoftmaxCrossEntropy<5>;
  const index_t rows = 1 + index_t(rng.below(6)), normalizer = rows + 3;
  backend::Host<double> be;
  Vec z = uniform_values(std::size_t(rows * 5), rng, -3, 3), value(1), dz(z.size());
  const Ids labels = uniform_ints(std::size_t(rows), rng, 5);
  const ConstView<std::int32_t> lv{labels.data(), Shape{rows}};
  auto loss = [&] {
    Loss::forward(be, ConstView<double>{z.data(), Shape{rows, 5}}, lv, TensorView<double>{value.data(), Shape{1}},
                  normalizer);
    return value[0];
  };
  Loss::backward(be, ConstView<double>{z.data(), Shape{rows, 5}}, lv, TensorView<double>{dz.data(), Shape{rows, 5}},
                 normalizer);
  CHECK(relative_error(dz, numeric_gradient(z, loss)) <= grad_tolerance);
}

TEST_CASE("whole models through LayerSeq: parameter and input gradients match finite differences",
          "[cpu][layers][gradcheck]") {
  const auto seed = std::uint64_t(GENERATE(take(3, random(1, 1000000))));
  check_sequence_gradients<Mlp::body>(seed, 4);
  check_sequence_gradients<TokenModel::body>(seed, 9);
  // A pipeline stage in the middle of a model: layers numbered from 2.
  check_sequence_gradients<LayerSeq<2, 7, LayerNorm<7>, ReLU, Linear<7, 3>>>(seed, 3);
}

namespace {

/// d loss / d parameters of a Network (its forward_backward) against finite differences of the loss.
template <class Model>
void check_network_gradients(std::uint64_t seed, index_t rows, index_t normalizer) {
  Network<Model, backend::Host<double>> net(seed);
  Rng rng(seed + 1);
  using Body = typename Model::body;
  Input<Body> input(rows, rng);
  const Ids labels = uniform_ints(std::size_t(rows), rng, Body::out_features);
  const ConstView<std::int32_t> lv{labels.data(), Shape{rows}};

  Vec params = net.parameters();
  for (double& p : params) p += rng.uniform(-0.3, 0.3);
  net.set_parameters(params);
  net.zero_grad();
  const double loss0 = net.forward_backward(input.view(), lv, normalizer);
  const Vec analytic = net.gradients();
  const Vec numeric = numeric_gradient(params, [&] {
    net.set_parameters(params);
    return double(net.forward_backward(input.view(), lv, normalizer));
  });
  CAPTURE(Model::body::describe(), seed, rows, normalizer, loss0);
  CHECK(std::isfinite(loss0));
  CHECK(relative_error(analytic, numeric) <= grad_tolerance);
}

}  // namespace

TEST_CASE("Network forward_backward: loss gradient w.r.t. every parameter matches finite differences",
          "[cpu][layers][network][gradcheck]") {
  const auto seed = std::uint64_t(GENERATE(take(3, random(1, 1000000))));
  check_network_gradients<Mlp>(seed, 4, 0);            // normalizer = rows
  check_network_gradients<Mlp>(seed, 3, 8);            // a microbatch of a batch of 8
  check_network_gradients<TokenModel>(seed, 10, 0);    // Embedding first, explicit loss layer
}

namespace {

/// Runs backward fused (B with weight gradients) and split (B, then W), from the same non-zero
/// starting gradients, and requires identical bits.
template <class Seq>
void check_split_backward_is_bitwise_fused(std::uint64_t seed, index_t rows) {
  Rng rng(seed);
  backend::Host<double> be;
  Vec params = random_params<Seq>(seed, rng);
  Input<Seq> input(rows, rng);
  const Vec dy = uniform_values(std::size_t(rows * Seq::out_features), rng);
  const ConstView<double> dyv{dy.data(), Shape{rows, Seq::out_features}};
  Vec record(std::size_t(Seq::record_elements(rows)));
  Seq::forward(be, params.data(), input.view(), record.data());

  const Vec start = uniform_values(params.size(), rng);  // gradients accumulated by earlier microbatches
  const std::size_t grad_record_size = std::size_t(std::max<index_t>(Seq::grad_record_elements(rows), 1));
  auto dx_view = [&](Vec& dx) {
    if constexpr (Seq::takes_token_ids) return TensorView<double>{};
    else return TensorView<double>{dx.data(), Shape{rows, Seq::in_features}};
  };

  Vec fused = start, fused_record(grad_record_size), fused_dx(std::size_t(rows * Seq::in_features));
  Seq::backward(be, params.data(), input.view(), record.data(), dyv, dx_view(fused_dx), fused.data(),
                fused_record.data(), true);

  Vec split = start, split_record(grad_record_size), split_dx(std::size_t(rows * Seq::in_features));
  Seq::backward(be, params.data(), input.view(), record.data(), dyv, dx_view(split_dx), split.data(),
                split_record.data(), false);
  CHECK(split == start);  // B alone leaves the weight gradients to W
  Seq::backward_weight(be, input.view(), record.data(), dyv, split_record.data(), split.data());

  CAPTURE(Seq::describe(), seed);
  CHECK(split != start);
  CHECK(std::memcmp(split.data(), fused.data(), split.size() * sizeof(double)) == 0);
  CHECK(std::memcmp(split_dx.data(), fused_dx.data(), split_dx.size() * sizeof(double)) == 0);
  CHECK(std::memcmp(split_record.data(), fused_record.data(), split_record.size() * sizeof(double)) == 0);
}

}  // namespace

TEST_CASE("zero-bubble split: backward without weight grads, then backward_weight, equals fused, bitwise",
          "[cpu][layers][zero_bubble]") {
  const auto seed = std::uint64_t(GENERATE(take(3, random(1, 1000000))));
  check_split_backward_is_bitwise_fused<Mlp::body>(seed, 5);
  check_split_backward_is_bitwise_fused<TokenModel::body>(seed, 7);
  check_split_backward_is_bitwise_fused<LayerSeq<2, 7, LayerNorm<7>, ReLU, Linear<7, 3>>>(seed, 4);
  check_split_backward_is_bitwise_fused<LayerSeq<0, 5, Linear<5, 7>>>(seed, 3);  // one layer: no grad record
}

namespace {

template <class Model>
void check_float_double_networks_agree(std::uint64_t seed, index_t rows) {
  using Body = typename Model::body;
  Network<Model, backend::Host<float>> nf(seed);
  Network<Model, backend::Host<double>> nd(seed);
  // The same weights in both: the float ones, exactly.
  nd.set_parameters(cast_all<double>(nf.parameters()));
  Rng rng(seed + 2);
  const Ids labels = uniform_ints(std::size_t(rows), rng, Body::out_features);
  const ConstView<std::int32_t> lv{labels.data(), Shape{rows}};
  double lf = 0, ld = 0;
  if constexpr (Body::takes_token_ids) {
    const Ids ids = uniform_ints(std::size_t(rows), rng, Body::first_layer::params(1)[0].rows);
    const ConstView<std::int32_t> x{ids.data(), Shape{rows, 1}};
    lf = nf.forward_backward(x, lv);
    ld = nd.forward_backward(x, lv);
  } else {
    const auto xf = cast_all<float>(uniform_values(std::size_t(rows * Body::in_features), rng, -2, 2));
    const auto xd = cast_all<double>(xf);
    lf = nf.forward_backward(ConstView<float>{xf.data(), Shape{rows, Body::in_features}}, lv);
    ld = nd.forward_backward(ConstView<double>{xd.data(), Shape{rows, Body::in_features}}, lv);
  }
  CAPTURE(Body::describe(), seed, lf, ld);
  CHECK(std::abs(lf - ld) <= 1e-5 * std::abs(ld));
  CHECK(relative_error(cast_all<double>(nf.gradients()), nd.gradients()) <= 1e-5);
}

}  // namespace

TEST_CASE("float and double Networks agree on loss and gradients", "[cpu][layers][network][precision]") {
  const auto seed = std::uint64_t(GENERATE(take(3, random(1, 1000000))));
  check_float_double_networks_agree<Mlp>(seed, 16);
  check_float_double_networks_agree<TokenModel>(seed, 16);
  check_float_double_networks_agree<Sequential<Linear<64, 32>, ReLU, Linear<32, 10>>>(seed, 32);
}
