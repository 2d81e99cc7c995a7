// SPDX-License-Identifier: Apache-2.0
// Precision as a type (issue #12): backend::Host<bfloat16, float> stores parameters in use and
// activations in bf16 and keeps gradients, master weights, optimizer state and the loss in float.
// Oracles: the float64 model on the same bf16-rounded weights and inputs (to bf16 accuracy), the
// float model (the bf16 run must differ from it: otherwise nothing was rounded), and the unpipelined
// Network in the same precision for every synchronous schedule (bit for bit: same arithmetic order).
#include <cmath>
#include <cstring>
#include <cstdint>
#include <span>
#include <vector>

#include "gpt_test_support.hpp"
#include "gradcheck.hpp"

using namespace cupipe;
using namespace cupipe::test;

namespace {

// OpenBLAS's cblas.h declares a ::bfloat16 of its own, so cupipe's is named in full.
using BF = cupipe::bfloat16;
using Bf16 = backend::Host<BF, float>;

using cupipe::testing::relative_error;

template <class T>
std::vector<double> widen(const std::vector<T>& v) {
  std::vector<double> out;
  out.reserve(v.size());
  for (const T& x : v) out.push_back(double(x));
  return out;
}

/// The master weights rounded to bf16, as the bf16 model uses them, in another precision.
template <class T>
std::vector<T> rounded(const std::vector<float>& master) {
  std::vector<T> out;
  out.reserve(master.size());
  for (float x : master) out.push_back(T(float(BF(x))));
  return out;
}

std::vector<BF> to_bf16(const std::vector<float>& v) {
  std::vector<BF> out;
  for (float x : v) out.push_back(BF(x));
  return out;
}



}  // namespace

TEST_CASE("bf16 storage: LayerNorm and attention keep their statistics in float, aligned, as the float ops compute them",
          "[cpu][training][bf16]") {
  // Activations of 3 + 3 + 3 + 3 + 5 = 17 per row and 3 rows: an odd number of bf16 elements before
  // the saved areas, which Sequential rounds up so that a float statistic is aligned.
  using Body = Sequential<Linear<4, 3>, GELU, LayerNorm<3>, CausalSelfAttention<3, 3, 3>, Linear<3, 5>>;
  static_assert(Body::act_offsets[Body::size] % 2 == 1 && Body::saved_base % stat_slots == 0);
  constexpr index_t rows = 3;
  Bf16 be;
  backend::Host<float> f32;
  std::vector<BF> params(std::size_t(Body::param_count)), x(std::size_t(rows * 4));
  Body::init(std::span<BF>(params), 3);
  Rng rng{4};
  for (BF& v : x) v = BF(float(2 * rng.uniform() - 1));
  std::vector<BF> record(std::size_t(Body::record_elements(rows)));
  Body::forward(be, params.data(), ConstView<BF>{x.data(), Shape{rows, 4}}, record.data());

  const auto widened = [](TensorView<BF> v) {
    std::vector<float> out;
    for (index_t i = 0; i < v.numel(); ++i) out.push_back(float(v.data()[i]));
    return out;
  };
  const auto aligned = [](const float* p) { return reinterpret_cast<std::uintptr_t>(p) % alignof(float) == 0; };

  // LayerNorm (layer 2): mean and rstd are the float op's on the stored (bf16) input, bit for bit.
  const float* ln = stats_at<Bf16>(Body::saved(record.data(), rows, 2).data());
  REQUIRE(aligned(ln));
  const std::vector<float> ln_in = widened(Body::activation(record.data(), rows, 2));
  std::vector<float> gamma(3, 1.f), beta(3, 0.f), y(9), mean(3), rstd(3);
  ops::layernorm_forward(f32, ConstView<float>{ln_in.data(), Shape{rows, 3}}, ConstView<float>{gamma.data(), Shape{3}},
                         ConstView<float>{beta.data(), Shape{3}}, TensorView<float>{y.data(), Shape{rows, 3}},
                         TensorView<float>{mean.data(), Shape{rows}}, TensorView<float>{rstd.data(), Shape{rows}}, 1e-5);
  for (index_t r = 0; r < rows; ++r) {
    CAPTURE(r);
    CHECK(ln[r] == mean[std::size_t(r)]);
    CHECK(ln[rows + r] == rstd[std::size_t(r)]);
  }
  // The rounding the statistics no longer get: some of them are not bf16 values.
  bool any_unrounded = false;
  for (index_t r = 0; r < rows; ++r) any_unrounded |= float(BF(rstd[std::size_t(r)])) != rstd[std::size_t(r)];
  CHECK(any_unrounded);

  // Attention (layer 3): the log-sum-exp per head is the float op's on the stored qkv, bit for bit.
  const TensorView<BF> saved = Body::saved(record.data(), rows, 3);
  const float* lse = stats_at<Bf16>(saved.data());
  REQUIRE(aligned(lse));
  const std::vector<float> qkv = widened(TensorView<BF>{saved.data() + rows * stat_slots * 3, Shape{rows, 9}});
  std::vector<float> out(9), want(9);
  ops::causal_attention_forward(f32, ConstView<float>{qkv.data(), Shape{rows, 9}}, TensorView<float>{out.data(), Shape{rows, 3}},
                                TensorView<float>{want.data(), Shape{rows, 3}}, 3, 3);
  for (std::size_t i = 0; i < want.size(); ++i) {
    CAPTURE(i);
    CHECK(lse[i] == want[i]);
  }
}

TEST_CASE("bf16 storage: the MLP's loss and gradients are float64's on the same rounded weights, to bf16 accuracy",
          "[cpu][training][bf16]") {
  Network<Mlp, Bf16> net16(5);
  Network<Mlp, backend::Host<double>> net64(0);
  Network<Mlp, backend::Host<float>> net32(0);
  const std::vector<float> master = net16.parameters();
  net64.set_parameters(rounded<double>(master));
  net32.set_parameters(rounded<float>(master));

  const auto batch = make_batch<float>(64, 21);
  const std::vector<BF> x16 = to_bf16(batch.x);
  std::vector<double> x64;
  std::vector<float> x32;
  for (const BF& v : x16) x64.push_back(double(float(v))), x32.push_back(float(v));
  const Shape xs{batch.rows, mlp_in};

  const double loss16 = net16.forward_backward(ConstView<BF>{x16.data(), xs}, batch.targets());
  const double loss64 = net64.forward_backward(ConstView<double>{x64.data(), xs}, batch.targets());
  const double loss32 = net32.forward_backward(ConstView<float>{x32.data(), xs}, batch.targets());
  CHECK(std::abs(loss16 - loss64) <= 1e-2 * loss64);
  const std::vector<double> g16 = widen(net16.gradients()), g64 = widen(net64.gradients()), g32 = widen(net32.gradients());
  const double error16 = relative_error(g16, g64), error32 = relative_error(g32, g64);
  CAPTURE(loss16, loss64, loss32, error16, error32);
  CHECK(error16 <= 3e-2);
  CHECK(error32 <= 1e-5);
  CHECK(error16 > 100 * error32);  // the bf16 run rounded its activations: it is not the float run
}

TEST_CASE("bf16 storage: a GPT's loss and gradients (LayerNorm, attention, tied embedding) to bf16 accuracy",
          "[cpu][training][bf16][gpt]") {
  constexpr gpt::Config c = small_gpt;
  using Model = SmallGpt;
  Network<Model, Bf16> net16(3);
  Network<Model, backend::Host<double>> net64(0);
  net64.set_parameters(rounded<double>(net16.parameters()));
  Rng rng(9);
  const index_t rows = 2 * c.context;
  std::vector<std::int32_t> ids(static_cast<std::size_t>(rows)), labels(ids.size());
  for (auto& v : ids) v = std::int32_t(rng.below(c.vocab));
  for (auto& v : labels) v = std::int32_t(rng.below(c.vocab));
  const ConstView<std::int32_t> x{ids.data(), Shape{rows, 1}}, y{labels.data(), Shape{rows}};

  const double loss16 = net16.forward_backward(x, y), loss64 = net64.forward_backward(x, y);
  net16.sum_tied_gradients();
  net64.sum_tied_gradients();
  const double error = relative_error(widen(net16.gradients()), widen(net64.gradients()));
  CAPTURE(loss16, loss64, error);
  CHECK(std::abs(loss16 - loss64) <= 1e-2 * loss64);
  CHECK(error <= 5e-2);
  CHECK(error > 1e-4);
}

TEST_CASE("bf16 storage: AdamW on float master weights trains the MLP along the float run's loss curve",
          "[cpu][training][bf16]") {
  Network<Mlp, Bf16> net16(8);
  Network<Mlp, backend::Host<float>> net32(0);
  net32.set_parameters(net16.parameters());  // the same master weights; the bf16 run uses their rounding
  const optim::AdamW adamw({.lr = 1e-2});
  std::vector<std::vector<float>> slots16, slots32;
  const auto batch = make_batch<float>(96, 4);
  const std::vector<BF> x16 = to_bf16(batch.x);
  const Shape xs{batch.rows, mlp_in};
  double first = 0, last16 = 0, last32 = 0;
  for (int step = 0; step < 40; ++step) {
    net16.zero_grad();
    net32.zero_grad();
    last16 = net16.forward_backward(ConstView<BF>{x16.data(), xs}, batch.targets());
    last32 = net32.forward_backward(batch.inputs(), batch.targets());
    if (step == 0) first = last32;
    INFO("step " << step << ": bf16 " << last16 << ", float " << last32);
    CHECK(std::abs(last16 - last32) <= 0.03 * last32 + 0.01);
    network_adamw_step(net16, adamw, slots16, step);
    network_adamw_step(net32, adamw, slots32, step);
  }
  CHECK(last32 < 0.8 * first);  // it learned something, so tracking the curve means something
  // The parameters in use are the master weights' rounding.
  const std::vector<float> master = net16.parameters();
  std::vector<BF> in_use(master.size());
  net16.backend().download(net16.parameter_data(), std::span<BF>(in_use));
  int mismatched = 0;
  for (std::size_t i = 0; i < master.size(); ++i) mismatched += in_use[i].bits != BF(master[i]).bits;
  CHECK(mismatched == 0);
}

namespace {

PipelineOptions options_for(int microbatches, std::uint64_t seed) {
  PipelineOptions options;
  options.microbatches = microbatches;
  options.seed = seed;
  return options;
}


/// A pipeline in bf16 storage against the unpipelined Network in the same precision: one
/// forward_backward (loss and gradients), then three AdamW steps on the float master weights. With
/// one microbatch the arithmetic is the Network's, op for op, so everything agrees bit for bit; with
/// four the float gradients add up in another order (float accuracy).
template <class Policy, int Units>
void check_bf16_pipeline_against_network() {
  using Pipe = Pipeline<partition_for<Mlp, Units / Policy::chunks, Policy>, Policy, Bf16>;
  const optim::AdamW adamw({.lr = 1e-2});
  for (const int m : {1, 4}) {
    INFO(Policy::name << " with " << m << " microbatch(es)");
    if (!schedule::check<Policy>({Pipe::stages, m, Pipe::chunks, 1}).empty()) continue;
    const PipelineOptions options = options_for(m, 31);
    Pipe pipe(options);
    Network<Mlp, Bf16> net(31);
    REQUIRE(same_bits(pipe.parameters(), net.parameters()));

    const auto batch = make_batch<float>(16, 40 + std::uint64_t(m));
    const std::vector<BF> x = to_bf16(batch.x);
    const ConstView<BF> xs{x.data(), Shape{batch.rows, mlp_in}};
    const StepStats stats = pipe.forward_backward(xs, batch.targets());
    const double loss = net.forward_backward(xs, batch.targets());
    if (m == 1) {
      CHECK(stats.loss == loss);
      CHECK(same_bits(pipe.gradients(), net.gradients()));
    } else {
      CHECK(std::abs(stats.loss - loss) <= 1e-6 * loss);
      CHECK(relative_error(widen(pipe.gradients()), widen(net.gradients())) <= 1e-5);
    }

    Pipe trained(options);
    Network<Mlp, Bf16> reference(31);
    std::vector<std::vector<float>> slots;
    for (int step = 0; step < 3; ++step) {
      const auto b = make_batch<float>(16, 70 + std::uint64_t(step));
      const std::vector<BF> bx = to_bf16(b.x);
      const ConstView<BF> bxs{bx.data(), Shape{b.rows, mlp_in}};
      trained.train_step(bxs, b.targets(), adamw);
      reference.zero_grad();
      reference.forward_backward(bxs, b.targets());
      network_adamw_step(reference, adamw, slots, step);
    }
    if (m == 1) {
      CHECK(same_bits(trained.parameters(), reference.parameters()));
      CHECK(same_bits(trained.optimizer_state(1), slots[1]));
    } else {
      CHECK(relative_error(widen(trained.parameters()), widen(reference.parameters())) <= 1e-4);
    }
  }
}

}  // namespace

TEST_CASE("bf16 storage: AdamW on float master weights trains a tied GPT along the float run's loss curve",
          "[cpu][training][bf16][gpt]") {
  using Model = SmallGpt;
  Network<Model, Bf16> net16(6);
  Network<Model, backend::Host<float>> net32(0);
  net32.set_parameters(net16.parameters());
  const PlusThree rule(4 * small_gpt.context);
  const ConstView<std::int32_t> x = rule.x(), y = rule.y();
  const optim::AdamW adamw({.lr = 1e-2});
  std::vector<std::vector<float>> slots16, slots32;
  double first = 0, last16 = 0, last32 = 0;
  for (int step = 0; step < 30; ++step) {
    net16.zero_grad();
    net32.zero_grad();
    last16 = net16.forward_backward(x, y);
    last32 = net32.forward_backward(x, y);
    net16.sum_tied_gradients();
    net32.sum_tied_gradients();
    if (step == 0) first = last32;
    INFO("step " << step << ": bf16 " << last16 << ", float " << last32);
    CHECK(std::abs(last16 - last32) <= 0.03 * last32 + 0.01);
    network_adamw_step(net16, adamw, slots16, step);
    network_adamw_step(net32, adamw, slots32, step);
  }
  CHECK(last32 < 0.5 * first);  // it learned the rule, so tracking the curve means something
}

// Every synchronous schedule of the registry (the MLP has 4 Linear layers: 4 virtual stages, so
// chunked schedules run on 2 workers).
TEST_CASE("bf16 storage: pipelines under every synchronous schedule are the bf16 Network", "[cpu][training][bf16][pipeline]") {
  check_bf16_pipeline_against_network<schedule::GPipe, 2>();
  check_bf16_pipeline_against_network<schedule::OneFOneB, 4>();
  check_bf16_pipeline_against_network<schedule::Interleaved<2>, 4>();
  check_bf16_pipeline_against_network<schedule::BreadthFirst<2>, 4>();
  check_bf16_pipeline_against_network<schedule::ZeroBubbleH1, 4>();
  check_bf16_pipeline_against_network<schedule::ZeroBubbleH2, 4>();
  check_bf16_pipeline_against_network<schedule::ZeroBubbleV, 4>();
  check_bf16_pipeline_against_network<schedule::VHalf, 4>();
  check_bf16_pipeline_against_network<schedule::VMin, 4>();
  check_bf16_pipeline_against_network<schedule::DualPipeV, 4>();
}

TEST_CASE("bf16 storage: ZeRO-1 without replicas changes nothing (its sharded runs are MPI tests)",
          "[cpu][training][bf16][zero]") {
  using Pipe = Pipeline<partition<Mlp, 2>, schedule::OneFOneB, Bf16>;
  Pipe plain({.microbatches = 2, .seed = 5}), zero({.microbatches = 2, .seed = 5, .zero = true});
  const optim::AdamW adamw({.lr = 1e-2, .weight_decay = 0.1, .clip_norm = 0.5});
  for (int t = 0; t < 3; ++t) {
    const Batch<float> b = make_batch<float>(8, 40 + std::uint64_t(t));
    const std::vector<BF> x = to_bf16(b.x);
    plain.train_step(ConstView<BF>{x.data(), Shape{8, mlp_in}}, b.targets(), adamw);
    zero.train_step(ConstView<BF>{x.data(), Shape{8, mlp_in}}, b.targets(), adamw);
  }
  CHECK(zero.parameters() == plain.parameters());
  CHECK(zero.optimizer_state(1) == plain.optimizer_state(1));
}

// Every synchronous schedule of the registry, as for the MLP: chunked schedules on 4 virtual stages.
TEST_CASE("bf16 storage: a GPT pipeline (tied wte and lm_head) under every synchronous schedule is the bf16 Network",
          "[cpu][training][bf16][pipeline][gpt]") {
  check_gpt_pipeline_against_network<Bf16, schedule::GPipe, 2>(1e-5, 1e-4);
  check_gpt_pipeline_against_network<Bf16, schedule::OneFOneB, 2>(1e-5, 1e-4);
  check_gpt_pipeline_against_network<Bf16, schedule::Interleaved<2>, 4>(1e-5, 1e-4);
  check_gpt_pipeline_against_network<Bf16, schedule::BreadthFirst<2>, 4>(1e-5, 1e-4);
  check_gpt_pipeline_against_network<Bf16, schedule::ZeroBubbleH1, 2>(1e-5, 1e-4);
  check_gpt_pipeline_against_network<Bf16, schedule::ZeroBubbleH2, 2>(1e-5, 1e-4);
  check_gpt_pipeline_against_network<Bf16, schedule::ZeroBubbleV, 4>(1e-5, 1e-4);
  check_gpt_pipeline_against_network<Bf16, schedule::VHalf, 4>(1e-5, 1e-4);
  check_gpt_pipeline_against_network<Bf16, schedule::VMin, 4>(1e-5, 1e-4);
  check_gpt_pipeline_against_network<Bf16, schedule::DualPipeV, 4>(1e-5, 1e-4);
}

namespace {

/// The weights in use are the master weights' rounding: the pipeline's predictions (which run the
/// weights in use) equal a bf16 Network's given the pipeline's master weights, bit for bit.
template <class Pipe>
void check_weights_in_use_are_the_master_rounding(Pipe& pipe) {
  constexpr index_t rows = 12, classes = Mlp::body::out_features;
  Network<Mlp, Bf16> net(0);
  net.set_parameters(pipe.parameters());
  const auto batch = make_batch<float>(rows, 99);
  const std::vector<BF> x = to_bf16(batch.x);
  std::vector<BF> predicted(static_cast<std::size_t>(rows * classes)), expected(predicted.size());
  pipe.predict(ConstView<BF>{x.data(), Shape{rows, mlp_in}}, TensorView<BF>{predicted.data(), Shape{rows, classes}});
  net.forward(ConstView<BF>{x.data(), Shape{rows, mlp_in}}, TensorView<BF>{expected.data(), Shape{rows, classes}});
  CHECK(same_bits(predicted, expected));
}

template <class Schedule>
void train_three_steps_then_check(PipelineOptions options, const optim::AdamW& adamw) {
  Pipeline<partition<Mlp, 2>, Schedule, Bf16> pipe(options);
  for (int step = 0; step < 3; ++step) {
    const auto b = make_batch<float>(16, 200 + std::uint64_t(step));
    const std::vector<BF> x = to_bf16(b.x);
    pipe.train_step(ConstView<BF>{x.data(), Shape{b.rows, mlp_in}}, b.targets(), adamw);
  }
  CHECK(pipe.updates() > 0);
  check_weights_in_use_are_the_master_rounding(pipe);
}

}  // namespace

TEST_CASE("bf16 storage: asynchronous updates keep the weights in use the master weights' rounding",
          "[cpu][training][bf16][pipeline]") {
  const optim::AdamW adamw({.lr = 1e-2});
  SECTION("PipeDream (an update per microbatch, stashed versions)") {
    train_three_steps_then_check<schedule::PipeDream>(options_for(4, 3), adamw);
  }
  SECTION("PipeDream-2BW (an update per batch, two versions)") {
    train_three_steps_then_check<schedule::PipeDream2BW>(options_for(4, 3), adamw);
  }
}

TEST_CASE("bf16 storage: a post-validation rollback restores the master weights and their rounding",
          "[cpu][training][bf16][pipeline]") {
  // A clip norm far below the gradients' makes every update made without the global norm stand
  // corrected: each is rolled back (master weights, gradients, slots) and redone with the clip.
  const optim::AdamW clipping({.lr = 1e-2, .clip_norm = 1e-3});
  PipelineOptions options = options_for(2, 4);
  options.post_validation = true;
  using Pipe = Pipeline<partition<Mlp, 2>, schedule::OneFOneB, Bf16>;
  Pipe pipe(options);
  std::vector<std::vector<BF>> xs;
  std::vector<Batch<float>> batches;
  for (int k = 0; k < 3; ++k) {
    batches.push_back(make_batch<float>(16, 300 + std::uint64_t(k)));
    xs.push_back(to_bf16(batches.back().x));
  }
  std::vector<Pipe::Batch> group;
  for (int k = 0; k < 3; ++k) group.push_back({ConstView<BF>{xs[std::size_t(k)].data(), Shape{16, mlp_in}}, batches[std::size_t(k)].targets()});
  const std::vector<StepStats> stats = pipe.train_steps(std::span<const Pipe::Batch>(group), clipping);
  int rolled_back = 0;
  for (const StepStats& s : stats) rolled_back += s.rolled_back ? 1 : 0;
  CHECK(rolled_back > 0);
  check_weights_in_use_are_the_master_rounding(pipe);
}
