// SPDX-License-Identifier: Apache-2.0
// Layers and whole models against central finite differences in float64: every layer alone, and
// Sequential models through LayerSeq (input gradient too) and through Network (the loss included).
// Also: the zero-bubble split (B then W) reproduces the fused backward bit for bit, and float and
// double Networks agree.
#include <catch2/catch.hpp>

#include <cstdint>
#include <cstring>
#include <span>
#include <string>
#include <vector>

#include "cupipe/backend/host/ops.hpp"
#include "cupipe/layers/layers.hpp"
#include "cupipe/gpt/model.hpp"
#include "gradcheck.hpp"

using namespace cupipe;
using cupipe::testing::cast_all;
using cupipe::testing::dot;
using cupipe::testing::numeric_gradient;
using cupipe::testing::random_params;
using cupipe::testing::relative_error;
using cupipe::testing::uniform_ints;
using cupipe::testing::uniform_values;

namespace {

constexpr double grad_tolerance = 1e-6;
using Vec = std::vector<double>;
using Ids = std::vector<std::int32_t>;

/// Host<double> with the two fused ops of the CUDA backend, gemm_bias_grad (Linear's weight and bias
/// gradients in one call) and gemm_dgelu (a GEMM then GELU's gradient), written with the host's
/// own ops in the unfused order and counted. On it, Linear takes the fused weight-gradient path and
/// LayerSeq pairs a LinearGELU with the Linear after it (backward_pair), so the host tests that
/// plumbing, bit for bit, without a GPU.
struct FusingHost : backend::Host<double> {
  static inline int bias_grads = 0;
  static inline int dgelus = 0;
};
void gemm_bias_grad(FusingHost& be, double alpha, ConstView<double> dy, ConstView<double> x, double beta, TensorView<double> dw,
                    TensorView<double> dbias) {
  ++FusingHost::bias_grads;
  backend::Host<double>& host = be;
  gemm(host, ops::Transpose::yes, ops::Transpose::no, alpha, dy, x, beta, dw);
  bias_backward(host, dy, dbias);
}
void gemm_dgelu(FusingHost& be, ops::Transpose ta, ops::Transpose tb, double alpha, ConstView<double> a, ConstView<double> b,
                ConstView<double> pre, TensorView<double> d) {
  ++FusingHost::dgelus;
  backend::Host<double>& host = be;
  gemm(host, ta, tb, alpha, a, b, 0.0, d);
  gelu_backward(host, pre, ConstView<double>(d), d);
}
static_assert(detail::fuses_bias_grad<FusingHost, double> && detail::fuses_dgelu<FusingHost, double>);
static_assert(!detail::fuses_bias_grad<backend::Host<double>, double> && !detail::fuses_dgelu<backend::Host<double>, double>);
static_assert(backward_pair<Named<"fc", LinearGELU<4, 8>>, Named<"proj", Linear<8, 4>>, FusingHost, double>::fused);
static_assert(backward_pair<gpt::Init<Named<"fc", LinearGELU<4, 8>>, 2>, LinearNoBias<8, 4>, FusingHost, double>::fused);
static_assert(!backward_pair<LinearGELU<4, 8>, Linear<8, 4>, backend::Host<double>, double>::fused);  // no gemm_dgelu
static_assert(!backward_pair<Linear<4, 8>, Linear<8, 4>, FusingHost, double>::fused);               // no GELU before
static_assert(!backward_pair<LinearGELU<4, 8>, LinearGELU<8, 4>, FusingHost, double>::fused);       // its own GELU first

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

/// Checks d sum(r * output) / d (parameters, input) of a LayerSeq against finite differences, with
/// the fused backward (with_weight_grads = true) and a non-empty dx.
template <class Seq, class Backend = backend::Host<double>>
void check_sequence_gradients(std::uint64_t seed, index_t rows, bool away_from_zero = false) {
  Rng rng(seed);
  Backend be;
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
// A small GPT: V 11, T 4, 2 blocks, 2 heads, C 8. Its rows are whole sequences of 4 tokens.
constexpr gpt::Config small_gpt{11, 4, 2, 2, 8};
using SmallGpt = gpt::Model<small_gpt>;
using AttentionBlock = Residual<LayerNorm<8>, CausalSelfAttention<8, 2, 5>>;
using MlpBlock = Residual<LayerNorm<6>, Linear<6, 24>, GELU, Linear<24, 6>>;

}  // namespace

TEST_CASE("every layer alone: parameter and input gradients match finite differences", "[cpu][layers][gradcheck]") {
  const auto seed = std::uint64_t(GENERATE(take(3, random(1, 1000000))));
  const index_t rows = 1 + index_t(seed % 5);
  check_sequence_gradients<LayerSeq<0, 5, Linear<5, 7>>>(seed, rows);
  check_sequence_gradients<LayerSeq<0, 6, ReLU>>(seed, rows, /*away_from_zero=*/true);
  check_sequence_gradients<LayerSeq<0, 6, GELU>>(seed, rows);
  check_sequence_gradients<LayerSeq<0, 7, LayerNorm<7>>>(seed, rows);
  check_sequence_gradients<LayerSeq<0, 1, Embedding<11, 6>>>(seed, rows + 6);  // ids repeat
  check_sequence_gradients<LayerSeq<0, 1, TokenPositionEmbedding<11, 4, 6>>>(seed, 12);  // 3 sequences
  check_sequence_gradients<LayerSeq<0, 1, TokenPositionEmbedding<11, 1, 6>>>(seed, rows);
  check_sequence_gradients<LayerSeq<0, 6, LinearNoBias<6, 5>>>(seed, rows);
  check_sequence_gradients<LayerSeq<0, 5, LinearGELU<5, 7>>>(seed, rows);  // first: its B runs for W's sake
  check_sequence_gradients<LayerSeq<1, 5, LinearGELU<5, 7>>>(seed, rows);  // later: dx too
}

TEST_CASE("causal self-attention and residual blocks: gradients match finite differences", "[cpu][layers][gradcheck][gpt]") {
  const auto seed = std::uint64_t(GENERATE(take(3, random(1, 1000000))));
  check_sequence_gradients<LayerSeq<0, 8, CausalSelfAttention<8, 2, 5>>>(seed, 10);  // 2 sequences of 5
  check_sequence_gradients<LayerSeq<0, 6, CausalSelfAttention<6, 3, 1>>>(seed, 3);   // T = 1: attends to itself
  check_sequence_gradients<LayerSeq<0, 8, CausalSelfAttention<8, 1, 7>>>(seed, 7);   // one head, odd T
  check_sequence_gradients<LayerSeq<0, 8, AttentionBlock>>(seed, 10);
  check_sequence_gradients<LayerSeq<0, 6, MlpBlock>>(seed, 3);
  check_sequence_gradients<LayerSeq<0, 6, Residual<LayerNorm<6>, LinearGELU<6, 24>, Linear<24, 6>>>>(seed, 3);
  // The same on a backend that pairs the LinearGELU with the Linear's backward and fuses the bias gradient.
  FusingHost::dgelus = FusingHost::bias_grads = 0;
  check_sequence_gradients<LayerSeq<0, 6, Residual<LayerNorm<6>, LinearGELU<6, 24>, Linear<24, 6>>>, FusingHost>(seed, 3);
  check_sequence_gradients<LayerSeq<0, 5, LinearGELU<5, 7>, Linear<7, 3>>, FusingHost>(seed, 3);  // paired first layer
  CHECK(FusingHost::dgelus == 2);
  CHECK(FusingHost::bias_grads == 4);
  // A whole GPT body (embedding, 2 blocks, ln_f, lm_head), and a stage cut inside a block.
  check_sequence_gradients<SmallGpt::body>(seed, 8);
  check_sequence_gradients<LayerSeq<2, 8, gpt::MlpHalf<small_gpt>, gpt::AttentionHalf<small_gpt>>>(seed, 8);
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
  check_network_gradients<SmallGpt>(seed, 8, 0);       // mean cross-entropy over 2 sequences of 4
}

namespace {

/// Runs backward fused (B with weight gradients) and split (B, then W), from the same non-zero
/// starting gradients, and requires identical bits.
template <class Seq, class Backend = backend::Host<double>>
void check_split_backward_is_bitwise_fused(std::uint64_t seed, index_t rows) {
  Rng rng(seed);
  Backend be;
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
  check_split_backward_is_bitwise_fused<SmallGpt::body>(seed, 8);
  // Attention and a block first in a stage: B must still run them with no dx, for W's sake.
  check_split_backward_is_bitwise_fused<LayerSeq<1, 8, CausalSelfAttention<8, 2, 4>, LayerNorm<8>>>(seed, 8);
  check_split_backward_is_bitwise_fused<LayerSeq<1, 8, AttentionBlock>>(seed, 10);
  // LinearGELU first in a stage: B computes GELU's gradient with no dx, for W's sake.
  check_split_backward_is_bitwise_fused<LayerSeq<1, 5, LinearGELU<5, 7>, Linear<7, 3>>>(seed, 4);
  // Paired (a backend with gemm_dgelu): the Linear's B writes the LinearGELU's GELU gradient, W reads it.
  FusingHost::dgelus = 0;
  check_split_backward_is_bitwise_fused<LayerSeq<1, 5, LinearGELU<5, 7>, Linear<7, 3>>, FusingHost>(seed, 4);
  check_split_backward_is_bitwise_fused<LayerSeq<2, 8, gpt::MlpHalf<small_gpt>, gpt::AttentionHalf<small_gpt>>, FusingHost>(seed, 8);
  CHECK(FusingHost::dgelus == 4);  // one per backward, two backwards per check
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
  check_float_double_networks_agree<SmallGpt>(seed, 16);
  check_float_double_networks_agree<Sequential<Linear<64, 32>, ReLU, Linear<32, 10>>>(seed, 32);
}

TEST_CASE("a stage that starts with attention or a block: B without dx, then W, gives the weight gradients",
          "[cpu][layers][zero_bubble][gpt]") {
  // A first stage needs no input gradient, but attention's and a block's W read what their B keeps.
  auto check = [](auto seq, std::uint64_t seed, index_t rows) {
    using Seq = decltype(seq);
    Rng rng(seed);
    backend::Host<double> be;
    Vec params = random_params<Seq>(seed, rng);
    const Vec x = uniform_values(std::size_t(rows * Seq::in_features), rng);
    const ConstView<double> xv{x.data(), Shape{rows, Seq::in_features}};
    const Vec dy = uniform_values(std::size_t(rows * Seq::out_features), rng);
    const ConstView<double> dyv{dy.data(), Shape{rows, Seq::out_features}};
    Vec record(std::size_t(Seq::record_elements(rows))), dx(x.size());
    Seq::forward(be, params.data(), xv, record.data());
    const std::size_t grad_record_size = std::size_t(std::max<index_t>(Seq::grad_record_elements(rows), 1));
    Vec with_dx(params.size()), record_a(grad_record_size);
    Seq::backward(be, params.data(), xv, record.data(), dyv, TensorView<double>{dx.data(), Shape{rows, Seq::in_features}},
                  with_dx.data(), record_a.data(), true);
    Vec split(params.size()), record_b(grad_record_size);
    Seq::backward(be, params.data(), xv, record.data(), dyv, TensorView<double>{}, split.data(), record_b.data(), false);
    Seq::backward_weight(be, xv, record.data(), dyv, record_b.data(), split.data());
    CAPTURE(Seq::describe(), seed);
    CHECK(std::memcmp(split.data(), with_dx.data(), split.size() * sizeof(double)) == 0);
  };
  const auto seed = std::uint64_t(GENERATE(take(2, random(1, 1000000))));
  check(LayerSeq<0, 8, CausalSelfAttention<8, 2, 4>, LayerNorm<8>>{}, seed, 8);
  check(LayerSeq<0, 8, AttentionBlock, LayerNorm<8>>{}, seed, 10);
  check(LayerSeq<0, 8, AttentionBlock>{}, seed, 5);
}

TEST_CASE("GPT model: nanoGPT's names and shapes, the parameter count, whole sequences", "[cpu][layers][gpt]") {
  using Body = SmallGpt::body;
  STATIC_REQUIRE(Body::rows_per_sample == 4);
  STATIC_REQUIRE(Body::param_count == small_gpt.parameters());
  const std::vector<ParamInfo> table = Body::parameter_table();
  std::vector<std::string> names;
  for (const ParamInfo& p : table) names.push_back(gpt::nanogpt_name(small_gpt, p.name));
  const std::vector<std::string> expected = {
      "transformer.wte.weight", "transformer.wpe.weight",
      "transformer.h.0.ln_1.weight", "transformer.h.0.ln_1.bias", "transformer.h.0.attn.c_attn.weight",
      "transformer.h.0.attn.c_attn.bias", "transformer.h.0.attn.c_proj.weight", "transformer.h.0.attn.c_proj.bias",
      "transformer.h.0.ln_2.weight", "transformer.h.0.ln_2.bias", "transformer.h.0.mlp.c_fc.weight",
      "transformer.h.0.mlp.c_fc.bias", "transformer.h.0.mlp.c_proj.weight", "transformer.h.0.mlp.c_proj.bias",
      "transformer.h.1.ln_1.weight", "transformer.h.1.ln_1.bias", "transformer.h.1.attn.c_attn.weight",
      "transformer.h.1.attn.c_attn.bias", "transformer.h.1.attn.c_proj.weight", "transformer.h.1.attn.c_proj.bias",
      "transformer.h.1.ln_2.weight", "transformer.h.1.ln_2.bias", "transformer.h.1.mlp.c_fc.weight",
      "transformer.h.1.mlp.c_fc.bias", "transformer.h.1.mlp.c_proj.weight", "transformer.h.1.mlp.c_proj.bias",
      "transformer.ln_f.weight", "transformer.ln_f.bias", "lm_head.weight"};
  CHECK(names == expected);
  CHECK(table[0].shape == Shape{11, 8});
  CHECK(table[4].shape == Shape{24, 8});   // c_attn.weight (3C, C), as nanoGPT's Linear
  CHECK(table[10].shape == Shape{32, 8});  // mlp.c_fc.weight (4C, C)
  CHECK(table.back().shape == Shape{11, 8});
  CHECK_THROWS_WITH(gpt::nanogpt_name(small_gpt, "9.x"), Catch::Contains("not a parameter of a GPT with 2 blocks"));

  // GPT-2's initialisation: N(0, 0.02) matrices, c_proj scaled by 1 / sqrt(2 L), zero biases, unit LayerNorm.
  std::vector<double> p(static_cast<std::size_t>(Body::param_count));
  Body::init(std::span<double>(p), 7);
  auto stddev = [&](const ParamInfo& info) {
    double s = 0;
    for (index_t i = 0; i < info.numel; ++i) s += p[std::size_t(info.offset + i)] * p[std::size_t(info.offset + i)];
    return std::sqrt(s / double(info.numel));
  };
  CHECK(stddev(table[0]) == Approx(0.02).epsilon(0.15));
  CHECK(stddev(table[10]) == Approx(0.02).epsilon(0.15));
  CHECK(stddev(table[12]) == Approx(0.01).epsilon(0.15));  // mlp.c_proj: 0.02 / sqrt(2 * 2)
  CHECK(stddev(table[5]) == 0.0);                            // c_attn.bias
  CHECK(p[std::size_t(table[2].offset)] == 1.0);             // ln_1.weight

  Network<SmallGpt, backend::Host<double>> net(1);
  const Ids ids(6, 1), labels(6, 2);
  CHECK_THROWS_WITH(net.forward_backward(ConstView<std::int32_t>{ids.data(), Shape{6, 1}}, ConstView<std::int32_t>{labels.data(), Shape{6}}),
                    Catch::Contains("6 token ids are not whole sequences of 4 tokens"));
}

TEST_CASE("tied GPT: the summed gradient is the derivative with respect to the one shared table",
          "[cpu][layers][gradcheck][gpt]") {
  constexpr TiedCopies tied = SmallGpt::body::tied;
  STATIC_REQUIRE(tied.count == 11 * 8);
  const auto seed = std::uint64_t(GENERATE(take(2, random(1, 1000000))));
  Network<SmallGpt, backend::Host<double>> net(seed);
  Vec params = net.parameters();
  // Initialised from one stream: the copies start bitwise equal.
  REQUIRE(std::memcmp(params.data() + tied.first, params.data() + tied.second, std::size_t(tied.count) * sizeof(double)) == 0);
  Rng rng(seed + 3);
  const Ids ids = uniform_ints(8, rng, 11), labels = uniform_ints(8, rng, 11);
  const ConstView<std::int32_t> x{ids.data(), Shape{8, 1}}, y{labels.data(), Shape{8}};
  net.forward_backward(x, y);
  net.sum_tied_gradients();
  const Vec g = net.gradients();
  const Vec analytic(g.begin() + tied.first, g.begin() + tied.first + tied.count);
  CHECK(std::memcmp(g.data() + tied.first, g.data() + tied.second, std::size_t(tied.count) * sizeof(double)) == 0);
  // Move both copies together: the loss as a function of the one shared table.
  Vec numeric(std::size_t(tied.count));
  const double h = 1e-6;
  auto loss_at = [&](index_t i, double delta) {
    Vec p = params;
    p[std::size_t(tied.first + i)] += delta;
    p[std::size_t(tied.second + i)] += delta;
    net.set_parameters(p);
    return double(net.forward_backward(x, y));
  };
  for (index_t i = 0; i < tied.count; ++i) numeric[std::size_t(i)] = (loss_at(i, h) - loss_at(i, -h)) / (2 * h);
  CHECK(relative_error(analytic, numeric) <= grad_tolerance);
}

namespace {

/// The same model written with LinearGELU and with Linear then GELU: the same parameter names (after
/// Sequential's layer index) and count; given the same values, the same loss and gradients, bitwise, on `Backend` (the same ops
/// in the same order).
template <class Backend, class Fused, class Unfused>
void check_fused_equals_unfused(std::uint64_t seed, index_t rows) {
  Network<Fused, Backend> fused(seed);
  Network<Unfused, Backend> unfused(seed);
  REQUIRE(Fused::body::param_count == Unfused::body::param_count);
  // Past the fused layer, Sequential's layer indices differ by one ("2.proj.weight" against
  // "3.proj.weight"); the names after the index are the same.
  const auto names = Fused::body::parameter_table(), unfused_names = Unfused::body::parameter_table();
  const auto tail = [](const std::string& name) { return name.substr(name.find('.')); };
  for (std::size_t i = 0; i < names.size(); ++i) CHECK(tail(std::string(names[i].name)) == tail(std::string(unfused_names[i].name)));
  unfused.set_parameters(fused.parameters());
  Rng rng(seed + 1);
  using Body = typename Fused::body;
  std::vector<typename Backend::value_type> x(static_cast<std::size_t>(rows * Body::in_features));
  for (auto& v : x) v = typename Backend::value_type(float(rng.uniform(-2.0, 2.0)));
  const Ids labels = uniform_ints(std::size_t(rows), rng, Body::out_features);
  const ConstView<typename Backend::value_type> xv{x.data(), Shape{rows, Body::in_features}};
  const ConstView<std::int32_t> lv{labels.data(), Shape{rows}};
  fused.zero_grad();
  unfused.zero_grad();
  const auto a = fused.forward_backward(xv, lv), b = unfused.forward_backward(xv, lv);
  CAPTURE(Body::describe(), seed, rows);
  CHECK(a == b);
  CHECK(fused.gradients() == unfused.gradients());
}

}  // namespace

TEST_CASE("LinearGELU is Linear then GELU, bitwise, in float, double and bf16", "[cpu][layers]") {
  const auto seed = std::uint64_t(GENERATE(take(2, random(1, 1000000))));
  const index_t rows = 1 + index_t(seed % 7);
  using Fused = Sequential<Named<"in", Linear<5, 6>>, Named<"fc", LinearGELU<6, 12>>, Named<"proj", Linear<12, 4>>,
                           SoftmaxCrossEntropy<4>>;
  using Unfused = Sequential<Named<"in", Linear<5, 6>>, Named<"fc", Linear<6, 12>>, GELU, Named<"proj", Linear<12, 4>>,
                             SoftmaxCrossEntropy<4>>;
  check_fused_equals_unfused<backend::Host<float>, Fused, Unfused>(seed, rows);
  check_fused_equals_unfused<backend::Host<double>, Fused, Unfused>(seed, rows);
  check_fused_equals_unfused<backend::Host<cupipe::bfloat16, float>, Fused, Unfused>(seed, rows);
  // The first layer: no input gradient, yet its weight gradient needs GELU's.
  using FusedFirst = Sequential<Named<"fc", LinearGELU<5, 12>>, Named<"proj", Linear<12, 4>>, SoftmaxCrossEntropy<4>>;
  using UnfusedFirst = Sequential<Named<"fc", Linear<5, 12>>, GELU, Named<"proj", Linear<12, 4>>, SoftmaxCrossEntropy<4>>;
  check_fused_equals_unfused<backend::Host<float>, FusedFirst, UnfusedFirst>(seed, rows);
  // Inside a residual block, as GPT-2's MLP.
  using FusedBlock = Sequential<Named<"in", Linear<5, 6>>,
                                Residual<Named<"ln", LayerNorm<6>>, Named<"fc", LinearGELU<6, 24>>, Named<"proj", Linear<24, 6>>>,
                                Named<"out", Linear<6, 4>>, SoftmaxCrossEntropy<4>>;
  using UnfusedBlock = Sequential<Named<"in", Linear<5, 6>>,
                                  Residual<Named<"ln", LayerNorm<6>>, Named<"fc", Linear<6, 24>>, GELU, Named<"proj", Linear<24, 6>>>,
                                  Named<"out", Linear<6, 4>>, SoftmaxCrossEntropy<4>>;
  check_fused_equals_unfused<backend::Host<float>, FusedBlock, UnfusedBlock>(seed, rows);
  check_fused_equals_unfused<backend::Host<cupipe::bfloat16, float>, FusedBlock, UnfusedBlock>(seed, rows);
  // With gemm_dgelu the LinearGELU and the Linear after it run their backward as a pair, and the
  // bias gradients come from gemm_bias_grad: still bitwise the unfused layers (one GEMM, then GELU's
  // gradient, as before; only where the GEMM writes changes).
  FusingHost::dgelus = 0;
  check_fused_equals_unfused<FusingHost, Fused, Unfused>(seed, rows);
  check_fused_equals_unfused<FusingHost, FusedFirst, UnfusedFirst>(seed, rows);
  check_fused_equals_unfused<FusingHost, FusedBlock, UnfusedBlock>(seed, rows);
  CHECK(FusingHost::dgelus == 3);
}
