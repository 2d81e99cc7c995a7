// SPDX-License-Identifier: Apache-2.0
// backend::Cuda<bfloat16, float> against its host oracle, backend::Host<bfloat16, float> (issue #12):
// every op a bf16 pipeline runs, on the same bf16 inputs, and whole pipelines (an MLP with GELU and
// LayerNorm, a tied GPT) trained for three AdamW steps. Both read bf16, compute in fp32 and round each
// stored value to the nearest bf16; only the order of their fp32 sums differs, which can move a
// stored value to the neighbouring bf16. So: stored outputs within one bf16 ulp of the host's
// (2^-7 relative) plus fp32 noise, compute-precision outputs (gradients, statistics, the loss)
// within 1e-5 relative.
#include <catch2/catch.hpp>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "cuda_test_support.hpp"
#include "transposed.hpp"
#include "cupipe/gpt/model.hpp"

using namespace cupipe;
using namespace cupipe::testing;
using ops::Transpose;

namespace {

// OpenBLAS's cblas.h declares a ::bfloat16 of its own, so cupipe's is named in full.
using BF = cupipe::bfloat16;
using Gpu = backend::Cuda<BF, float>;
using Cpu = backend::Host<BF, float>;

std::vector<BF> random_bf16(Rng& rng, index_t n, double low = -1.0, double high = 1.0) {
  std::vector<BF> out(static_cast<std::size_t>(n));
  for (BF& v : out) v = BF(float(rng.uniform(low, high)));
  return out;
}

std::vector<double> widen(const std::vector<BF>& v) {
  std::vector<double> out;
  for (const BF& x : v) out.push_back(double(float(x)));
  return out;
}

/// Every element within `ulps` bf16 ulps of the host's (2^-8 relative each) plus 1e-6 of the largest.
bool within_bf16(const std::vector<BF>& got, const std::vector<BF>& want, double ulps = 2) {
  if (got.size() != want.size()) return false;
  const std::vector<double> g = widen(got), w = widen(want);
  double scale = 0;
  for (double x : w) scale = std::max(scale, std::abs(x));
  for (std::size_t i = 0; i < g.size(); ++i) {
    if (!std::isfinite(g[i]) || std::abs(g[i] - w[i]) > ulps * std::ldexp(std::abs(w[i]), -8) + 1e-6 * scale) {
      UNSCOPED_INFO("element " << i << ": " << g[i] << " against " << w[i]);
      return false;
    }
  }
  return true;
}

}  // namespace

TEST_CASE("Cuda<bfloat16, float>: GEMMs, bias and activations match the bf16 host backend", "[gpu][cuda][bf16]") {
  Rng rng(41);
  const index_t m = 37, k = 96, n = 24;
  Gpu gpu;
  Cpu cpu;
  const auto a = random_bf16(rng, m * k), w = random_bf16(rng, n * k), bias = random_bf16(rng, n);
  const auto dy = random_bf16(rng, m * n);
  DeviceArray<BF, Gpu> da(gpu, a), dw(gpu, w), dbias(gpu, bias), ddy(gpu, dy);
  const Shape as{m, k}, ws{n, k}, ys{m, n};

  // y = a w^T (bf16 out), then + bias, and the fused gemm_bias.
  std::vector<BF> y_cpu(static_cast<std::size_t>(m * n));
  ops::gemm(cpu, Transpose::no, Transpose::yes, BF(1.0f), ConstView<BF>{a.data(), as}, ConstView<BF>{w.data(), ws}, BF(0.0f),
            TensorView<BF>{y_cpu.data(), ys});
  auto y = poisoned<BF>(gpu, m * n);
  ops::gemm(gpu, Transpose::no, Transpose::yes, BF(1.0f), da.cview(as), dw.cview(ws), BF(0.0f), y.view(ys));
  CHECK(within_bf16(y.download(), y_cpu));

  // The fused bias: added in float, y rounded once, on both backends.
  std::vector<BF> yb_cpu(static_cast<std::size_t>(m * n));
  ops::gemm_bias(cpu, Transpose::no, Transpose::yes, BF(1.0f), ConstView<BF>{a.data(), as}, ConstView<BF>{w.data(), ws},
                 ConstView<BF>{bias.data(), Shape{n}}, TensorView<BF>{yb_cpu.data(), ys});
  auto fused = poisoned<BF>(gpu, m * n);
  ops::gemm_bias(gpu, Transpose::no, Transpose::yes, BF(1.0f), da.cview(as), dw.cview(ws), dbias.cview(Shape{n}), fused.view(ys));
  CHECK(within_bf16(fused.download(), yb_cpu));

  // dW += dy^T a into float gradients, and the bias gradient.
  std::vector<float> g_cpu(static_cast<std::size_t>(n * k), 0.25f), gb_cpu(static_cast<std::size_t>(n), -0.5f);
  ops::gemm(cpu, Transpose::yes, Transpose::no, BF(1.0f), ConstView<BF>{dy.data(), ys}, ConstView<BF>{a.data(), as}, BF(1.0f),
            TensorView<float>{g_cpu.data(), ws});
  ops::bias_backward(cpu, ConstView<BF>{dy.data(), ys}, TensorView<float>{gb_cpu.data(), Shape{n}});
  DeviceArray<float, Gpu> g(gpu, std::vector<float>(static_cast<std::size_t>(n * k), 0.25f)), gb(gpu, std::vector<float>(static_cast<std::size_t>(n), -0.5f));
  ops::gemm(gpu, Transpose::yes, Transpose::no, BF(1.0f), ddy.cview(ys), da.cview(as), BF(1.0f), g.view(ws));
  ops::bias_backward(gpu, ddy.cview(ys), gb.view(Shape{n}));
  CHECK(relative_error(g.download(), g_cpu) <= fp32_tolerance);
  CHECK(relative_error(gb.download(), gb_cpu) <= fp32_tolerance);

  // GELU forward and backward, and a bf16 gradient added into a float one.
  std::vector<BF> act_cpu(static_cast<std::size_t>(m * n)), dact_cpu(act_cpu.size());
  ops::gelu_forward(cpu, ConstView<BF>{y_cpu.data(), ys}, TensorView<BF>{act_cpu.data(), ys});
  ops::gelu_backward(cpu, ConstView<BF>{y_cpu.data(), ys}, ConstView<BF>{dy.data(), ys}, TensorView<BF>{dact_cpu.data(), ys});
  DeviceArray<BF, Gpu> dy_host_y(gpu, y_cpu);
  auto act = poisoned<BF>(gpu, m * n), dact = poisoned<BF>(gpu, m * n);
  ops::gelu_forward(gpu, dy_host_y.cview(ys), act.view(ys));
  ops::gelu_backward(gpu, dy_host_y.cview(ys), ddy.cview(ys), dact.view(ys));
  CHECK(within_bf16(act.download(), act_cpu));
  CHECK(within_bf16(dact.download(), dact_cpu));

  std::vector<float> acc_cpu(static_cast<std::size_t>(m * n), 1.0f);
  ops::axpy(cpu, BF(1.0f), ConstView<BF>{dy.data(), ys}, TensorView<float>{acc_cpu.data(), ys});
  DeviceArray<float, Gpu> acc(gpu, std::vector<float>(static_cast<std::size_t>(m * n), 1.0f));
  ops::axpy(gpu, BF(1.0f), ddy.cview(ys), acc.view(ys));
  CHECK(acc.download() == acc_cpu);  // one float addition of exact values: the same bits
  CHECK(ops::sum_of_squares(gpu, ddy.cview(ys)) == Approx(ops::sum_of_squares(cpu, ConstView<BF>{dy.data(), ys})).epsilon(1e-12));
}

TEST_CASE("Cuda<bfloat16, float>: LayerNorm keeps float statistics and matches the bf16 host backend", "[gpu][cuda][bf16]") {
  Rng rng(42);
  const index_t rows = 19, n = 72;
  const Shape s{rows, n};
  Gpu gpu;
  Cpu cpu;
  const auto x = random_bf16(rng, rows * n, -2, 2), gamma = random_bf16(rng, n, 0.5, 1.5), beta = random_bf16(rng, n);
  const auto dy = random_bf16(rng, rows * n);
  std::vector<BF> y_cpu(x.size()), dx_cpu(x.size());
  std::vector<float> mean_cpu(static_cast<std::size_t>(rows)), rstd_cpu(static_cast<std::size_t>(rows)), dg_cpu(static_cast<std::size_t>(n)), db_cpu(static_cast<std::size_t>(n));
  ops::layernorm_forward(cpu, ConstView<BF>{x.data(), s}, ConstView<BF>{gamma.data(), Shape{n}}, ConstView<BF>{beta.data(), Shape{n}},
                         TensorView<BF>{y_cpu.data(), s}, TensorView<float>{mean_cpu.data(), Shape{rows}},
                         TensorView<float>{rstd_cpu.data(), Shape{rows}}, 1e-5);
  ops::layernorm_backward_input(cpu, ConstView<BF>{x.data(), s}, ConstView<BF>{gamma.data(), Shape{n}},
                                ConstView<float>{mean_cpu.data(), Shape{rows}}, ConstView<float>{rstd_cpu.data(), Shape{rows}},
                                ConstView<BF>{dy.data(), s}, TensorView<BF>{dx_cpu.data(), s});
  ops::layernorm_backward_weight(cpu, ConstView<BF>{x.data(), s}, ConstView<float>{mean_cpu.data(), Shape{rows}},
                                 ConstView<float>{rstd_cpu.data(), Shape{rows}}, ConstView<BF>{dy.data(), s},
                                 TensorView<float>{dg_cpu.data(), Shape{n}}, TensorView<float>{db_cpu.data(), Shape{n}});

  DeviceArray<BF, Gpu> dx_in(gpu, x), dgamma(gpu, gamma), dbeta(gpu, beta), ddy(gpu, dy);
  auto y = poisoned<BF>(gpu, rows * n), dx = poisoned<BF>(gpu, rows * n);
  auto mean = poisoned<float>(gpu, rows), rstd = poisoned<float>(gpu, rows);
  DeviceArray<float, Gpu> dg(gpu, std::vector<float>(static_cast<std::size_t>(n))), db(gpu, std::vector<float>(static_cast<std::size_t>(n)));
  ops::layernorm_forward(gpu, dx_in.cview(s), dgamma.cview(Shape{n}), dbeta.cview(Shape{n}), y.view(s), mean.view(Shape{rows}),
                         rstd.view(Shape{rows}), 1e-5);
  ops::layernorm_backward_input(gpu, dx_in.cview(s), dgamma.cview(Shape{n}), mean.cview(Shape{rows}), rstd.cview(Shape{rows}),
                                ddy.cview(s), dx.view(s));
  ops::layernorm_backward_weight(gpu, dx_in.cview(s), mean.cview(Shape{rows}), rstd.cview(Shape{rows}), ddy.cview(s),
                                 dg.view(Shape{n}), db.view(Shape{n}));
  CHECK(within_bf16(y.download(), y_cpu));
  CHECK(relative_error(mean.download(), mean_cpu) <= fp32_tolerance);
  CHECK(relative_error(rstd.download(), rstd_cpu) <= fp32_tolerance);
  CHECK(within_bf16(dx.download(), dx_cpu));
  CHECK(relative_error(dg.download(), dg_cpu) <= fp32_tolerance);
  CHECK(relative_error(db.download(), db_cpu) <= fp32_tolerance);
}

namespace {

/// A tensor-core attention path (cuDNN's or ours) against the bf16 host op, forward and backward:
/// T 1, 63, 64, 1000 and 1024; heads of 32, 64 and 128 columns; one to twelve heads.
void check_tensor_core_attention(backend::cuda::AttentionKernel kernel) {
  const auto [seq, D, heads, sequences] = GENERATE(table<index_t, index_t, index_t, index_t>(
      {{1, 64, 2, 3}, {63, 32, 3, 2}, {64, 64, 4, 2}, {64, 128, 2, 1}, {1000, 128, 2, 1}, {1000, 64, 3, 1},
       {1024, 64, 12, 1}, {1024, 32, 4, 2}, {1024, 128, 1, 1}}));
  CAPTURE(backend::cuda::to_string(kernel), seq, D, heads, sequences);
  Rng rng(47);
  Gpu gpu;
  Cpu cpu;
  gpu.attention = kernel;  // cudnn throws with cuDNN's reason if it refuses the shape
  const index_t C = heads * D, rows = seq * sequences;
  const Shape sq{rows, 3 * C}, so{rows, C}, sl{rows, heads};
  const backend::cuda::AttentionChoice choice = ops::attention_choice(gpu, rows, C, heads, seq);
  INFO(choice.describe());
  REQUIRE(choice.kernel == kernel);

  const auto qkv = random_bf16(rng, rows * 3 * C, -1.5, 1.5), dout = random_bf16(rng, rows * C);
  std::vector<BF> out_cpu(static_cast<std::size_t>(rows * C)), dqkv_cpu(qkv.size());
  std::vector<float> lse_cpu(static_cast<std::size_t>(rows * heads));
  ops::causal_attention_forward(cpu, ConstView<BF>{qkv.data(), sq}, TensorView<BF>{out_cpu.data(), so}, TensorView<float>{lse_cpu.data(), sl},
                                heads, seq);
  ops::causal_attention_backward(cpu, ConstView<BF>{qkv.data(), sq}, ConstView<BF>{out_cpu.data(), so}, ConstView<float>{lse_cpu.data(), sl},
                                 ConstView<BF>{dout.data(), so}, TensorView<BF>{dqkv_cpu.data(), sq}, heads, seq);
  DeviceArray<BF, Gpu> dq(gpu, qkv), ddout(gpu, dout);
  auto out = poisoned<BF>(gpu, rows * C), dqkv = poisoned<BF>(gpu, rows * 3 * C), again = poisoned<BF>(gpu, rows * 3 * C);
  auto lse = poisoned<float>(gpu, rows * heads);
  ops::causal_attention_forward(gpu, dq.cview(sq), out.view(so), lse.view(sl), heads, seq);
  // Tensor-core kernels round the probabilities to bf16 before multiplying by V (every flash kernel
  // does), where the host rounds once at the end: a bf16 rounding more per product, so the norm-wise
  // bf16 tolerance rather than one ulp per element.
  CHECK(relative_error(widen(out.download()), widen(out_cpu)) <= bf16_tolerance);
  // The statistics come back in the op's (n, H) layout, in float from fp32 scores.
  CHECK(relative_error(lse.download(), lse_cpu) <= 1e-4);
  ops::causal_attention_backward(gpu, dq.cview(sq), out.cview(so), lse.cview(sl), ddout.cview(so), dqkv.view(sq), heads, seq);
  const std::vector<BF> first = dqkv.download();
  CHECK(relative_error(widen(first), widen(dqkv_cpu)) <= 2 * bf16_tolerance);
  // Deterministic: the same inputs give the same bits.
  ops::causal_attention_backward(gpu, dq.cview(sq), out.cview(so), lse.cview(sl), ddout.cview(so), again.view(sq), heads, seq);
  const std::vector<BF> second = again.download();
  CHECK(std::equal(first.begin(), first.end(), second.begin(),
                   [](BF a, BF b) { return std::bit_cast<std::uint16_t>(a) == std::bit_cast<std::uint16_t>(b); }));
  // The op's lse layout is the same on every path: the simple kernels' backward reads what this
  // path's forward saved and agrees with the host.
  gpu.attention = backend::cuda::AttentionKernel::simple;
  auto mixed = poisoned<BF>(gpu, rows * 3 * C);
  ops::causal_attention_backward(gpu, dq.cview(sq), out.cview(so), lse.cview(sl), ddout.cview(so), mixed.view(sq), heads, seq);
  CHECK(relative_error(widen(mixed.download()), widen(dqkv_cpu)) <= 2 * bf16_tolerance);
}

}  // namespace

TEST_CASE("Cuda<bfloat16, float>: cuDNN's fused attention matches the bf16 host backend, forward and backward",
          "[gpu][cuda][bf16][attention][cudnn]") {
  if constexpr (!backend::cuda::built_with_cudnn) {
    WARN("built without cuDNN's frontend (CUPIPE_HAS_CUDNN): the cuDNN path is not compiled in, nothing to check");
    return;
  }
  check_tensor_core_attention(backend::cuda::AttentionKernel::cudnn);
}

TEST_CASE("Cuda<bfloat16, float>: our tensor-core (mma) attention matches the bf16 host backend, forward and backward",
          "[gpu][cuda][bf16][attention][mma]") {
  check_tensor_core_attention(backend::cuda::AttentionKernel::mma);
}

TEST_CASE("Cuda<bfloat16, float>: packed documents on every attention path match the bf16 host backend",
          "[gpu][cuda][bf16][attention][documents]") {
  // The hand-written paths run every document in one launch (cu_seqlens); cuDNN's runs each alone.
  // Documents of 1, 63, 64 and 65 rows (a tile's edges) and a 141-row one over three tiles.
  auto kernel = GENERATE(backend::cuda::AttentionKernel::mma, backend::cuda::AttentionKernel::tiled,
                         backend::cuda::AttentionKernel::simple, backend::cuda::AttentionKernel::cudnn);
  if (kernel == backend::cuda::AttentionKernel::cudnn && !backend::cuda::built_with_cudnn) return;
  CAPTURE(backend::cuda::to_string(kernel));
  const index_t heads = 2, D = 64, T = 206, C = heads * D;
  const std::vector<std::int32_t> starts = cupipe::testing::document_starts_of({{1, 141, 64}, {63, 65, 78}});
  const index_t rows = index_t(starts.size());
  REQUIRE(rows == 2 * T);
  const DocumentStarts documents{starts.data(), rows};
  Rng rng(53);
  Gpu gpu;
  Cpu cpu;
  gpu.attention = kernel;
  const Shape sq{rows, 3 * C}, so{rows, C}, sl{rows, heads};
  const auto qkv = random_bf16(rng, rows * 3 * C, -1.5, 1.5), dout = random_bf16(rng, rows * C);
  std::vector<BF> out_cpu(static_cast<std::size_t>(rows * C)), dqkv_cpu(qkv.size());
  std::vector<float> lse_cpu(static_cast<std::size_t>(rows * heads));
  ops::causal_attention_forward(cpu, ConstView<BF>{qkv.data(), sq}, TensorView<BF>{out_cpu.data(), so},
                                TensorView<float>{lse_cpu.data(), sl}, heads, T, documents);
  ops::causal_attention_backward(cpu, ConstView<BF>{qkv.data(), sq}, ConstView<BF>{out_cpu.data(), so},
                                 ConstView<float>{lse_cpu.data(), sl}, ConstView<BF>{dout.data(), so},
                                 TensorView<BF>{dqkv_cpu.data(), sq}, heads, T, documents);
  DeviceArray<BF, Gpu> dq(gpu, qkv), ddout(gpu, dout);
  auto out = poisoned<BF>(gpu, rows * C), dqkv = poisoned<BF>(gpu, rows * 3 * C);
  auto lse = poisoned<float>(gpu, rows * heads);
  ops::causal_attention_forward(gpu, dq.cview(sq), out.view(so), lse.view(sl), heads, T, documents);
  CHECK(relative_error(widen(out.download()), widen(out_cpu)) <= bf16_tolerance);
  CHECK(relative_error(lse.download(), lse_cpu) <= 1e-4);
  ops::causal_attention_backward(gpu, dq.cview(sq), out.cview(so), lse.cview(sl), ddout.cview(so), dqkv.view(sq), heads, T,
                                 documents);
  CHECK(relative_error(widen(dqkv.download()), widen(dqkv_cpu)) <= 2 * bf16_tolerance);
}

TEST_CASE("the attention path: automatic picks cuDNN for bf16 where it runs, a request it cannot meet says why",
          "[gpu][cuda][attention][cudnn]") {
  Gpu gpu;
  gpu.attention = backend::cuda::AttentionKernel::automatic;
  const backend::cuda::AttentionChoice bf16 = ops::attention_choice(gpu, 128, 128, 2, 64);
  INFO(bf16.describe());
  CHECK(bf16.kernel == (backend::cuda::built_with_cudnn ? backend::cuda::AttentionKernel::cudnn : backend::cuda::AttentionKernel::simple));
  backend::Cuda<float> fp32;
  fp32.attention = backend::cuda::AttentionKernel::automatic;
  const backend::cuda::AttentionChoice f = ops::attention_choice(fp32, 128, 128, 2, 64);
  CHECK(f.kernel == backend::cuda::AttentionKernel::simple);
  CHECK_THAT(f.reason, Catch::Contains("bf16 storage only"));
  fp32.attention = backend::cuda::AttentionKernel::cudnn;
  CHECK_THROWS_WITH(ops::attention_choice(fp32, 128, 128, 2, 64), Catch::Contains("cuDNN path was asked for"));
  fp32.attention = backend::cuda::AttentionKernel::mma;
  CHECK_THAT(ops::attention_choice(fp32, 128, 128, 2, 64).reason, Catch::Contains("bf16 storage only"));
  gpu.attention = backend::cuda::AttentionKernel::mma;
  CHECK(ops::attention_choice(gpu, 128, 128, 2, 64).kernel == backend::cuda::AttentionKernel::mma);
  CHECK(ops::attention_choice(gpu, 128, 96, 2, 64).kernel == backend::cuda::AttentionKernel::simple);  // heads of 48
  fp32.attention = backend::cuda::AttentionKernel::tiled;
  CHECK(ops::attention_choice(fp32, 128, 128, 2, 64).kernel == backend::cuda::AttentionKernel::tiled);
  CHECK(ops::attention_choice(fp32, 128, 256, 2, 64).kernel == backend::cuda::AttentionKernel::simple);  // heads of 128
}

TEST_CASE("Cuda<bfloat16, float>: attention, cross-entropy (whole and vocabulary-parallel) and embedding match the bf16 host backend",
          "[gpu][cuda][bf16]") {
  Rng rng(43);
  Gpu gpu;
  Cpu cpu;
  SECTION("causal attention, lse in float") {
    // Both kernel choices; for the tiled kernels a ragged single tile (T 17), a ragged second tile
    // (T 130) with several sequences, and a head of 96 columns, which falls back to the simple kernels.
    const auto kernel = GENERATE(backend::cuda::AttentionKernel::simple, backend::cuda::AttentionKernel::tiled);
    const auto [heads, seq, sequences, C] =
        GENERATE(table<index_t, index_t, index_t, index_t>({{4, 17, 3, 64}, {2, 130, 2, 128}, {1, 40, 2, 96}}));
    CAPTURE(int(kernel), heads, seq, sequences, C);
    CHECK(backend::cuda::kernels::attention_tiled::takes<BF>(C / heads) == (C / heads <= 64));
    gpu.attention = kernel;
    const index_t rows = seq * sequences;
    const auto qkv = random_bf16(rng, rows * 3 * C, -1.5, 1.5), dout = random_bf16(rng, rows * C);
    std::vector<BF> out_cpu(static_cast<std::size_t>(rows * C)), dqkv_cpu(qkv.size());
    std::vector<float> lse_cpu(static_cast<std::size_t>(rows * heads));
    ops::causal_attention_forward(cpu, ConstView<BF>{qkv.data(), Shape{rows, 3 * C}}, TensorView<BF>{out_cpu.data(), Shape{rows, C}},
                                  TensorView<float>{lse_cpu.data(), Shape{rows, heads}}, heads, seq);
    ops::causal_attention_backward(cpu, ConstView<BF>{qkv.data(), Shape{rows, 3 * C}}, ConstView<BF>{out_cpu.data(), Shape{rows, C}},
                                   ConstView<float>{lse_cpu.data(), Shape{rows, heads}}, ConstView<BF>{dout.data(), Shape{rows, C}},
                                   TensorView<BF>{dqkv_cpu.data(), Shape{rows, 3 * C}}, heads, seq);
    DeviceArray<BF, Gpu> dq(gpu, qkv), ddout(gpu, dout), host_out(gpu, out_cpu);
    DeviceArray<float, Gpu> dlse_cpu(gpu, lse_cpu);
    auto out = poisoned<BF>(gpu, rows * C), dqkv = poisoned<BF>(gpu, rows * 3 * C);
    auto lse = poisoned<float>(gpu, rows * heads);
    ops::causal_attention_forward(gpu, dq.cview(Shape{rows, 3 * C}), out.view(Shape{rows, C}), lse.view(Shape{rows, heads}), heads, seq);
    CHECK(within_bf16(out.download(), out_cpu));
    CHECK(relative_error(lse.download(), lse_cpu) <= fp32_tolerance);
    // The backward from the host's forward, so both read the same out and lse.
    ops::causal_attention_backward(gpu, dq.cview(Shape{rows, 3 * C}), host_out.cview(Shape{rows, C}), dlse_cpu.cview(Shape{rows, heads}),
                                   ddout.cview(Shape{rows, C}), dqkv.view(Shape{rows, 3 * C}), heads, seq);
    CHECK(within_bf16(dqkv.download(), dqkv_cpu, 3));
  }
  SECTION("softmax cross-entropy, the loss in float") {
    const index_t rows = 23, classes = 50;
    const auto z = random_bf16(rng, rows * classes, -6, 6);
    const auto labels = random_ints(rng, rows, classes);
    std::vector<float> loss_cpu(1);
    std::vector<BF> dz_cpu(z.size());
    ops::softmax_cross_entropy_forward(cpu, ConstView<BF>{z.data(), Shape{rows, classes}},
                                       ConstView<std::int32_t>{labels.data(), Shape{rows}}, TensorView<float>{loss_cpu.data(), Shape{1}}, 40);
    ops::softmax_cross_entropy_backward(cpu, ConstView<BF>{z.data(), Shape{rows, classes}},
                                        ConstView<std::int32_t>{labels.data(), Shape{rows}},
                                        TensorView<BF>{dz_cpu.data(), Shape{rows, classes}}, 40);
    DeviceArray<BF, Gpu> dz_in(gpu, z);
    DeviceArray<std::int32_t, Gpu> dl(gpu, labels);
    auto loss = poisoned<float>(gpu, 1);
    auto dz = poisoned<BF>(gpu, rows * classes);
    ops::softmax_cross_entropy_forward(gpu, dz_in.cview(Shape{rows, classes}), dl.cview(Shape{rows}), loss.view(Shape{1}), 40);
    ops::softmax_cross_entropy_backward(gpu, dz_in.cview(Shape{rows, classes}), dl.cview(Shape{rows}), dz.view(Shape{rows, classes}), 40);
    CHECK(relative_error(loss.download(), loss_cpu) <= fp32_tolerance);
    CHECK(within_bf16(dz.download(), dz_cpu));
  }
  SECTION("vocabulary-parallel cross-entropy's parts: float statistics and lse, bf16 dlogits") {
    // Columns [20, 45) of a 50-class vocabulary; some labels fall in the part, some outside it.
    const index_t rows = 19, cols = 25;
    const ops::VocabPart part{20, 50};
    const auto z = random_bf16(rng, rows * cols, -6, 6);
    const auto labels = random_ints(rng, rows, 50);
    std::vector<float> stats_cpu(static_cast<std::size_t>(rows * 3)), lse(static_cast<std::size_t>(rows));
    for (float& v : lse) v = float(rng.uniform(4.0, 6.0));
    std::vector<BF> dz_cpu(z.size());
    ops::softmax_cross_entropy_part_stats(cpu, ConstView<BF>{z.data(), Shape{rows, cols}},
                                          ConstView<std::int32_t>{labels.data(), Shape{rows}},
                                          TensorView<float>{stats_cpu.data(), Shape{rows, 3}}, part);
    ops::softmax_cross_entropy_part_backward(cpu, ConstView<BF>{z.data(), Shape{rows, cols}},
                                             ConstView<std::int32_t>{labels.data(), Shape{rows}},
                                             ConstView<float>{lse.data(), Shape{rows}},
                                             TensorView<BF>{dz_cpu.data(), Shape{rows, cols}}, 40, part);
    DeviceArray<BF, Gpu> dz_in(gpu, z);
    DeviceArray<std::int32_t, Gpu> dl(gpu, labels);
    DeviceArray<float, Gpu> dlse(gpu, lse);
    auto stats = poisoned<float>(gpu, rows * 3);
    auto dz = poisoned<BF>(gpu, rows * cols);
    ops::softmax_cross_entropy_part_stats(gpu, dz_in.cview(Shape{rows, cols}), dl.cview(Shape{rows}), stats.view(Shape{rows, 3}), part);
    ops::softmax_cross_entropy_part_backward(gpu, dz_in.cview(Shape{rows, cols}), dl.cview(Shape{rows}), dlse.cview(Shape{rows}),
                                             dz.view(Shape{rows, cols}), 40, part);
    CHECK(relative_error(stats.download(), stats_cpu) <= fp32_tolerance);
    CHECK(within_bf16(dz.download(), dz_cpu));
  }
  SECTION("embedding: an exact gather, float accumulation") {
    const index_t rows = 41, vocab = 30, dim = 24;
    const auto table = random_bf16(rng, vocab * dim), dy = random_bf16(rng, rows * dim);
    const auto ids = random_ints(rng, rows, vocab);
    std::vector<BF> y_cpu(static_cast<std::size_t>(rows * dim));
    std::vector<float> dt_cpu(static_cast<std::size_t>(vocab * dim), 0.5f);
    ops::embedding_forward(cpu, ConstView<std::int32_t>{ids.data(), Shape{rows}}, ConstView<BF>{table.data(), Shape{vocab, dim}},
                           TensorView<BF>{y_cpu.data(), Shape{rows, dim}});
    ops::embedding_backward(cpu, ConstView<std::int32_t>{ids.data(), Shape{rows}}, ConstView<BF>{dy.data(), Shape{rows, dim}},
                            TensorView<float>{dt_cpu.data(), Shape{vocab, dim}});
    DeviceArray<std::int32_t, Gpu> did(gpu, ids);
    DeviceArray<BF, Gpu> dtable(gpu, table), ddy(gpu, dy);
    DeviceArray<float, Gpu> dt(gpu, std::vector<float>(static_cast<std::size_t>(vocab * dim), 0.5f));
    auto y = poisoned<BF>(gpu, rows * dim);
    ops::embedding_forward(gpu, did.cview(Shape{rows}), dtable.cview(Shape{vocab, dim}), y.view(Shape{rows, dim}));
    ops::embedding_backward(gpu, did.cview(Shape{rows}), ddy.cview(Shape{rows, dim}), dt.view(Shape{vocab, dim}));
    CHECK(widen(y.download()) == widen(y_cpu));  // a gather: the same bits
    CHECK(relative_error(dt.download(), dt_cpu) <= fp32_tolerance);
  }
  SECTION("AdamW on float master weights publishes their rounding") {
    const index_t n = 1001;
    std::vector<float> master(static_cast<std::size_t>(n)), grad(static_cast<std::size_t>(n)), zeros(static_cast<std::size_t>(n), 0.0f);
    for (float& v : master) v = float(rng.uniform(-1, 1));
    for (float& v : grad) v = float(rng.uniform(-1, 1));
    std::vector<BF> param(static_cast<std::size_t>(n));
    std::vector<float> mc = master, m_cpu = zeros, v_cpu = zeros;
    std::vector<BF> pc(static_cast<std::size_t>(n));
    DeviceArray<float, Gpu> dm(gpu, master), dg(gpu, grad), d1(gpu, zeros), d2(gpu, zeros);
    auto dp = poisoned<BF>(gpu, n);
    const ops::AdamWHyper h{.lr = 0.01, .weight_decay = 0.1};
    for (std::int64_t step = 1; step <= 3; ++step) {
      ops::adamw_update_master(cpu, TensorView<float>{mc.data(), Shape{n}}, TensorView<BF>{pc.data(), Shape{n}},
                               ConstView<float>{grad.data(), Shape{n}}, TensorView<float>{m_cpu.data(), Shape{n}},
                               TensorView<float>{v_cpu.data(), Shape{n}}, h, step, 1.0f);
      ops::adamw_update_master(gpu, dm.view(Shape{n}), dp.view(Shape{n}), dg.cview(Shape{n}), d1.view(Shape{n}), d2.view(Shape{n}), h,
                               step, 1.0f);
    }
    CHECK(relative_error(dm.download(), mc) <= fp32_tolerance);
    const std::vector<float> got_master = dm.download();
    const std::vector<BF> got_param = dp.download();
    for (std::size_t i = 0; i < got_param.size(); ++i) REQUIRE(got_param[i].bits == BF(got_master[i]).bits);
  }
}

namespace {

using Mlp = Sequential<Linear<24, 64>, GELU, LayerNorm<64>, Linear<64, 64>, ReLU, Linear<64, 10>>;

/// Three AdamW steps of a 2-stage 1F1B pipeline on Cuda<bf16, float> and on Host<bf16, float>.
template <class Model, class Input>
void check_pipeline(const std::vector<Input>& x, const std::vector<std::int32_t>& labels, index_t rows, index_t in_cols) {
  using Stages = partition<Model, 2>;
  Pipeline<Stages, schedule::OneFOneB, Gpu> gpu({.microbatches = 2, .seed = 9});
  Pipeline<Stages, schedule::OneFOneB, Cpu> cpu({.microbatches = 2, .seed = 9});
  REQUIRE(gpu.parameters() == cpu.parameters());  // master weights, initialised on the host
  const optim::AdamW adamw({.lr = 1e-3, .weight_decay = 0.01, .clip_norm = 1.0});
  for (int step = 0; step < 3; ++step) {
    const ConstView<Input> xs{x.data(), Shape{rows, in_cols}};
    const ConstView<std::int32_t> ys{labels.data(), Shape{rows}};
    const StepStats g = gpu.train_step(xs, ys, adamw);
    const StepStats c = cpu.train_step(xs, ys, adamw);
    CAPTURE(step, g.loss, c.loss, g.grad_norm, c.grad_norm);
    // The first step from the same weights agrees to fp32 and bf16-ulp noise; later steps also carry
    // AdamW's sign-like first moves, where a gradient near zero may differ in sign.
    CHECK(std::abs(g.loss - c.loss) <= 5e-3 * std::abs(c.loss));
    CHECK(std::abs(g.grad_norm - c.grad_norm) <= 2e-2 * c.grad_norm);
  }
  CHECK(relative_error(gpu.parameters(), cpu.parameters()) <= 1e-2);
}

/// A tied GPT: vocabulary 64, context 16, 2 blocks, 2 heads, 32 channels. A template, as in
/// test_cuda_pipeline.cu: nvcc's host pass loses a class-type template argument named in a
/// non-template function.
template <int Sequences>
void check_small_gpt(Rng& rng) {
  constexpr gpt::Config config{64, 16, 2, 2, 32};
  const index_t rows = Sequences * config.context;
  check_pipeline<gpt::Model<config>>(random_ints(rng, rows, config.vocab), random_ints(rng, rows, config.vocab), rows, 1);
}

}  // namespace

TEST_CASE("Cuda<bfloat16, float>: pipelines train as on the bf16 host backend", "[gpu][cuda][bf16][pipeline]") {
  Rng rng(44);
  SECTION("MLP with GELU and LayerNorm") {
    const index_t rows = 32;
    check_pipeline<Mlp>(random_bf16(rng, rows * 24), random_ints(rng, rows, 10), rows, 24);
  }
  SECTION("tied GPT") {
    check_small_gpt<4>(rng);
  }
}

// ---- FP8 with DeepSeek-V3's block scaling (issue #59): CudaFp8<Blockwise> against HostFp8<Blockwise> ----

namespace {

using GpuFp8 = backend::CudaFp8<fp8::Blockwise>;
using CpuFp8 = backend::HostFp8<fp8::Blockwise>;

// No fused epilogue on FP8: a Linear runs the FP8 GEMM, then its bias-gradient and GELU kernels.
static_assert(!cupipe::detail::fuses_bias_grad<GpuFp8, BF> && !cupipe::detail::fuses_dgelu<GpuFp8, BF> &&
              !cupipe::detail::fuses_bias_gelu<GpuFp8, BF>);
static_assert(cupipe::detail::fuses_bias<GpuFp8, BF>);  // gemm_bias: the FP8 product, then the bias kernel

std::vector<float> as_floats(const std::vector<BF>& v) {
  std::vector<float> out;
  for (const BF& x : v) out.push_back(float(x));
  return out;
}

/// How many codes differ from the host's (q.codes, row-major as `got`).
template <class Format>
int code_mismatches(const std::vector<unsigned char>& got, const fp8::Quantized<Format>& q) {
  int bad = 0;
  for (std::size_t i = 0; i < got.size() && i < q.codes.size(); ++i) bad += got[i] != q.codes[i].bits;
  return bad + int(got.size() != q.codes.size());
}

/// Every element within 2 bf16 ulps of the host's, plus 1e-4 of the largest (fp32 sums in another order).
bool within_fp8_sums(const std::vector<BF>& got, const std::vector<BF>& want) {
  const std::vector<double> g = widen(got), w = widen(want);
  double scale = 0;
  for (double x : w) scale = std::max(scale, std::abs(x));
  for (std::size_t i = 0; i < g.size(); ++i)
    if (!std::isfinite(g[i]) || std::abs(g[i] - w[i]) > 2 * std::ldexp(std::abs(w[i]), -8) + 1e-4 * scale) {
      UNSCOPED_INFO("element " << i << ": " << g[i] << " against " << w[i]);
      return false;
    }
  return g.size() == w.size();
}

}  // namespace

TEST_CASE("CudaFp8<Blockwise>: the host emulation's codes and scales, bitwise, and its three GEMMs", "[gpu][cuda][fp8]") {
  Rng rng(59);
  // 48 tokens; 272 features (3 blocks of k, the last 16 wide); 144 outputs (2 blocks, the last 16).
  const index_t m = 48, k = 272, n = 144;
  GpuFp8 gpu;
  CpuFp8 cpu;
  const auto x = random_bf16(rng, m * k), w = random_bf16(rng, n * k, -0.05, 0.05), dy = random_bf16(rng, m * n, -1e-3, 1e-3);
  const std::vector<float> xf = as_floats(x), wf = as_floats(w);
  DeviceArray<BF, GpuFp8> dx(gpu, x), dw(gpu, w), ddy(gpu, dy);
  const Shape xs{m, k}, ws{n, k}, ys{m, n};
  namespace kernels = backend::cuda::kernels;
  auto& ctx = gpu.context();

  SECTION("quantisation: the host's codes and scales, in cuBLASLt's layouts") {
    // x in 1 x 128 tiles: scales[b * m + i].
    const auto qx = fp8::quantize<fp8::ActivationTiles>(ConstView<float>{xf.data(), xs});
    DeviceArray<unsigned char, GpuFp8> codes(gpu, m * k);
    DeviceArray<float, GpuFp8> scales(gpu, 3 * m);
    kernels::quantize_tiles(ctx, kernels::device_ptr(dx.buffer.data()), m, k, codes.buffer.data(), scales.buffer.data());
    CHECK(code_mismatches(codes.download(), qx) == 0);
    const std::vector<float> s = scales.download();
    for (index_t b = 0; b < 3; ++b)
      for (index_t i = 0; i < m; ++i) CHECK(s[std::size_t(b * m + i)] == qx.scales[std::size_t(i * 3 + b)]);
    // x^T (k, m) in tiles along the tokens, from x: scales[b * k + c], one tile of 48.
    const std::vector<float> xt = transposed(xf, m, k);
    const auto qxt = fp8::quantize<fp8::ActivationTiles>(ConstView<float>{xt.data(), Shape{k, m}});
    DeviceArray<float, GpuFp8> scales_t(gpu, k);
    kernels::quantize_tiles_transposed(ctx, kernels::device_ptr(dx.buffer.data()), m, k, codes.buffer.data(),
                                       scales_t.buffer.data());
    CHECK(code_mismatches(codes.download(), qxt) == 0);
    CHECK(scales_t.download() == qxt.scales);
    // W (n, k) in 128 x 128 blocks and W^T (k, n) from the same pass: scales[p * 4 + b], l4 = 4.
    const auto qw = fp8::quantize<fp8::WeightBlocks>(ConstView<float>{wf.data(), ws});
    const std::vector<float> wt = transposed(wf, n, k);
    const auto qwt = fp8::quantize<fp8::WeightBlocks>(ConstView<float>{wt.data(), Shape{k, n}});
    DeviceArray<unsigned char, GpuFp8> wcodes(gpu, n * k), wcodes_t(gpu, n * k);
    DeviceArray<float, GpuFp8> wscales(gpu, 2 * 4), wscales_t(gpu, 3 * 4);
    kernels::quantize_blocks(ctx, kernels::device_ptr(dw.buffer.data()), n, k, wcodes.buffer.data(), wscales.buffer.data(), 4,
                             wcodes_t.buffer.data(), wscales_t.buffer.data(), 4);
    CHECK(code_mismatches(wcodes.download(), qw) == 0);
    CHECK(code_mismatches(wcodes_t.download(), qwt) == 0);
    const std::vector<float> ws_ = wscales.download(), wst = wscales_t.download();
    for (index_t p = 0; p < 2; ++p)
      for (index_t b = 0; b < 3; ++b) {
        CHECK(ws_[std::size_t(p * 4 + b)] == qw.scales[std::size_t(p * 3 + b)]);
        CHECK(wst[std::size_t(b * 4 + p)] == qwt.scales[std::size_t(b * 2 + p)]);
      }
  }
  SECTION("y = x W^T, dx = dy W and dW += dy^T x: the host's products to fp32 sums") {
    std::vector<BF> y_cpu(std::size_t(m * n)), dx_cpu(std::size_t(m * k));
    ops::gemm(cpu, Transpose::no, Transpose::yes, BF(1.0f), ConstView<BF>{x.data(), xs}, ConstView<BF>{w.data(), ws}, BF(0.0f),
              TensorView<BF>{y_cpu.data(), ys});
    auto y = poisoned<BF>(gpu, m * n);
    ops::gemm(gpu, Transpose::no, Transpose::yes, BF(1.0f), dx.cview(xs), dw.cview(ws), BF(0.0f), y.view(ys));
    CHECK(within_fp8_sums(y.download(), y_cpu));
    ops::gemm(cpu, Transpose::no, Transpose::no, BF(1.0f), ConstView<BF>{dy.data(), ys}, ConstView<BF>{w.data(), ws}, BF(0.0f),
              TensorView<BF>{dx_cpu.data(), xs});
    auto dxo = poisoned<BF>(gpu, m * k);
    ops::gemm(gpu, Transpose::no, Transpose::no, BF(1.0f), ddy.cview(ys), dw.cview(ws), BF(0.0f), dxo.view(xs));
    CHECK(within_fp8_sums(dxo.download(), dx_cpu));
    std::vector<float> g_cpu(std::size_t(n * k), 0.25f);
    ops::gemm(cpu, Transpose::yes, Transpose::no, BF(1.0f), ConstView<BF>{dy.data(), ys}, ConstView<BF>{x.data(), xs}, BF(1.0f),
              TensorView<float>{g_cpu.data(), ws});
    DeviceArray<float, GpuFp8> g(gpu, std::vector<float>(std::size_t(n * k), 0.25f));
    ops::gemm(gpu, Transpose::yes, Transpose::no, BF(1.0f), ddy.cview(ys), dx.cview(xs), BF(1.0f), g.view(ws));
    CHECK(relative_error(g.download(), g_cpu) <= 1e-4);
  }
  SECTION("a shape cuBLASLt's block-scaled GEMM cannot take is refused, naming it") {
    auto y = poisoned<BF>(gpu, (m - 2) * n);
    CHECK_THROWS_WITH(ops::gemm(gpu, Transpose::no, Transpose::yes, BF(1.0f), dx.cview(Shape{m - 2, k}), dw.cview(ws), BF(0.0f),
                                y.view(Shape{m - 2, n})),
                      Catch::Contains("(46, 144, 272) with m and n multiples of 4 and k of 16"));
  }
}

// ---- FP8 with delayed scaling (issue #59): CudaFp8<PerTensorDelayed> against HostFp8<PerTensorDelayed> ----

TEST_CASE("CudaFp8<PerTensorDelayed>: the host emulation's codes, scales and amaxes, and its GEMMs over two steps",
          "[gpu][cuda][fp8]") {
  using GpuDelayed = backend::CudaFp8<fp8::PerTensorDelayed>;
  Rng rng(60);
  const index_t m = 48, k = 272, n = 144;
  GpuDelayed gpu;
  backend::HostFp8<fp8::PerTensorDelayed> cpu;
  const auto x = random_bf16(rng, m * k), w = random_bf16(rng, n * k, -0.05, 0.05), dy = random_bf16(rng, m * n, -1e-3, 1e-3);
  const std::vector<float> xf = as_floats(x), dyf = as_floats(dy);
  DeviceArray<BF, GpuDelayed> dx(gpu, x), dw(gpu, w), ddy(gpu, dy);
  const Shape xs{m, k}, ws{n, k}, ys{m, n};
  namespace kernels = backend::cuda::kernels;
  auto& ctx = gpu.context();

  SECTION("quantisation at one scale, as it stands and transposed, and the amax it adds") {
    fp8::DelayedScaling<float8_e4m3> h4;
    h4.record(0.75f * fp8::amax_of(ConstView<float>{xf.data(), xs}));  // a history below x's amax: some codes saturate
    DeviceArray<unsigned char, GpuDelayed> codes(gpu, m * k);
    DeviceArray<float, GpuDelayed> used(gpu, 1);
    DeviceArray<int, GpuDelayed> step(gpu, std::vector<int>{std::bit_cast<int>(-1.0f)});
    kernels::quantize_tensor<__NV_E4M3>(ctx, kernels::device_ptr(dx.buffer.data()), m, k, false, h4.scale(), nullptr,
                                        codes.buffer.data(), used.buffer.data(), step.buffer.data());
    float amax = 0;
    const auto q4 = h4.quantize(ConstView<float>{xf.data(), xs}, &amax);
    CHECK(code_mismatches(codes.download(), q4) == 0);
    CHECK(used.download() == std::vector<float>{h4.scale()});
    CHECK(std::bit_cast<float>(step.download()[0]) == amax);
    // dy^T (n, m) in E5M2 from dy (m, n), scaled by dy's own amax (its first use).
    const std::vector<float> dyt = transposed(dyf, m, n);
    fp8::DelayedScaling<float8_e5m2> h5(1);
    h5.record(fp8::amax_of(ConstView<float>{dyf.data(), ys}));
    DeviceArray<unsigned, GpuDelayed> own(gpu, 2);
    kernels::amax(ctx, kernels::device_ptr(ddy.buffer.data()), m * n, own.buffer.data());
    DeviceArray<unsigned char, GpuDelayed> codes_t(gpu, m * n);
    kernels::quantize_tensor<__NV_E5M2>(ctx, kernels::device_ptr(ddy.buffer.data()), m, n, true, 1.0f, own.buffer.data(),
                                        codes_t.buffer.data(), used.buffer.data(), step.buffer.data());
    CHECK(code_mismatches(codes_t.download(), h5.quantize(ConstView<float>{dyt.data(), Shape{n, m}})) == 0);
    CHECK(used.download() == std::vector<float>{h5.scale()});
    CHECK(std::bit_cast<float>(step.download()[0]) == amax);  // dy's amax is smaller: the step keeps x's
    // An infinity quantises to NaN (0x7F), not to the largest code, and stays out of the amax.
    std::vector<BF> bad = x;
    bad[5] = BF(std::numeric_limits<float>::infinity());
    DeviceArray<BF, GpuDelayed> dbad(gpu, bad);
    DeviceArray<int, GpuDelayed> fresh(gpu, std::vector<int>{std::bit_cast<int>(-1.0f)});
    kernels::quantize_tensor<__NV_E4M3>(ctx, kernels::device_ptr(dbad.buffer.data()), m, k, false, h4.scale(), nullptr,
                                        codes.buffer.data(), used.buffer.data(), fresh.buffer.data());
    std::vector<float> rest = xf;
    rest[5] = 0.0f;
    CHECK(codes.download()[5] == 0x7F);
    CHECK(std::bit_cast<float>(fresh.download()[0]) == fp8::amax_of(ConstView<float>{rest.data(), xs}));
  }
  SECTION("y = x W^T, dx = dy W and dW += dy^T x over two steps: the host's products and recorded scales") {
    std::vector<float> g_cpu(std::size_t(n * k), 0.0f);
    DeviceArray<float, GpuDelayed> g(gpu, std::vector<float>(std::size_t(n * k), 0.0f));
    for (int s = 0; s < 2; ++s) {
      INFO("step " << s + 1);
      // Step 2 feeds 3 x: past the history's scale, so its largest values saturate alike on both.
      std::vector<BF> input = x;
      if (s == 1)
        for (BF& v : input) v = BF(3.0f * float(v));
      DeviceArray<BF, GpuDelayed> dxs(gpu, input);
      std::vector<BF> y_cpu(std::size_t(m * n)), dx_cpu(std::size_t(m * k));
      ops::gemm(cpu, Transpose::no, Transpose::yes, BF(1.0f), ConstView<BF>{input.data(), xs}, ConstView<BF>{w.data(), ws},
                BF(0.0f), TensorView<BF>{y_cpu.data(), ys});
      auto y = poisoned<BF>(gpu, m * n);
      ops::gemm(gpu, Transpose::no, Transpose::yes, BF(1.0f), dxs.cview(xs), dw.cview(ws), BF(0.0f), y.view(ys));
      CHECK(within_fp8_sums(y.download(), y_cpu));
      ops::gemm(cpu, Transpose::no, Transpose::no, BF(1.0f), ConstView<BF>{dy.data(), ys}, ConstView<BF>{w.data(), ws},
                BF(0.0f), TensorView<BF>{dx_cpu.data(), xs});
      auto dxo = poisoned<BF>(gpu, m * k);
      ops::gemm(gpu, Transpose::no, Transpose::no, BF(1.0f), ddy.cview(ys), dw.cview(ws), BF(0.0f), dxo.view(xs));
      CHECK(within_fp8_sums(dxo.download(), dx_cpu));
      ops::gemm(cpu, Transpose::yes, Transpose::no, BF(1.0f), ConstView<BF>{dy.data(), ys}, ConstView<BF>{input.data(), xs},
                BF(1.0f), TensorView<float>{g_cpu.data(), ws});
      ops::gemm(gpu, Transpose::yes, Transpose::no, BF(1.0f), ddy.cview(ys), dxs.cview(xs), BF(1.0f), g.view(ws));
      CHECK(relative_error(g.download(), g_cpu) <= 1e-4);
      backend::end_step(cpu);
      backend::end_step(gpu);
      // Every operand's recorded scale is the host's, bit for bit (an amax is exact on both).
      const std::pair<const void*, const void*> keys[] = {{w.data(), dw.buffer.data()},
                                                          {w.data(), dw.buffer.data()},
                                                          {g_cpu.data(), g.buffer.data()}};
      const fp8::GemmRole roles[] = {fp8::GemmRole::forward, fp8::GemmRole::input_grad, fp8::GemmRole::weight_grad};
      for (int r = 0; r < 3; ++r) {
        const std::size_t* e = gpu.scales.find(keys[r].second, roles[r]);
        REQUIRE(e != nullptr);
        CHECK(gpu.scales.scale(*e, fp8::Operand::a) == cpu.fp8.scale(keys[r].first, roles[r], true));
        CHECK(gpu.scales.scale(*e, fp8::Operand::b) == cpu.fp8.scale(keys[r].first, roles[r], false));
      }
    }
    CHECK(gpu.scales.size() == 3);
  }
}
