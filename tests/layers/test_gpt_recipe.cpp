// SPDX-License-Identifier: Apache-2.0
// GPT-2's recipe in the GPT model: its initialisation (matrices N(0, 0.02), the residual projections
// N(0, 0.02 / sqrt(2 L)), biases 0, LayerNorm 1 and 0, the tied head a copy of wte), and AdamW's
// weight decay on the matrices and embeddings only (optim::DecayOn::matrices, optim::update_runs).
#include <catch2/catch.hpp>

#include "cupipe/cupipe.hpp"

#include <cmath>
#include <cstring>
#include <span>
#include <string>
#include <vector>

#include "cupipe/gpt/model.hpp"

using namespace cupipe;

namespace {

constexpr gpt::Config config{256, 16, 6, 2, 64};  // 6 blocks: the projections' std is 0.02 / sqrt(12)
using Body = gpt::Model<config>::body;

struct Moments {
  double mean = 0, std = 0;
};
Moments moments(std::span<const double> values) {
  Moments m;
  for (double v : values) m.mean += v;
  m.mean /= double(values.size());
  for (double v : values) m.std += (v - m.mean) * (v - m.mean);
  m.std = std::sqrt(m.std / double(values.size()));
  return m;
}

}  // namespace

TEST_CASE("GPT: GPT-2's initialisation, the residual projections scaled by 1/sqrt(2 L)", "[layers][gpt]") {
  std::vector<double> params(std::size_t(Body::param_count));
  Body::init(std::span<double>(params), 20261203);
  const double projection = 0.02 / std::sqrt(2.0 * double(config.layers));
  int projections = 0, matrices = 0;
  for (const ParamInfo& p : Body::parameter_table()) {
    const std::string name = gpt::nanogpt_name(config, p.name);
    INFO(name << " " << p.numel << " values");
    const std::span<const double> values(params.data() + p.offset, std::size_t(p.numel));
    const Moments m = moments(values);
    if (p.shape.rank() == 2) {
      // At least 4,096 draws each: the sample std is within 5% of the true one by a wide margin
      // (its relative error is about 1/sqrt(2 n) <= 1.1%); 0.02 and 0.02/sqrt(12) are 3.5x apart.
      const bool is_projection = name.ends_with("c_proj.weight");
      const double expected = is_projection ? projection : 0.02;
      CHECK(m.std == Approx(expected).epsilon(0.05));
      CHECK(std::abs(m.mean) < 0.1 * expected);
      projections += is_projection ? 1 : 0;
      ++matrices;
    } else {
      const bool gain = name.find("ln_") != std::string::npos && name.ends_with(".weight");
      for (double v : values) REQUIRE(v == (gain ? 1.0 : 0.0));
    }
  }
  CHECK(projections == 2 * config.layers);  // attn.c_proj and mlp.c_proj of each block
  CHECK(matrices == 2 + 4 * config.layers + 1);  // wte, wpe, 4 per block, lm_head
  // The tied head starts as a copy of wte.
  CHECK(std::memcmp(params.data() + Body::tied.first, params.data() + Body::tied.second,
                    std::size_t(Body::tied.count) * sizeof(double)) == 0);
}

TEST_CASE("AdamW with DecayOn::matrices: a zero-gradient step decays the matrices and embeddings, not biases or LayerNorm",
          "[layers][gpt][optim]") {
  std::vector<double> params(std::size_t(Body::param_count));
  Body::init(std::span<double>(params), 7);
  for (double& v : params) v += 0.5;  // biases and LayerNorm shifts away from 0, where decay would not show
  const std::vector<double> before = params;
  const std::vector<double> grads(params.size(), 0.0);
  std::vector<std::vector<double>> slots(2, std::vector<double>(params.size(), 0.0));
  const std::array<TensorView<double>, 2> views{TensorView<double>{slots[0].data(), Shape{Body::param_count}},
                                                TensorView<double>{slots[1].data(), Shape{Body::param_count}}};
  backend::Host<double> be;
  const std::vector<ParamInfo> table = Body::parameter_table();
  const std::vector<optim::DecayRun> runs = optim::decay_runs(table);
  constexpr double lr = 0.1, weight_decay = 0.5;
  const auto step = [&](optim::DecayOn on, index_t begin, index_t end) {
    const optim::AdamW adamw({.lr = lr, .weight_decay = weight_decay, .decay_on = on});
    std::vector<TensorView<double>> part;
    for (const auto& v : views) part.push_back({v.data() + begin, Shape{end - begin}});
    optim::update_runs(adamw, std::span<const optim::DecayRun>(runs), begin, be, TensorView<double>{params.data() + begin, Shape{end - begin}},
                       ConstView<double>{grads.data() + begin, Shape{end - begin}}, std::span<const TensorView<double>>(part), 0, 1.0);
  };
  // The whole array, then (a ZeRO-1 shard's view) in two parts cut inside a tensor: the same values.
  step(optim::DecayOn::matrices, 0, Body::param_count);
  const std::vector<double> whole = params;
  params = before;
  const index_t cut = table[5].offset + 3;
  step(optim::DecayOn::matrices, 0, cut);
  step(optim::DecayOn::matrices, cut, Body::param_count);
  CHECK(params == whole);

  int decayed = 0, kept = 0;
  for (const ParamInfo& p : table) {
    INFO(gpt::nanogpt_name(config, p.name));
    for (index_t i = p.offset; i < p.offset + p.numel; ++i) {
      const double expected = p.shape.rank() == 2 ? before[std::size_t(i)] * (1 - lr * weight_decay) : before[std::size_t(i)];
      REQUIRE(whole[std::size_t(i)] == expected);
    }
    (p.shape.rank() == 2 ? decayed : kept) += 1;
  }
  CHECK(decayed == 2 + 4 * config.layers + 1);
  CHECK(kept == 8 * config.layers + 2);  // per block: two LayerNorms (2 each) and four biases; ln_f (2)

  // DecayOn::all (the default, torch.optim's single group) decays every parameter.
  params = before;
  step(optim::DecayOn::all, 0, Body::param_count);
  for (std::size_t i = 0; i < params.size(); ++i) REQUIRE(params[i] == before[i] * (1 - lr * weight_decay));
}
