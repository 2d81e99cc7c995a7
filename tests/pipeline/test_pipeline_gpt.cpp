// SPDX-License-Identifier: Apache-2.0
// A small GPT (4 blocks, C 64, 4 heads, T 32, V 256) in float64 through every flush schedule at
// p = 1, 2, 4: the unpipelined Network's loss and gradients after one forward_backward, its weights
// after 3 AdamW steps, to 1e-12 relative. Microbatches are whole sequences, ragged ones included.
#include "pipeline_test_support.hpp"

#include <optional>
#include <string>

#include "cupipe/models/gpt.hpp"

namespace {

using namespace cupipe;
using test::Host;

constexpr gpt::Config config{256, 32, 4, 4, 64};
using Gpt = gpt::Model<config>;
using Reference = Network<Gpt, Host>;
constexpr std::uint64_t seed = 20261124;
constexpr double tolerance = 1e-12;
constexpr index_t T = config.context;

/// `sequences` windows of T + 1 tokens: inputs are the first T, labels the last T (the next token).
struct TokenBatch {
  std::vector<std::int32_t> ids, labels;
  index_t rows = 0;
  TokenBatch(index_t sequences, std::uint64_t salt) : rows(sequences * T) {
    Rng rng(salt);
    for (index_t s = 0; s < sequences; ++s) {
      std::vector<std::int32_t> window(std::size_t(T + 1));
      for (auto& t : window) t = std::int32_t(rng.below(std::uint64_t(config.vocab)));
      ids.insert(ids.end(), window.begin(), window.end() - 1);
      labels.insert(labels.end(), window.begin() + 1, window.end());
    }
  }
  ConstView<std::int32_t> x() const { return {ids.data(), Shape{rows, 1}}; }
  ConstView<std::int32_t> y() const { return {labels.data(), Shape{rows}}; }
};

template <class Policy, int P>
void check_against_network() {
  using Stages = partition<Gpt, P * Policy::chunks>;
  using Pipe = Pipeline<Stages, Policy, Host>;
  static_assert(Pipe::rows_per_sample == T);
  constexpr int m = 4;
  INFO(Policy::name << " p = " << P << " m = " << m);
  const optim::AdamW adamw({.lr = 3e-3, .weight_decay = 0.1, .clip_norm = 1.0});
  PipelineOptions options;
  options.microbatches = m;
  options.seed = seed;
  std::optional<Pipe> pipe;
  pipe.emplace(options);
  Reference net(seed);
  REQUIRE(test::bitwise_equal(pipe->parameters(), net.parameters()));

  // 6 sequences in 4 microbatches: 2, 2, 1, 1 sequences, never a cut inside one.
  const TokenBatch batch(6, 11);
  const StepStats stats = test::bounded(120, [&] { return pipe->forward_backward(batch.x(), batch.y()); });
  const double loss = net.forward_backward(batch.x(), batch.y());
  CHECK(std::abs(stats.loss - loss) <= tolerance * std::abs(loss));
  CHECK(test::relative_difference(pipe->gradients(), net.gradients()) <= tolerance);
  CHECK(stats.samples == batch.rows);

  pipe.emplace(options);
  Reference trained(seed);
  std::vector<std::vector<double>> slots;
  for (int step = 0; step < 3; ++step) {
    const TokenBatch b(4, 100 + std::uint64_t(step));
    const StepStats s = test::bounded(120, [&] { return pipe->train_step(b.x(), b.y(), adamw); });
    trained.zero_grad();
    const double l = trained.forward_backward(b.x(), b.y());
    CHECK(std::abs(s.loss - l) <= tolerance * std::abs(l));
    const double norm = test::reference_update(trained, adamw, slots, step);
    CHECK(s.grad_norm == Approx(norm).epsilon(1e-12));
  }
  CHECK(test::relative_difference(pipe->parameters(), trained.parameters()) <= tolerance);
  CHECK(test::relative_difference(pipe->optimizer_state(1), slots[1]) <= tolerance);
}

template <class Policy>
void check_every_p() {
  check_against_network<Policy, 1>();
  check_against_network<Policy, 2>();
  check_against_network<Policy, 4>();
}

}  // namespace

TEST_CASE("GPT: GPipe and 1F1B equal the unpipelined Network at p = 1, 2, 4", "[pipeline][equivalence][gpt]") {
  check_every_p<schedule::GPipe>();
  check_every_p<schedule::OneFOneB>();
}

TEST_CASE("GPT: Interleaved<2> equals the unpipelined Network at p = 1, 2, 4", "[pipeline][equivalence][gpt]") {
  check_every_p<schedule::Interleaved<2>>();
}

TEST_CASE("GPT: ZB-H1 and ZB-H2 (B and W split in every layer) equal the Network at p = 1, 2, 4",
          "[pipeline][equivalence][gpt]") {
  check_every_p<schedule::ZeroBubbleH1>();
  check_every_p<schedule::ZeroBubbleH2>();
}

TEST_CASE("GPT: a batch that is not whole sequences, or too few of them, is refused with the reason",
          "[pipeline][gpt][errors]") {
  PipelineOptions options;
  options.microbatches = 4;
  Pipeline<partition<Gpt, 2>, schedule::OneFOneB, Host> pipe(options);
  const TokenBatch batch(3, 1);
  CHECK_THAT(test::error_message([&] { pipe.forward_backward(batch.x(), batch.y()); }),
             Catch::Contains("a batch of 3 samples cannot be split into 4 microbatches"));
  const ConstView<std::int32_t> cut{batch.ids.data(), Shape{T + 5, 1}};
  const ConstView<std::int32_t> cut_labels{batch.labels.data(), Shape{T + 5}};
  CHECK_THAT(test::error_message([&] { pipe.forward_backward(cut, cut_labels); }),
             Catch::Contains("a batch of 37 rows is not whole samples of 32 rows"));
  std::vector<double> out(std::size_t((T + 5) * config.vocab));
  CHECK_THAT(test::error_message([&] { pipe.predict(cut, TensorView<double>{out.data(), Shape{T + 5, config.vocab}}); }),
             Catch::Contains("the input's 37 rows are not whole samples of 32 rows"));
}
