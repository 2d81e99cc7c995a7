// SPDX-License-Identifier: Apache-2.0
// The mixture-of-experts layer (layers/moe.hpp, moe/routing.hpp) on the host in float64:
// - its gradients (parameters and input) against central finite differences of the output and the
//   auxiliary losses together, top-1 and top-2, dropless and with a capacity that drops;
// - its output against a per-token reference written from the definition (no sorting);
// - microbatches of whole sequences add up to the batch (the capacity and the balance loss are per
//   sequence), so a pipeline's schedules and expert parallelism see the same routing;
// - inside a model through Network, the step's normalizer reaching the auxiliary losses;
// - expert parallelism on two threads sharing a local group (tests/support/local_expert_group.hpp)
//   against the whole layer on each rank's rows: the rows reordered through the backend's copy, the
//   all-to-alls through the group, the same outputs, input gradients and summed expert gradients;
// - the tally, and what the layer refuses.
#include <catch2/catch.hpp>

#include <cmath>
#include <array>
#include <cstdint>
#include <optional>
#include <span>
#include <vector>

#include "cupipe/backend/host/ops.hpp"
#include "cupipe/layers/layers.hpp"
#include "gradcheck.hpp"
#include "local_expert_group.hpp"

using namespace cupipe;
using cupipe::testing::dot;
using cupipe::testing::numeric_gradient;
using cupipe::testing::relative_error;
using cupipe::testing::uniform_values;

namespace {

using Vec = std::vector<double>;
constexpr index_t C = 6, H = 10, T = 5;

template <class M>
Vec random_moe_params(Rng& rng) {
  Vec p(static_cast<std::size_t>(LayerSeq<0, C, M>::param_count));
  M::init(std::span<double>(p), C, rng);
  for (double& v : p) v += rng.uniform(-0.2, 0.2);
  return p;
}

/// Runs the layer alone: forward, then backward_input and backward_weight, on `rows` rows.
template <class M>
struct Run {
  backend::Host<double> be;
  index_t rows;
  Vec y, saved, dx, grads;
  moe::Tally tally;

  Run(index_t n, index_t normalizer, std::size_t params)
      : rows(n), y(std::size_t(n * C)), saved(std::size_t(n * M::saved_per_row(C))), dx(std::size_t(n * C)), grads(params, 0.0) {
    be.aux_loss_normalizer = normalizer;
    be.moe_tally = &tally;
  }
  void forward(const Vec& p, const Vec& x) {
    M::forward(be, p.data(), ConstView<double>{x.data(), Shape{rows, C}}, TensorView<double>{y.data(), Shape{rows, C}},
               TensorView<double>{saved.data(), Shape{rows, M::saved_per_row(C)}});
  }
  void backward(const Vec& p, const Vec& x, const Vec& dy) {
    const ConstView<double> xv{x.data(), Shape{rows, C}}, dyv{dy.data(), Shape{rows, C}};
    const TensorView<double> sv{saved.data(), Shape{rows, M::saved_per_row(C)}};
    M::backward_input(be, p.data(), xv, sv, dyv, TensorView<double>{dx.data(), Shape{rows, C}});
    M::backward_weight(be, xv, sv, dyv, grads.data());
  }
};

/// d (r . y + aux) / d (parameters, input) against finite differences; returns the slots dropped.
template <class M>
std::int64_t check_moe_gradients(std::uint64_t seed, index_t sequences, index_t normalizer) {
  Rng rng(seed);
  const index_t n = sequences * T;
  Vec p = random_moe_params<M>(rng);
  Vec x = uniform_values(std::size_t(n * C), rng);
  const Vec r = uniform_values(std::size_t(n * C), rng);
  Run<M> run(n, normalizer, p.size());
  auto objective = [&] {
    run.forward(p, x);
    return dot(r, run.y) + M::aux_loss(run.saved.data(), n, normalizer);
  };
  objective();
  run.backward(p, x, r);
  CAPTURE(M::describe(), seed, n, normalizer);
  CHECK(relative_error(run.grads, numeric_gradient(p, objective)) <= 1e-6);
  CHECK(relative_error(run.dx, numeric_gradient(x, objective)) <= 1e-6);
  return run.tally.dropped;
}

double gelu(double v) { return 0.5 * v * (1 + std::tanh(0.7978845608028654 * (v + 0.044715 * v * v * v))); }

}  // namespace

TEST_CASE("MixtureOfExperts: gradients of the output and the auxiliary losses match finite differences",
          "[cpu][layers][gradcheck][moe]") {
  const auto seed = std::uint64_t(GENERATE(take(2, random(1, 1000000))));
  // Large coefficients, so that a wrong auxiliary gradient shows; a normalizer unlike the rows.
  CHECK(check_moe_gradients<MixtureOfExperts<C, H, T, moe::Routing{4, 2, 0, 0.3, 0.2}>>(seed, 2, 17) == 0);
  CHECK(check_moe_gradients<MixtureOfExperts<C, H, T, moe::Routing{4, 1, 0, 0.3, 0.2}>>(seed, 2, 10) == 0);
  CHECK(check_moe_gradients<MixtureOfExperts<C, H, T, moe::Routing{3, 3, 0, 0.3, 0.2}>>(seed, 1, 5) == 0);
  // Capacity ceil(0.5 * 5 * 2 / 4) = 2 slots per expert and sequence: 10 choices into 8 places at most.
  CHECK(check_moe_gradients<MixtureOfExperts<C, H, T, moe::Routing{4, 2, 0.5, 0.3, 0.2}>>(seed, 3, 15) >= 6);
}

TEST_CASE("MixtureOfExperts: the output is the definition's, token by token, with the capacity's drops",
          "[cpu][layers][moe]") {
  using M = MixtureOfExperts<C, H, T, moe::Routing{4, 2, 0.75, 0.01, 0.001}>;
  constexpr index_t E = 4, K = 2;
  const index_t n = 3 * T;
  Rng rng(7);
  const Vec p = random_moe_params<M>(rng);
  const Vec x = uniform_values(std::size_t(n * C), rng, -2, 2);
  Run<M> run(n, n, p.size());
  run.forward(p, x);
  run.backward(p, x, Vec(std::size_t(n * C), 1.0));

  const double* router = p.data();
  const double* w1 = router + E * C;
  const double* b1 = w1 + E * H * C;
  const double* w2 = b1 + E * H;
  const double* b2 = w2 + E * C * H;
  const index_t capacity = 2;  // ceil(0.75 * 5 * 2 / 4)
  std::vector<int> chosen(std::size_t(n * K));
  Vec gate(std::size_t(n * K));
  for (index_t t = 0; t < n; ++t) {
    Vec prob(E);
    double sum = 0;
    for (index_t e = 0; e < E; ++e) {
      double z = 0;
      for (index_t c = 0; c < C; ++c) z += x[std::size_t(t * C + c)] * router[e * C + c];
      sum += (prob[std::size_t(e)] = std::exp(z));
    }
    int first = 0, second = -1;
    for (int e = 1; e < E; ++e)
      if (prob[std::size_t(e)] > prob[std::size_t(first)]) first = e;
    for (int e = 0; e < E; ++e)
      if (e != first && (second < 0 || prob[std::size_t(e)] > prob[std::size_t(second)])) second = e;
    chosen[std::size_t(t * K)] = first;
    chosen[std::size_t(t * K + 1)] = second;
    const double picked = prob[std::size_t(first)] + prob[std::size_t(second)];
    gate[std::size_t(t * K)] = prob[std::size_t(first)] / picked;
    gate[std::size_t(t * K + 1)] = prob[std::size_t(second)] / picked;
    (void)sum;
  }
  // Per sequence, first choices in token order take the places first, then the second choices.
  std::vector<bool> kept(std::size_t(n * K));
  std::int64_t dropped = 0;
  for (index_t s0 = 0; s0 < n; s0 += T) {
    std::vector<index_t> used(E, 0);
    for (index_t j = 0; j < K; ++j)
      for (index_t t = s0; t < s0 + T; ++t) {
        const int e = chosen[std::size_t(t * K + j)];
        kept[std::size_t(t * K + j)] = used[std::size_t(e)] < capacity;
        if (kept[std::size_t(t * K + j)]) ++used[std::size_t(e)];
        else ++dropped;
      }
  }
  Vec expect(std::size_t(n * C), 0.0);
  for (index_t t = 0; t < n; ++t)
    for (index_t j = 0; j < K; ++j) {
      if (!kept[std::size_t(t * K + j)]) continue;
      const int e = chosen[std::size_t(t * K + j)];
      Vec a(H);
      for (index_t h = 0; h < H; ++h) {
        double v = b1[e * H + h];
        for (index_t c = 0; c < C; ++c) v += x[std::size_t(t * C + c)] * w1[(e * H + h) * C + c];
        a[std::size_t(h)] = gelu(v);
      }
      for (index_t c = 0; c < C; ++c) {
        double o = b2[e * C + c];
        for (index_t h = 0; h < H; ++h) o += a[std::size_t(h)] * w2[(e * C + c) * H + h];
        expect[std::size_t(t * C + c)] += gate[std::size_t(t * K + j)] * o;
      }
    }
  CHECK(dropped > 0);
  CHECK(run.tally.dropped == dropped);
  CHECK(run.tally.routed == n * K);
  std::int64_t load = 0;
  for (std::int64_t l : run.tally.load) load += l;
  CHECK(load == n * K - dropped);
  CHECK(run.tally.layers == 1);
  CHECK(run.tally.aux_loss == Approx(0.01 * run.tally.balance_loss + 0.001 * run.tally.z_loss).epsilon(1e-14));
  CHECK(run.tally.aux_loss == Approx(M::aux_loss(run.saved.data(), n, n)).epsilon(1e-14));
  CHECK(relative_error(run.y, expect) <= 1e-13);
}

TEST_CASE("MixtureOfExperts: microbatches of whole sequences add up to the batch, drops and losses included",
          "[cpu][layers][moe]") {
  using M = MixtureOfExperts<C, H, T, moe::Routing{4, 2, 0.75, 0.1, 0.05}>;
  const index_t sequences = 4, n = sequences * T;
  Rng rng(11);
  const Vec p = random_moe_params<M>(rng);
  const Vec x = uniform_values(std::size_t(n * C), rng, -2, 2);
  const Vec dy = uniform_values(std::size_t(n * C), rng);
  Run<M> whole(n, n, p.size());
  whole.forward(p, x);
  whole.backward(p, x, dy);

  Vec grads(p.size(), 0.0), y, dx;
  moe::Tally tally;
  for (index_t first : {index_t(0), index_t(1), index_t(3)}) {  // microbatches of 1, 2 and 1 sequences
    const index_t count = first == 1 ? 2 : 1;
    const auto rows = [&](const Vec& v) { return Vec(v.begin() + first * T * C, v.begin() + (first + count) * T * C); };
    Run<M> part(count * T, n, p.size());  // the step's normalizer
    part.forward(p, rows(x));
    part.backward(p, rows(x), rows(dy));
    y.insert(y.end(), part.y.begin(), part.y.end());
    dx.insert(dx.end(), part.dx.begin(), part.dx.end());
    for (std::size_t i = 0; i < grads.size(); ++i) grads[i] += part.grads[i];
    tally.add(part.tally);
  }
  CHECK(whole.tally.dropped > 0);
  CHECK(tally.dropped == whole.tally.dropped);
  CHECK(tally.load == whole.tally.load);
  CHECK(tally.aux_loss == Approx(whole.tally.aux_loss).epsilon(1e-13));
  CHECK(relative_error(y, whole.y) <= 1e-14);
  CHECK(relative_error(dx, whole.dx) <= 1e-13);
  CHECK(relative_error(grads, whole.grads) <= 1e-13);
}

TEST_CASE("MixtureOfExperts with expert parallelism: two ranks on threads equal the whole layer on each rank's rows",
          "[cpu][layers][moe][experts]") {
  // Capacity 1.25 drops some choices (dropless: capacity 0); each rank routes its own 2 sequences.
  const double capacity = GENERATE(0.0, 1.25);
  const auto check = [&]<moe::Routing R>() {
    using Whole = MixtureOfExperts<C, H, T, R>;
    using Part = MixtureOfExperts<C, H, T, R, 2>;
    const index_t n = 2 * T;
    Rng rng(21);
    const Vec p = random_moe_params<Whole>(rng);
    std::array<Vec, 2> x, dy;
    for (int t = 0; t < 2; ++t) {
      x[std::size_t(t)] = uniform_values(std::size_t(n * C), rng, -2, 2);
      dy[std::size_t(t)] = uniform_values(std::size_t(n * C), rng);
    }
    std::array<std::optional<Run<Whole>>, 2> whole;
    for (int t = 0; t < 2; ++t) {
      whole[std::size_t(t)].emplace(n, n, p.size());
      whole[std::size_t(t)]->forward(p, x[std::size_t(t)]);
      whole[std::size_t(t)]->backward(p, x[std::size_t(t)], dy[std::size_t(t)]);
    }
    testing::LocalExperts shared(2);
    std::array<std::optional<Run<Part>>, 2> part;
    std::array<std::optional<testing::LocalExpertGroup>, 2> groups;
    std::array<Vec, 2> parts;
    for (int t = 0; t < 2; ++t) {
      parts[std::size_t(t)] = testing::expert_part<Whole, Part>(p, C, t);
      groups[std::size_t(t)].emplace(shared, t);
      part[std::size_t(t)].emplace(n, n, parts[std::size_t(t)].size());
      part[std::size_t(t)]->be.expert_group = &*groups[std::size_t(t)];
    }
    testing::on_threads(2, [&](int t) {
      Run<Part>& run = *part[std::size_t(t)];
      run.forward(parts[std::size_t(t)], x[std::size_t(t)]);
      run.backward(parts[std::size_t(t)], x[std::size_t(t)], dy[std::size_t(t)]);
    });
    // Each rank's rows and the router as the whole layer has them; each rank's experts' gradients
    // summed over both ranks' tokens (the whole layer's, per rank's rows, added).
    Vec summed(p.size());
    for (std::size_t i = 0; i < p.size(); ++i) summed[i] = whole[0]->grads[i] + whole[1]->grads[i];
    for (int t = 0; t < 2; ++t) {
      CAPTURE(Part::describe(), t);
      const Run<Part>& run = *part[std::size_t(t)];
      CHECK(groups[std::size_t(t)]->all_to_alls == 4);  // dispatch and combine, forward and backward
      CHECK(run.tally.dropped == whole[std::size_t(t)]->tally.dropped);
      CHECK(run.tally.all_to_alls == 4);
      CHECK(relative_error(run.y, whole[std::size_t(t)]->y) <= 1e-13);
      CHECK(relative_error(run.dx, whole[std::size_t(t)]->dx) <= 1e-13);
      const std::size_t router = std::size_t(R.experts * C);
      const Vec own_router(whole[std::size_t(t)]->grads.begin(), whole[std::size_t(t)]->grads.begin() + std::ptrdiff_t(router));
      const Vec expert_sums = testing::expert_part<Whole, Part>(summed, C, t);
      CHECK(relative_error(Vec(run.grads.begin(), run.grads.begin() + std::ptrdiff_t(router)), own_router) <= 1e-13);
      CHECK(relative_error(Vec(run.grads.begin() + std::ptrdiff_t(router), run.grads.end()),
                           Vec(expert_sums.begin() + std::ptrdiff_t(router), expert_sums.end())) <= 1e-13);
    }
    if (R.capacity_factor > 0) CHECK(whole[0]->tally.dropped + whole[1]->tally.dropped > 0);
  };
  if (capacity > 0) check.template operator()<moe::Routing{4, 2, 1.25}>();
  else check.template operator()<moe::Routing{4, 2}>();
}

TEST_CASE("MixtureOfExperts in a model: Network's normalizer reaches the auxiliary losses, gradients match finite differences",
          "[cpu][layers][gradcheck][moe]") {
  using Model = Sequential<Linear<4, C>, Residual<LayerNorm<C>, MixtureOfExperts<C, H, T, moe::Routing{3, 2, 0, 0.3, 0.2}>>,
                           Linear<C, 3>, SoftmaxCrossEntropy<3>>;
  Network<Model, backend::Host<double>> net(5);
  moe::Tally tally;
  net.backend().moe_tally = &tally;
  Rng rng(6);
  const index_t rows = 2 * T, normalizer = 3 * T;  // a microbatch of a batch of 3 sequences
  const Vec x = uniform_values(std::size_t(rows * 4), rng);
  std::vector<std::int32_t> labels(static_cast<std::size_t>(rows));
  for (auto& l : labels) l = std::int32_t(rng.below(3));
  const ConstView<double> xv{x.data(), Shape{rows, 4}};
  const ConstView<std::int32_t> lv{labels.data(), Shape{rows}};
  Vec params = net.parameters();
  auto loss = [&] {
    net.set_parameters(params);
    net.zero_grad();
    tally = {};
    return double(net.forward_backward(xv, lv, normalizer)) + tally.aux_loss;
  };
  // What the planner prices an expert-parallel exchange by: each token's top-2 copies of C values,
  // found through the residual and the sequence that hold the layer.
  STATIC_REQUIRE(all_to_all_values_of<Model>() == 2 * C);
  STATIC_REQUIRE(all_to_all_values_of<Linear<4, C>>() == 0);
  const double at = loss();
  const Vec analytic = net.gradients();
  CHECK(tally.aux_loss > 0);
  CHECK(relative_error(analytic, numeric_gradient(params, loss)) <= 1e-6);
  CHECK(std::isfinite(at));
}

TEST_CASE("MixtureOfExperts refuses what it cannot run, with the reason", "[cpu][layers][moe][errors]") {
  using M = MixtureOfExperts<C, H, T, moe::Routing{4, 2}>;
  Rng rng(3);
  const Vec p = random_moe_params<M>(rng);
  SECTION("rows that are not whole sequences") {
    Run<M> run(T + 1, T + 1, p.size());
    const Vec x = uniform_values(std::size_t((T + 1) * C), rng);
    CHECK_THROWS_WITH(run.forward(p, x), Catch::Contains("rows are not whole sequences of 5"));
  }
  SECTION("bf16 storage") {
    backend::Host<cupipe::bfloat16, float> be;
    std::vector<cupipe::bfloat16> pb(p.size()), x(std::size_t(T * C)), y(x.size()), saved(std::size_t(T * M::saved_per_row(C)));
    CHECK_THROWS_WITH(M::forward(be, pb.data(), ConstView<cupipe::bfloat16>{x.data(), Shape{T, C}}, TensorView<cupipe::bfloat16>{y.data(), Shape{T, C}},
                                 TensorView<cupipe::bfloat16>{saved.data(), Shape{T, M::saved_per_row(C)}}),
                      Catch::Contains("runs in fp32 or fp64 storage"));
  }
  STATIC_REQUIRE(moe::Routing{8, 2, 1.25}.capacity(64) == 20);  // ceil(1.25 * 64 * 2 / 8)
  STATIC_REQUIRE(moe::Routing{8, 2, 0}.capacity(64) == 128);    // dropless: every choice fits
}
