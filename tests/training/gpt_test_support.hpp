// SPDX-License-Identifier: Apache-2.0
// Shared by the GPT tests of test_precision (bf16) and test_fp8 (FP8): the small tied GPT, a rule it
// learns, and a pipeline of it against the unpipelined Network on the same backend.
#pragma once

#include <cstdint>
#include <vector>

#include "cupipe/gpt/model.hpp"
#include "gradcheck.hpp"
#include "training_test_support.hpp"

namespace cupipe::test {

/// The small tied GPT of every GPT case: vocabulary 64, context 16, 2 blocks, 2 heads, 32 channels.
inline constexpr gpt::Config small_gpt{64, 16, 2, 2, 32};
using SmallGpt = gpt::Model<small_gpt>;

/// Something to learn: `rows` random token ids, each labelled with the id plus 3 (mod the vocabulary).
struct PlusThree {
  std::vector<std::int32_t> ids, labels;
  explicit PlusThree(index_t rows, std::uint64_t seed = 10) : ids(std::size_t(rows)), labels(std::size_t(rows)) {
    Rng rng(seed);
    for (auto& v : ids) v = std::int32_t(rng.below(small_gpt.vocab));
    for (std::size_t i = 0; i < ids.size(); ++i) labels[i] = std::int32_t((ids[i] + 3) % small_gpt.vocab);
  }
  ConstView<std::int32_t> x() const { return {ids.data(), Shape{index_t(ids.size()), 1}}; }
  ConstView<std::int32_t> y() const { return {labels.data(), Shape{index_t(labels.size())}}; }
};

/// A GPT pipeline on backend B (tied wte and lm_head on different stages, or on one worker's two
/// chunks under a V schedule) against B's Network, over three AdamW steps: bitwise with one
/// microbatch (the same ops in the same order); with two, losses within `loss_tolerance` and the
/// weights within `weight_tolerance`, relative.
template <class B, class Policy, int Units>
void check_gpt_pipeline_against_network(double loss_tolerance, double weight_tolerance) {
  using Pipe = Pipeline<partition_for<SmallGpt, Units / Policy::chunks, Policy>, Policy, B>;
  const optim::AdamW adamw({.lr = 3e-3, .weight_decay = 0.1});
  Rng rng(17);
  const auto tokens = [&](index_t sequences) {
    std::vector<std::int32_t> v(static_cast<std::size_t>(sequences * small_gpt.context));
    for (auto& id : v) id = std::int32_t(rng.below(small_gpt.vocab));
    return v;
  };
  for (const int m : {1, 2}) {
    INFO(Policy::name << " on " << Units << " stages with " << m << " microbatch(es) on " << B::name);
    if (!schedule::check<Policy>({Pipe::stages, m, Pipe::chunks, 1}).empty()) continue;
    PipelineOptions options;
    options.microbatches = m;
    options.seed = 5;
    Pipe pipe(options);
    Network<SmallGpt, B> net(5);
    REQUIRE(same_bits(pipe.parameters(), net.parameters()));
    std::vector<std::vector<float>> slots;
    for (int step = 0; step < 3; ++step) {
      const std::vector<std::int32_t> ids = tokens(2), labels = tokens(2);
      const index_t rows = index_t(ids.size());
      const ConstView<std::int32_t> x{ids.data(), Shape{rows, 1}}, y{labels.data(), Shape{rows}};
      const StepStats stats = pipe.train_step(x, y, adamw);
      net.zero_grad();
      const double loss = net.forward_backward(x, y);
      net.sum_tied_gradients();
      network_adamw_step(net, adamw, slots, step);
      if (m == 1) CHECK(stats.loss == loss);
      else CHECK(std::abs(stats.loss - loss) <= loss_tolerance * loss);
    }
    const std::vector<float> trained = pipe.parameters(), reference = net.parameters();
    if (m == 1) CHECK(same_bits(trained, reference));
    else CHECK(testing::relative_error(std::vector<double>(trained.begin(), trained.end()),
                                       std::vector<double>(reference.begin(), reference.end())) <= weight_tolerance);
  }
}

}  // namespace cupipe::test
