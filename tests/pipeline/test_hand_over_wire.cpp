// SPDX-License-Identifier: Apache-2.0
// Compressed hand-overs (PipelineOptions::hand_over, pipeline/hand_over_wire.hpp) against the plain
// path. The oracle: the same layers at full precision with a layer at each compressed link that
// does what the link does, rounding the activation in forward and the input gradient in backward.
// Its losses, gradients and weights after three AdamW steps must equal the compressed pipeline's
// bitwise: the arithmetic is the same, only where the rounding happens differs.
#include "pipeline_test_support.hpp"

namespace {

using namespace cupipe;
using test::Batch;
using test::Entry;
using test::Host;

/// y = x and dx = dy as a hand-over of precision W delivers them.
template <Wire W>
struct WireLayer : LayerDefaults {
  template <class B, class T>
  static void forward(B& be, const T*, ConstViewOn<B, T> x, ViewOn<B, T> y, ViewOn<B, T>) {
    wire_round_trip(be, x, y, W);
  }
  template <class B, class T>
  static void backward_input(B& be, const T*, ConstViewOn<B, T>, ConstViewOn<B, T>, ConstViewOn<B, T> dy, ViewOn<B, T> dx) {
    wire_round_trip(be, dy, dx, W);
  }
  static std::string describe() { return "WireLayer<" + std::string(name(W)) + ">"; }
};

using First = Stage<Entry<4>, Linear<4, 8>, ReLU>;
using Compressed = StageList<First, Stage<Linear<8, 8>, ReLU>, Stage<Linear<8, 8>, ReLU>, Stage<Linear<8, 4>>>;
// Links 0-1 full, 1-2 e4m3, 2-3 bf16, as the oracle's layers say.
using Oracle = StageList<First, Stage<Linear<8, 8>, ReLU>, Stage<WireLayer<Wire::e4m3>, Linear<8, 8>, ReLU>,
                         Stage<WireLayer<Wire::bf16>, Linear<8, 4>>>;

template <class Schedule>
void check_against_oracle() {
  PipelineOptions compressed_options;
  compressed_options.microbatches = 4;
  compressed_options.seed = 5;
  compressed_options.hand_over = {Wire::full, Wire::e4m3, Wire::bf16};
  PipelineOptions plain_options = compressed_options;
  plain_options.hand_over = {};
  Pipeline<Compressed, Schedule, Host> compressed(compressed_options), plain(plain_options);
  Pipeline<Oracle, Schedule, Host> oracle(plain_options);
  oracle.set_parameters(compressed.parameters());
  const optim::AdamW adamw({.lr = 1e-2});
  bool differs_from_plain = false;
  for (int step = 0; step < 3; ++step) {
    const Batch b = test::make_batch(16, 4, 4, 40 + std::uint64_t(step));
    const StepStats c = test::bounded(30, [&] { return compressed.train_step(b.inputs(), b.targets(), adamw); });
    const StepStats o = test::bounded(30, [&] { return oracle.train_step(b.inputs(), b.targets(), adamw); });
    const StepStats p = test::bounded(30, [&] { return plain.train_step(b.inputs(), b.targets(), adamw); });
    CHECK(c.loss == o.loss);
    CHECK(c.grad_norm == o.grad_norm);
    differs_from_plain = differs_from_plain || c.loss != p.loss;
    CHECK(std::abs(c.loss - p.loss) <= 0.05 * std::abs(p.loss));  // close to the plain path, not far
  }
  CHECK(compressed.parameters() == oracle.parameters());
  CHECK(differs_from_plain);  // the links did round
}

TEST_CASE("compressed hand-overs equal rounding layers at the links, bitwise (1F1B, GPipe, ZB-H1)",
          "[pipeline][hand_over]") {
  check_against_oracle<schedule::OneFOneB>();
  check_against_oracle<schedule::GPipe>();
  check_against_oracle<schedule::ZeroBubbleH1>();
}

TEST_CASE("compressed links move their packed bytes: a quarter and a half of full messages plus headers",
          "[pipeline][hand_over]") {
  // 16 rows in 4 microbatches of 4; every link carries 4 x 8 = 32 doubles (256 bytes) per message.
  // e4m3 packs them into an 8-byte header and 32 codes (40 bytes, 5 doubles); bf16 into 64 bytes.
  PipelineOptions options;
  options.microbatches = 4;
  options.hand_over = {Wire::full, Wire::e4m3, Wire::bf16};
  Pipeline<Compressed, schedule::OneFOneB, Host> compressed(options);
  options.hand_over = {};
  Pipeline<Compressed, schedule::OneFOneB, Host> plain(options);
  const Batch b = test::make_batch(16, 4, 4, 3);
  const optim::SGD sgd({.lr = 0.1});
  for (int step = 0; step < 2; ++step) {  // the second step reuses the first's buffers
    const StepStats c = test::bounded(30, [&] { return compressed.train_step(b.inputs(), b.targets(), sgd); });
    const StepStats p = test::bounded(30, [&] { return plain.train_step(b.inputs(), b.targets(), sgd); });
    // Worker 0 sends activations over the full link; 1 activations over e4m3 and gradients over full;
    // 2 activations over bf16 and gradients over e4m3; 3 gradients over bf16.
    CHECK(p.sent_bytes == std::vector<std::int64_t>{4 * 256, 8 * 256, 8 * 256, 4 * 256});
    CHECK(c.sent_bytes == std::vector<std::int64_t>{4 * 256, 4 * 40 + 4 * 256, 4 * 64 + 4 * 40, 4 * 64});
  }
}

TEST_CASE("a packed e4m3 link with a non-finite activation delivers NaN, which the finite check reports",
          "[pipeline][hand_over]") {
  PipelineOptions options;
  options.microbatches = 2;
  options.hand_over = {Wire::e4m3};
  Pipeline<Compressed, schedule::OneFOneB, Host> pipe(options);
  Batch b = test::make_batch(8, 4, 4, 3);
  b.x[0] = std::numeric_limits<double>::infinity();
  const std::string message = test::error_message([&] {
    test::bounded(30, [&] { return pipe.train_step(b.inputs(), b.targets(), optim::SGD({.lr = 0.1})); });
  });
  CHECK_THAT(message, Catch::Contains("finite"));
}

TEST_CASE("hand_over with a wrong number of links is refused naming the counts", "[pipeline][hand_over]") {
  PipelineOptions options;
  options.microbatches = 2;
  options.hand_over = {Wire::bf16, Wire::bf16};
  const std::string message = test::error_message([&] { Pipeline<Compressed, schedule::OneFOneB, Host> pipe(options); });
  CHECK_THAT(message, Catch::Contains("2 entries for 4 virtual stages"));
  CHECK_THAT(message, Catch::Contains("one per link between neighbouring virtual stages (3)"));
}

TEST_CASE("one hand_over entry applies to every link", "[pipeline][hand_over]") {
  using All = StageList<First, Stage<WireLayer<Wire::bf16>, Linear<8, 8>, ReLU>, Stage<WireLayer<Wire::bf16>, Linear<8, 8>, ReLU>,
                        Stage<WireLayer<Wire::bf16>, Linear<8, 4>>>;
  PipelineOptions options;
  options.microbatches = 4;
  options.hand_over = {Wire::bf16};
  Pipeline<Compressed, schedule::OneFOneB, Host> compressed(options);
  options.hand_over = {};
  Pipeline<All, schedule::OneFOneB, Host> oracle(options);
  oracle.set_parameters(compressed.parameters());
  const Batch b = test::make_batch(8, 4, 4, 9);
  const optim::SGD sgd({.lr = 0.1});
  CHECK(test::bounded(30, [&] { return compressed.train_step(b.inputs(), b.targets(), sgd); }).loss ==
        test::bounded(30, [&] { return oracle.train_step(b.inputs(), b.targets(), sgd); }).loss);
  CHECK(compressed.parameters() == oracle.parameters());
}

}  // namespace
