// SPDX-License-Identifier: Apache-2.0
// FP8 training on the host (issue #59). Oracles:
// - each GEMM of backend::HostFp8<Recipe> against the recipe's primitives (fp8::quantize,
//   DelayedScaling, fp8::gemm_nt), which test_fp8_blocks.cpp checks against float64; bitwise, since
//   the arithmetic is the same;
// - a GPT pipeline in FP8 against the unpipelined Network in FP8 (bit for bit with one microbatch);
// - a GPT's loss curve in FP8 against bf16's.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "cupipe/backend/host/fp8.hpp"
#include "gpt_test_support.hpp"
#include "transposed.hpp"

using namespace cupipe;
using namespace cupipe::test;
using cupipe::testing::transposed;

namespace {

// OpenBLAS's cblas.h declares a ::bfloat16 of its own, so cupipe's is named in full.
using BF = cupipe::bfloat16;
using Bf16 = backend::Host<BF, float>;
using Block = backend::HostFp8<fp8::Blockwise>;
using Delayed = backend::HostFp8<fp8::PerTensorDelayed>;
using ops::Transpose;
using fp8::GemmRole;

std::vector<BF> random_bf16(index_t n, std::uint64_t seed, double scale) {
  Rng rng(seed);
  std::vector<BF> v(static_cast<std::size_t>(n));
  for (BF& x : v) x = BF(float(rng.uniform(-scale, scale)));
  return v;
}

std::vector<float> widen(const std::vector<BF>& v) {
  std::vector<float> out;
  for (const BF x : v) out.push_back(float(x));
  return out;
}

template <class T>
ConstView<T> cview(const std::vector<T>& v, index_t rows, index_t cols) {
  return {v.data(), Shape{rows, cols}};
}
template <class T>
TensorView<T> view(std::vector<T>& v, index_t rows, index_t cols) {
  return {v.data(), Shape{rows, cols}};
}

std::vector<BF> rounded(const std::vector<float>& v) {
  std::vector<BF> out;
  for (const float x : v) out.push_back(BF(x));
  return out;
}

template <class Format>
float largest(const std::vector<float>& v) {
  float amax = 0;
  for (const float x : v) amax = std::max(amax, std::abs(x));
  return amax / float(Format::max);
}

}  // namespace

TEST_CASE("fp8 block recipe: each GEMM of a layer quantises its operands as DeepSeek-V3's recipe does", "[cpu][fp8]") {
  // 3 blocks of k along the 300 features (the last 44 wide), 2 blocks of the 130 outputs.
  const index_t rows = 5, in = 300, out = 130;
  const std::vector<BF> x = random_bf16(rows * in, 1, 1.0), w = random_bf16(out * in, 2, 0.05),
                        dy = random_bf16(rows * out, 3, 1e-3);
  const std::vector<float> xf = widen(x), wf = widen(w), dyf = widen(dy);
  Block be;
  Bf16 bf16;
  std::vector<float> e;
  SECTION("forward: x in 1 x 128 tiles, W in 128 x 128 blocks, E4M3, y rounded once") {
    std::vector<BF> y(std::size_t(rows * out)), y16(y.size());
    ops::gemm(be, Transpose::no, Transpose::yes, BF(1), cview(x, rows, in), cview(w, out, in), BF(0), view(y, rows, out));
    e.resize(y.size());
    fp8::gemm_nt(fp8::quantize<fp8::ActivationTiles>(cview(xf, rows, in)),
                 fp8::quantize<fp8::WeightBlocks>(cview(wf, out, in)), view(e, rows, out));
    CHECK(same_bits(y, rounded(e)));
    ops::gemm(bf16, Transpose::no, Transpose::yes, BF(1), cview(x, rows, in), cview(w, out, in), BF(0), view(y16, rows, out));
    CHECK_FALSE(same_bits(y, y16));  // the product was taken in FP8, not in bf16
    // A bias is added in fp32 to the FP8 product, and y rounded once.
    const std::vector<BF> bias = random_bf16(out, 4, 0.5);
    ops::gemm_bias(be, Transpose::no, Transpose::yes, BF(1), cview(x, rows, in), cview(w, out, in),
                   ConstView<BF>{bias.data(), Shape{out}}, view(y, rows, out));
    for (index_t i = 0; i < rows * out; ++i) e[std::size_t(i)] += float(bias[std::size_t(i % out)]);
    CHECK(same_bits(y, rounded(e)));
  }
  SECTION("input gradient: dy in 1 x 128 tiles, W^T in 128 x 128 blocks") {
    std::vector<BF> dx(std::size_t(rows * in));
    ops::gemm(be, Transpose::no, Transpose::no, BF(1), cview(dy, rows, out), cview(w, out, in), BF(0), view(dx, rows, in));
    e.resize(dx.size());
    fp8::gemm_nt(fp8::quantize<fp8::ActivationTiles>(cview(dyf, rows, out)),
                 fp8::quantize<fp8::WeightBlocks>(cview(transposed(wf, out, in), in, out)), view(e, rows, in));
    CHECK(same_bits(dx, rounded(e)));
  }
  SECTION("weight gradient: dy^T and x^T both in 1 x 128 tiles along the rows, added into fp32") {
    std::vector<float> dw(std::size_t(out * in), 0.25f);
    ops::gemm(be, Transpose::yes, Transpose::no, BF(1), cview(dy, rows, out), cview(x, rows, in), BF(1), view(dw, out, in));
    e.resize(dw.size());
    fp8::gemm_nt(fp8::quantize<fp8::ActivationTiles>(cview(transposed(dyf, rows, out), out, rows)),
                 fp8::quantize<fp8::ActivationTiles>(cview(transposed(xf, rows, in), in, rows)), view(e, out, in));
    for (float& v : e) v = v + 0.25f;
    CHECK(same_bits(dw, e));
  }
  SECTION("no layer multiplies two transposes, and the sizes must agree") {
    std::vector<BF> c(std::size_t(in * in));
    CHECK_THROWS_WITH(ops::gemm(be, Transpose::yes, Transpose::yes, BF(1), cview(x, rows, in), cview(x, in, rows), BF(0),
                                view(c, in, in)),
                      Catch::Contains("both transposed is none of them"));
    std::vector<BF> y(std::size_t(rows * rows));
    CHECK_THROWS_WITH(ops::gemm(be, Transpose::no, Transpose::yes, BF(1), cview(x, rows, in), cview(dy, rows, out), BF(0),
                                view(y, rows, rows)),
                      Catch::Contains("the inner sizes differ"));
  }
}

TEST_CASE("fp8 delayed recipe: one scale per operand from its own history, E5M2 for the gradient", "[cpu][fp8]") {
  const index_t rows = 4, in = 8, out = 6;
  const std::vector<BF> x = random_bf16(rows * in, 5, 1.0), w = random_bf16(out * in, 6, 0.3),
                        dy = random_bf16(rows * out, 7, 1e-3);
  const std::vector<float> xf = widen(x), wf = widen(w);
  std::vector<BF> x2 = x;
  for (BF& v : x2) v = BF(2 * float(v));
  const std::vector<float> x2f = widen(x2);
  Delayed be;
  const void* key = w.data();
  CHECK(be.fp8.scale(key, GemmRole::forward, true) == 1.0f);  // never run
  std::vector<BF> y(std::size_t(rows * out));
  std::vector<float> e(y.size());
  const auto forward = [&](const std::vector<BF>& input) {
    ops::gemm(be, Transpose::no, Transpose::yes, BF(1), cview(input, rows, in), cview(w, out, in), BF(0), view(y, rows, out));
  };
  // Step 1 has no history: each operand is scaled by its own amax, call by call.
  const auto own = [&](const std::vector<float>& v, index_t r, index_t c) {
    fp8::DelayedScaling<float8_e4m3> h(1);
    h.record(fp8::amax_of(cview(v, r, c)));
    return h.quantize(cview(v, r, c));
  };
  forward(x);
  fp8::gemm_nt(own(xf, rows, in), own(wf, out, in), view(e, rows, out));
  CHECK(same_bits(y, rounded(e)));
  forward(x2);
  fp8::gemm_nt(own(x2f, rows, in), own(wf, out, in), view(e, rows, out));
  CHECK(same_bits(y, rounded(e)));
  CHECK(be.fp8.scale(key, GemmRole::forward, true) == 1.0f);  // nothing is recorded before the step ends
  backend::end_step(be);
  // The step's largest amax of each operand is recorded.
  CHECK(be.fp8.scale(key, GemmRole::forward, true) == largest<float8_e4m3>(x2f));
  CHECK(be.fp8.scale(key, GemmRole::forward, false) == largest<float8_e4m3>(wf));

  // Step 2 scales by the history, and keeps that scale through the step: four times x saturates.
  fp8::DelayedScaling<float8_e4m3> hx(fp8::PerTensorDelayed::history), hw(fp8::PerTensorDelayed::history);
  hx.record(fp8::amax_of(cview(x2f, rows, in)));
  hw.record(fp8::amax_of(cview(wf, out, in)));
  std::vector<BF> x4 = x2;
  for (BF& v : x4) v = BF(2 * float(v));
  const std::vector<float> x4f = widen(x4);
  for (const std::vector<BF>* input : {&x, static_cast<const std::vector<BF>*>(&x4)}) {
    forward(*input);
    const auto q = hx.quantize(cview(widen(*input), rows, in));
    fp8::gemm_nt(q, hw.quantize(cview(wf, out, in)), view(e, rows, out));
    CHECK(same_bits(y, rounded(e)));
    if (input == &x4)
      CHECK(std::count_if(q.codes.begin(), q.codes.end(), [](float8_e4m3 c) { return std::abs(float(c)) == 448.0f; }) > 1);
  }
  backend::end_step(be);
  CHECK(be.fp8.scale(key, GemmRole::forward, true) == largest<float8_e4m3>(x4f));  // the history now holds it
  backend::end_step(be);  // a step without GEMMs records nothing
  CHECK(be.fp8.scale(key, GemmRole::forward, true) == largest<float8_e4m3>(x4f));

  // The input gradient: dy in E5M2 with a history of its own.
  std::vector<BF> dx(std::size_t(rows * in));
  ops::gemm(be, Transpose::no, Transpose::no, BF(1), cview(dy, rows, out), cview(w, out, in), BF(0), view(dx, rows, in));
  backend::end_step(be);
  CHECK(be.fp8.scale(key, GemmRole::input_grad, true) == largest<float8_e5m2>(widen(dy)));
  // Another layer's weight has histories of its own.
  const std::vector<BF> w2 = w;
  CHECK(be.fp8.scale(w2.data(), GemmRole::forward, true) == 1.0f);
}

namespace {

/// Rank 0 of a group of two whose other rank brings `theirs` (its amaxes, or as many of them as it
/// has): each sum adds what that rank's slot holds, as an MPI sum of the two ranks' buffers does.
class OtherRank final : public TensorGroup {
 public:
  explicit OtherRank(std::vector<float> theirs) : theirs_(std::move(theirs)) {}
  int size() const override { return 2; }
  int rank() const override { return 0; }
  void sum(double* data, std::size_t n) override {
    REQUIRE(n == 2);
    data[1] += double(theirs_.size());
  }
  void sum(float* data, std::size_t n) override {
    REQUIRE(n == 2 * theirs_.size());
    for (std::size_t i = 0; i < theirs_.size(); ++i) data[theirs_.size() + i] += theirs_[i];
  }

 private:
  std::vector<float> theirs_;
};

}  // namespace

TEST_CASE("fp8 delayed recipe: a step's amaxes are the largest over the tensor-parallel group", "[cpu][fp8]") {
  const index_t rows = 4, in = 8, out = 6;
  const std::vector<BF> x = random_bf16(rows * in, 5, 1.0), w = random_bf16(out * in, 6, 0.3);
  const std::vector<float> xf = widen(x), wf = widen(w);
  std::vector<BF> y(std::size_t(rows * out));
  Delayed be;
  ops::gemm(be, Transpose::no, Transpose::yes, BF(1), cview(x, rows, in), cview(w, out, in), BF(0), view(y, rows, out));
  const float ax = fp8::amax_of(cview(xf, rows, in)), aw = fp8::amax_of(cview(wf, out, in));
  SECTION("the other rank's larger amax of A wins; this rank's of B") {
    OtherRank other({3 * ax, aw / 2});
    be.tensor_group = &other;
    backend::end_step(be);
    CHECK(be.fp8.scale(w.data(), GemmRole::forward, true) == 3 * ax / 448.0f);
    CHECK(be.fp8.scale(w.data(), GemmRole::forward, false) == aw / 448.0f);
  }
  SECTION("an operand only the other rank used is recorded too; one neither used is not") {
    OtherRank other({-1.0f, 2 * aw});
    be.tensor_group = &other;
    backend::end_step(be);
    CHECK(be.fp8.scale(w.data(), GemmRole::forward, true) == ax / 448.0f);
    CHECK(be.fp8.scale(w.data(), GemmRole::forward, false) == 2 * aw / 448.0f);
  }
  SECTION("ranks with other tensors fail, naming the reduction, instead of mixing amaxes") {
    OtherRank other({ax, aw, ax, aw});
    be.tensor_group = &other;
    REQUIRE_THROWS_WITH(backend::end_step(be),
                        Catch::Contains("fp8 delayed scaling: the step's amax reduction over the tensor-parallel group (2 ranks") &&
                            Catch::Contains("rank 1 of the group has 4 FP8 operands and rank 0 has 2"));
    CHECK(be.fp8.scale(w.data(), GemmRole::forward, true) == 1.0f);  // nothing recorded
  }
}

TEST_CASE("fp8 delayed recipe: a GPT pipeline under GPipe and 1F1B is the FP8 Network", "[cpu][fp8][pipeline][gpt]") {
  // One scale per tensor for the whole step, so the schedule's order of GEMMs changes nothing: with
  // one microbatch the pipeline is the Network bit for bit. With two, the first step scales each
  // microbatch by its own amax where the Network scales the batch by the batch's, and the sums over
  // microbatches differ: per-tensor FP8 accuracy (1.8% on the weights after three AdamW steps).
  check_gpt_pipeline_against_network<Delayed, schedule::GPipe, 2>(1e-2, 3e-2);
  check_gpt_pipeline_against_network<Delayed, schedule::OneFOneB, 2>(1e-2, 3e-2);
}

TEST_CASE("fp8 block recipe: a GPT pipeline under GPipe and 1F1B is the FP8 Network", "[cpu][fp8][pipeline][gpt]") {
  // With two microbatches the weight gradient's tiles along the rows and the sums over
  // microbatches differ: FP8 accuracy.
  check_gpt_pipeline_against_network<Block, schedule::GPipe, 2>(1e-2, 1e-2);
  check_gpt_pipeline_against_network<Block, schedule::OneFOneB, 2>(1e-2, 1e-2);
}

TEST_CASE("fp8 delayed recipe: GPipe and 1F1B train the same bits, whatever order their GEMMs run in, and evaluating "
          "between steps changes nothing",
          "[cpu][fp8][pipeline][gpt]") {
  // The scales are fixed for a step and each (tensor, role) has its own history, so the two
  // schedules' different interleavings of forwards and backwards quantise alike (two microbatches:
  // each weight gradient is the sum of two terms, the same in either order).
  using Stages = partition<SmallGpt, 2>;
  Pipeline<Stages, schedule::GPipe, Delayed> gpipe({.microbatches = 2, .seed = 5});
  Pipeline<Stages, schedule::OneFOneB, Delayed> one_f_one_b({.microbatches = 2, .seed = 5});
  const optim::AdamW adamw({.lr = 3e-3});
  const PlusThree rule(4 * small_gpt.context);
  // GPipe also evaluates other tokens before and between its steps: inference leaves the step's
  // amaxes alone (backend::Inference), so that changes nothing either.
  const PlusThree other(2 * small_gpt.context, 99);
  std::vector<BF> logits(std::size_t(2 * small_gpt.context * small_gpt.vocab));
  for (int step = 0; step < 3; ++step) {
    gpipe.predict(other.x(), TensorView<BF>{logits.data(), Shape{2 * small_gpt.context, small_gpt.vocab}});
    const StepStats a = gpipe.train_step(rule.x(), rule.y(), adamw), b = one_f_one_b.train_step(rule.x(), rule.y(), adamw);
    CHECK(a.loss == b.loss);
  }
  CHECK(same_bits(gpipe.parameters(), one_f_one_b.parameters()));
}

TEST_CASE("fp8: a tied GPT trains along bf16's loss curve under both recipes", "[cpu][fp8][training][gpt]") {
  Network<SmallGpt, Bf16> net16(6);
  Network<SmallGpt, Block> block(0);
  Network<SmallGpt, Delayed> delayed(0);
  block.set_parameters(net16.parameters());
  delayed.set_parameters(net16.parameters());
  const PlusThree rule(4 * small_gpt.context);
  const ConstView<std::int32_t> x = rule.x(), y = rule.y();
  const optim::AdamW adamw({.lr = 1e-2});
  std::vector<std::vector<float>> s16, sb, sd;
  double first = 0, last16 = 0, differs = 0;
  const auto step_of = [&](auto& net, auto& slots, int step) {
    net.zero_grad();
    const double loss = net.forward_backward(x, y);
    net.sum_tied_gradients();
    network_adamw_step(net, adamw, slots, step);
    return loss;
  };
  for (int step = 0; step < 30; ++step) {
    last16 = step_of(net16, s16, step);
    const double lb = step_of(block, sb, step), ld = step_of(delayed, sd, step);
    if (step == 0) first = last16;
    INFO("step " << step << ": bf16 " << last16 << ", fp8 block " << lb << ", fp8 delayed " << ld);
    CHECK(std::abs(lb - last16) <= 0.05 * last16 + 0.02);
    CHECK(std::abs(ld - last16) <= 0.05 * last16 + 0.02);
    differs = std::max({differs, std::abs(lb - last16), std::abs(ld - last16)});
  }
  CHECK(last16 < 0.5 * first);  // it learned the rule, so tracking the curve means something
  CHECK(differs > 0);           // and FP8 changed the arithmetic
}
