// SPDX-License-Identifier: Apache-2.0
// Layers and Sequential: PyTorch names and layouts, PyTorch's initialisation, and errors that name the
// layer and both shapes.
#include <catch2/catch.hpp>

#include <cmath>
#include <cstdint>
#include <limits>
#include <span>
#include <string>
#include <vector>

#include "cupipe/backend/host/ops.hpp"
#include "cupipe/layers/layers.hpp"

using namespace cupipe;
using Catch::Contains;

namespace {

using Vec = std::vector<double>;
using Ids = std::vector<std::int32_t>;
using Mnist = Sequential<Linear<784, 512>, ReLU, Linear<512, 256>, ReLU, Linear<256, 10>>;
using Mlp = Sequential<Linear<5, 7>, GELU, LayerNorm<7>, ReLU, Linear<7, 3>>;
using TokenModel = Sequential<Embedding<11, 6>, LayerNorm<6>, GELU, Linear<6, 4>, SoftmaxCrossEntropy<4>>;

template <class Seq>
Vec initialised(std::uint64_t seed) {
  Vec p(std::size_t(Seq::param_count));
  Seq::init(std::span<double>(p), seed);
  return p;
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// Names, shapes, layout

TEST_CASE("parameter_table: torch.nn.Sequential state_dict names, shapes, contiguous offsets", "[cpu][layers]") {
  const auto table = Mnist::parameter_table();
  struct Expected {
    const char* name;
    Shape shape;
  };
  const std::vector<Expected> expected{{"0.weight", Shape{512, 784}}, {"0.bias", Shape{512}},
                                       {"2.weight", Shape{256, 512}}, {"2.bias", Shape{256}},
                                       {"4.weight", Shape{10, 256}},  {"4.bias", Shape{10}}};
  REQUIRE(table.size() == expected.size());
  index_t offset = 0;
  for (std::size_t i = 0; i < table.size(); ++i) {
    CAPTURE(i);
    CHECK(table[i].name == expected[i].name);
    CHECK(table[i].shape == expected[i].shape);
    CHECK(table[i].numel == expected[i].shape.numel());
    CHECK(table[i].offset == offset);
    offset += table[i].numel;
  }
  CHECK(offset == Mnist::param_count);
  CHECK(Mnist::param_count == 784 * 512 + 512 + 512 * 256 + 256 + 256 * 10 + 10);
  CHECK(Network<Mnist, backend::Host<float>>::parameter_table().size() == 6);

  // LayerNorm and Embedding, and a stage numbered from 2.
  const auto mlp = Mlp::parameter_table();
  REQUIRE(mlp.size() == 6);
  CHECK(mlp[2].name == "2.weight");
  CHECK(mlp[2].shape == Shape{7});
  CHECK(mlp[3].name == "2.bias");
  CHECK(mlp[4].name == "4.weight");
  CHECK(mlp[4].shape == Shape{3, 7});
  const auto tokens = TokenModel::parameter_table();
  REQUIRE(tokens.size() == 5);  // the loss has no parameters
  CHECK(tokens[0].name == "0.weight");
  CHECK(tokens[0].shape == Shape{11, 6});
  const auto stage = LayerSeq<2, 7, LayerNorm<7>, ReLU, Linear<7, 3>>::parameter_table();
  REQUIRE(stage.size() == 4);
  CHECK(stage[0].name == "2.weight");
  CHECK(stage[0].offset == 0);
  CHECK(stage[2].name == "4.weight");

  CHECK(Mnist::describe() == "Linear<784, 512>, ReLU, Linear<512, 256>, ReLU, Linear<256, 10>");
  CHECK(Mnist::in_features == 784);
  CHECK(Mnist::out_features == 10);
  CHECK_FALSE(Mnist::has_loss);
  CHECK(TokenModel::has_loss);
  CHECK(TokenModel::body::out_features == 4);
}

// ---------------------------------------------------------------------------------------------
// Initialisation

TEST_CASE("Linear init: U(-1/sqrt(in), 1/sqrt(in)) for weight and bias, as PyTorch", "[cpu][layers][init]") {
  const Vec p = initialised<Mnist::body>(1);
  for (const ParamInfo& info : Mnist::parameter_table()) {
    CAPTURE(info.name);
    const double bound = 1.0 / std::sqrt(double(info.name[0] == '0' ? 784 : info.name[0] == '2' ? 512 : 256));
    double lo = INFINITY, hi = -INFINITY, sum = 0;
    for (index_t i = info.offset; i < info.offset + info.numel; ++i) {
      lo = std::min(lo, p[std::size_t(i)]);
      hi = std::max(hi, p[std::size_t(i)]);
      sum += p[std::size_t(i)];
    }
    CHECK(lo >= -bound);
    CHECK(hi <= bound);
    CHECK(lo < hi);  // not all equal
    if (info.numel >= 256) {  // and actually spread over the range
      CHECK(lo < -0.9 * bound);
      CHECK(hi > 0.9 * bound);
      CHECK(std::abs(sum / double(info.numel)) < 0.1 * bound);
    }
  }
}

TEST_CASE("LayerNorm init is ones and zeros, Embedding init is N(0, 1)", "[cpu][layers][init]") {
  const Vec p = initialised<Mlp::body>(3);
  const auto table = Mlp::parameter_table();
  for (index_t i = 0; i < 7; ++i) {
    CHECK(p[std::size_t(table[2].offset + i)] == 1.0);
    CHECK(p[std::size_t(table[3].offset + i)] == 0.0);
  }
  const Vec e = initialised<LayerSeq<0, 1, Embedding<1000, 32>>>(5);
  double sum = 0, sum_sq = 0;
  for (double x : e) sum += x, sum_sq += x * x;
  const double n = double(e.size()), mean = sum / n;
  CHECK(std::abs(mean) < 5 / std::sqrt(n));
  CHECK(std::abs(sum_sq / n - mean * mean - 1) < 5 * std::sqrt(2 / n));
}

TEST_CASE("init is reproducible, and a stage initialises as its slice of the whole model", "[cpu][layers][init]") {
  CHECK(initialised<Mlp::body>(42) == initialised<Mlp::body>(42));
  CHECK(initialised<Mlp::body>(42) != initialised<Mlp::body>(43));
  Network<Mlp, backend::Host<double>> a(42), b(42);
  CHECK(a.parameters() == b.parameters());
  CHECK(a.parameters() == initialised<Mlp::body>(42));

  // Layer i draws from Rng::derive(seed, i), so a model initialises identically however it is split.
  const Vec whole = initialised<Mnist::body>(9);
  const auto slice = [&](index_t from, index_t count) {
    return Vec(whole.begin() + from, whole.begin() + from + count);
  };
  using Head = LayerSeq<0, 784, Linear<784, 512>, ReLU>;
  using Middle = LayerSeq<2, 512, Linear<512, 256>>;
  using Tail = LayerSeq<3, 256, ReLU, Linear<256, 10>>;
  CHECK(initialised<Head>(9) == slice(0, Head::param_count));
  CHECK(initialised<Middle>(9) == slice(Mnist::param_offsets[2], Middle::param_count));
  CHECK(initialised<Tail>(9) == slice(Mnist::param_offsets[3], Tail::param_count));
  CHECK(initialised<Middle>(9) != slice(0, Middle::param_count));  // not the first layer's stream

  Vec wrong(5);
  CHECK_THROWS_WITH(Mlp::body::init(std::span<double>(wrong), 1), Contains("init: 5 parameters given, 80 needed"));
}

// ---------------------------------------------------------------------------------------------
// LayerDefaults: a layer declares only what differs from the usual values

namespace {

// The example at the top of layers/layer.hpp, as written there.
struct Identity : LayerDefaults {
  static std::string describe() { return "Identity"; }
  template <class B, class T>
  static void forward(B& be, const T*, ConstViewOn<B, T> x, ViewOn<B, T> y, ViewOn<B, T>) { copy(be, x, y); }
  template <class B, class T>
  static void backward_input(B& be, const T*, ConstViewOn<B, T>, ConstViewOn<B, T>, ConstViewOn<B, T> dy,
                             ViewOn<B, T> dx) { copy(be, dy, dx); }
};

/// Identity that hides four defaults, including two of the optional members.
struct SavesTwoPerValue : Identity {
  static constexpr index_t saved_per_row(index_t in) { return 2 * in; }
  static constexpr double forward_flops_per_sample(index_t in) { return 3.0 * double(in); }
  static constexpr index_t rows_per_sample = 2;
  static constexpr bool weight_grads_need_backward_input = true;
};

static_assert(Layer<Identity> && layer_is_complete<Identity>::value && !LossLayer<Identity>);
static_assert(Identity::in_features == any_features && Identity::out_features_for(5) == 5);
static_assert(!Identity::takes_token_ids && !Identity::is_loss);
static_assert(Identity::params(5).empty() && param_elements<Identity>(5) == 0);
static_assert(Identity::saved_per_row(5) == 0 && Identity::forward_flops_per_sample(5) == 0);
static_assert(rows_per_sample_of<Identity>() == 1 && !weight_grads_need_backward_input<Identity>() &&
              !tied_to_input_embedding<Identity>());
static_assert(Layer<SavesTwoPerValue> && SavesTwoPerValue::saved_per_row(5) == 10);
static_assert(rows_per_sample_of<SavesTwoPerValue>() == 2 && weight_grads_need_backward_input<SavesTwoPerValue>());
// A layer without the base, and the library's own layers on it, are Layers as before.
static_assert(Layer<Linear<3, 2>> && layer_is_complete<Linear<3, 2>>::value && Layer<ReLU> && Layer<GELU>);
static_assert(LossLayer<SoftmaxCrossEntropy<4>> && ReLU::in_features == any_features && GELU::out_features_for(7) == 7);

using Plain = Sequential<Linear<4, 3>, Linear<3, 2>>;
using WithIdentity = Sequential<Linear<4, 3>, Identity, Linear<3, 2>>;
using WithSaves = Sequential<Linear<4, 3>, SavesTwoPerValue, Linear<3, 2>>;

}  // namespace

TEST_CASE("LayerDefaults: an identity adds nothing to a model's parameters, cost or results", "[cpu][layers]") {
  static_assert(WithIdentity::body::param_count == Plain::body::param_count);
  static_assert(WithIdentity::body::forward_flops_per_sample == Plain::body::forward_flops_per_sample);
  static_assert(WithIdentity::body::rows_per_sample == 1 && WithIdentity::body::out_features == 2);
  // The identity's own saved area is empty: its record holds only its output beside Plain's.
  static_assert(WithIdentity::body::record_per_row == Plain::body::record_per_row + 3);

  Network<Plain, backend::Host<double>> plain(3);
  Network<WithIdentity, backend::Host<double>> with_identity(3);
  with_identity.set_parameters(plain.parameters());
  const Vec x{0.5, -1.0, 2.0, 0.25, 1.5, 0.75, -0.5, 3.0};
  const Ids labels{1, 0};
  const double loss_plain = plain.forward_backward(ConstView<double>{x.data(), Shape{2, 4}}, ConstView<std::int32_t>{labels.data(), Shape{2}});
  const double loss_identity =
      with_identity.forward_backward(ConstView<double>{x.data(), Shape{2, 4}}, ConstView<std::int32_t>{labels.data(), Shape{2}});
  CHECK(loss_identity == loss_plain);
  CHECK(with_identity.gradients() == plain.gradients());
}

TEST_CASE("LayerDefaults: a layer's own saved_per_row, cost and rows_per_sample hide the defaults in Sequential",
          "[cpu][layers]") {
  static_assert(WithSaves::body::record_per_row == WithIdentity::body::record_per_row + 2 * 3);
  static_assert(WithSaves::body::forward_flops_per_sample == WithIdentity::body::forward_flops_per_sample + 3.0 * 3);
  static_assert(WithSaves::body::rows_per_sample == 2);
  CHECK(WithSaves::body::record_elements(4) == WithIdentity::body::record_elements(4) + 4 * 2 * 3);
  Network<WithSaves, backend::Host<double>> net(3);
  const Vec x(16, 0.5);
  const Ids labels{1, 0, 1, 1};
  CHECK(std::isfinite(net.forward_backward(ConstView<double>{x.data(), Shape{4, 4}}, ConstView<std::int32_t>{labels.data(), Shape{4}})));
}

// ---------------------------------------------------------------------------------------------
// Errors at run time: the layer, and both shapes

TEST_CASE("bad input to a model names the layer and both shapes", "[cpu][layers][errors]") {
  Network<Mlp, backend::Host<double>> net(1);
  Vec x(24, 0.5);
  const Ids labels{0, 1, 2, 0};
  const ConstView<std::int32_t> lv{labels.data(), Shape{4}};

  SECTION("wrong feature count") {
    REQUIRE_THROWS_AS(net.forward_backward(ConstView<double>{x.data(), Shape{4, 6}}, lv), cupipe::error);
    REQUIRE_THROWS_WITH(net.forward_backward(ConstView<double>{x.data(), Shape{4, 6}}, lv),
                        Contains("Linear<5, 7> (layer 0)") && Contains("(4, 5)") && Contains("(4, 6)"));
    Vec out(12);
    REQUIRE_THROWS_WITH(net.forward(ConstView<double>{x.data(), Shape{4, 6}}, TensorView<double>{out.data(), Shape{4, 3}}),
                        Contains("Linear<5, 7> (layer 0)") && Contains("(4, 5)") && Contains("(4, 6)"));
    REQUIRE_THROWS_WITH(net.forward(ConstView<double>{x.data(), Shape{4, 5}}, TensorView<double>{out.data(), Shape{3, 4}}),
                        Contains("Network::forward") && Contains("(4, 3)") && Contains("(3, 4)"));
  }
  SECTION("labels count differs from rows") {
    REQUIRE_THROWS_WITH(net.forward_backward(ConstView<double>{x.data(), Shape{4, 5}}, ConstView<std::int32_t>{labels.data(), Shape{3}}),
                        Contains("SoftmaxCrossEntropy<3>") && Contains("(4,)") && Contains("(3,)") &&
                            Contains("(4, 5)"));
  }
  SECTION("label out of range names the loss layer's op and the label") {
    const Ids bad{0, 1, 3, 0};
    REQUIRE_THROWS_WITH(net.forward_backward(ConstView<double>{x.data(), Shape{4, 5}}, ConstView<std::int32_t>{bad.data(), Shape{4}}),
                        Contains("label 3 at row 2") && Contains("(4, 3)"));
  }
  SECTION("a too-small buffer") {
    HostBuffer<double> record(Mlp::body::record_elements(4) - 1);
    REQUIRE_THROWS_AS(record.view(Shape{4, Mlp::body::record_per_row}), cupipe::error);
    REQUIRE_THROWS_WITH(record.view(Shape{4, Mlp::body::record_per_row}),
                        Contains("buffer of " + std::to_string(Mlp::body::record_elements(4) - 1) +
                                 " elements is too small for shape (4, " +
                                 std::to_string(Mlp::body::record_per_row) + ")"));
  }
  SECTION("null parameter, record, gradient pointers") {
    using Body = Mlp::body;
    backend::Host<double> be;
    Vec params(std::size_t(Body::param_count)), record(std::size_t(Body::record_elements(4)));
    Vec grads(params.size()), grad_record(std::size_t(Body::grad_record_elements(4))), dy(12);
    const ConstView<double> xv{x.data(), Shape{4, 5}}, dyv{dy.data(), Shape{4, 3}};
    // (A macro: Catch's combined matchers keep pointers to their parts.)
#define NULL_NAMED Contains("Linear<5, 7> (layer 0)") && Contains("null")
    REQUIRE_THROWS_WITH(Body::forward(be, static_cast<const double*>(nullptr), xv, record.data()), NULL_NAMED);
    REQUIRE_THROWS_WITH(Body::forward(be, params.data(), xv, static_cast<double*>(nullptr)), NULL_NAMED);
    REQUIRE_THROWS_WITH(Body::backward(be, params.data(), xv, static_cast<const double*>(nullptr), dyv,
                                       TensorView<double>{}, grads.data(), grad_record.data(), true),
                        NULL_NAMED);
    REQUIRE_THROWS_WITH(Body::backward(be, static_cast<const double*>(nullptr), xv, record.data(), dyv,
                                       TensorView<double>{}, grads.data(), grad_record.data(), true),
                        NULL_NAMED);
    REQUIRE_THROWS_WITH(Body::backward(be, params.data(), xv, record.data(), dyv, TensorView<double>{},
                                       static_cast<double*>(nullptr), grad_record.data(), true),
                        NULL_NAMED);
    REQUIRE_THROWS_WITH(Body::backward(be, params.data(), xv, record.data(), dyv, TensorView<double>{}, grads.data(),
                                       static_cast<double*>(nullptr), false),
                        NULL_NAMED);
    REQUIRE_THROWS_WITH(Body::backward_weight(be, xv, record.data(), dyv, static_cast<const double*>(nullptr),
                                              grads.data()),
                        NULL_NAMED);
    REQUIRE_THROWS_WITH(Body::forward(be, params.data(), ConstView<double>{nullptr, Shape{4, 5}}, record.data()),
                        Contains("Linear<5, 7> (layer 0): input of shape (4, 5) is a null pointer"));
    // A stage without parameters needs no parameter pointer.
    using Activations = LayerSeq<1, 5, GELU, ReLU>;
    Vec act_record(std::size_t(Activations::record_elements(4)));
    CHECK_NOTHROW(Activations::forward(be, static_cast<const double*>(nullptr), xv, act_record.data()));
#undef NULL_NAMED
  }
  SECTION("wrong gradient shapes in backward name the layer") {
    using Body = Mlp::body;
    backend::Host<double> be;
    Vec params = initialised<Body>(1), record(std::size_t(Body::record_elements(4)));
    Vec grads(params.size()), grad_record(std::size_t(Body::grad_record_elements(4))), dy(20), dx(20);
    const ConstView<double> xv{x.data(), Shape{4, 5}};
    Body::forward(be, params.data(), xv, record.data());
    REQUIRE_THROWS_WITH(Body::backward(be, params.data(), xv, record.data(), ConstView<double>{dy.data(), Shape{4, 4}},
                                       TensorView<double>{}, grads.data(), grad_record.data(), true),
                        Contains("Linear<7, 3> (layer 4)") && Contains("(4, 3)") && Contains("(4, 4)"));
    REQUIRE_THROWS_WITH(Body::backward(be, params.data(), xv, record.data(), ConstView<double>{dy.data(), Shape{4, 3}},
                                       TensorView<double>{dx.data(), Shape{4, 4}}, grads.data(), grad_record.data(), true),
                        Contains("Linear<5, 7> (layer 0)") && Contains("(4, 5)") && Contains("(4, 4)"));
  }
  SECTION("non-finite values in the loss") {
    for (double bad : {std::numeric_limits<double>::infinity(), std::numeric_limits<double>::quiet_NaN()}) {
      CAPTURE(bad);
      Vec poisoned = x;
      poisoned[7] = bad;
      REQUIRE_THROWS_WITH(net.forward_backward(ConstView<double>{poisoned.data(), Shape{4, 5}}, lv),
                          Contains("SoftmaxCrossEntropy<3>: the loss is not finite") && Contains("(4, 3)") &&
                              Contains("(4,)"));
    }
    // The failed steps left the gradients untouched.
    for (double g : net.gradients()) REQUIRE(g == 0.0);
  }
}

TEST_CASE("bad input to an Embedding-first model names the Embedding", "[cpu][layers][errors]") {
  Network<TokenModel, backend::Host<double>> net(1);
  const Ids labels{0, 1, 2, 3};
  const ConstView<std::int32_t> lv{labels.data(), Shape{4}};
  const Ids ids{1, 11, 2, 3};
  REQUIRE_THROWS_WITH(net.forward_backward(ConstView<std::int32_t>{ids.data(), Shape{4, 1}}, lv),
                      Contains("Embedding<11, 6> (layer 0) forward") && Contains("token id 11 at row 1") &&
                          Contains("[0, 11)"));
  const Ids pairs(8, 1);
  REQUIRE_THROWS_WITH(net.forward_backward(ConstView<std::int32_t>{pairs.data(), Shape{4, 2}}, lv),
                      Contains("Embedding<11, 6> (layer 0)") && Contains("(4, 1)") && Contains("(4, 2)"));
  Vec logits(20);
  Vec loss(1);
  backend::Host<double> be;
  REQUIRE_THROWS_WITH(TokenModel::loss::forward(be, ConstView<double>{logits.data(), Shape{4, 5}}, lv,
                                                TensorView<double>{loss.data(), Shape{1}}, 4),
                      Contains("SoftmaxCrossEntropy<4>") && Contains("(4, 5)") && Contains("(4,)"));
}
