// SPDX-License-Identifier: Apache-2.0
// Every CUDA op against the host op on backend::Host<double>: fresh random data per seed, ragged
// sizes (not multiples of the 128-bit pack width), outputs poisoned with NaN before each call, and
// ||out - ref|| / ||ref|| within the tolerance of the arithmetic.
#include <catch2/catch.hpp>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <exception>
#include <limits>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "cuda_test_support.hpp"
#include "local_expert_group.hpp"
#include "local_ring.hpp"
#include "moe_slots.hpp"

#include "cupipe/pipeline/paired_turns.hpp"

using namespace cupipe;
using namespace cupipe::testing;
using ops::Transpose;
using Gpu = backend::Cuda<float>;
using Ref = backend::Host<double>;

namespace {

std::vector<double> host_view_op(const std::vector<double>& init, auto&& op) {
  std::vector<double> out = init;
  op(out);
  return out;
}

}  // namespace

TEST_CASE("elementwise ops match the host", "[gpu][cuda][ops]") {
  const std::uint64_t seed = GENERATE(1, 2, 3);
  const index_t n = GENERATE(1, 3, 4, 5, 1000, 4097, 65537);
  Rng rng(seed * 7919 + std::uint64_t(n));
  Gpu gpu;
  Ref ref;
  const auto x = random_floats(rng, n, -3, 3), dy = random_floats(rng, n), y0 = random_floats(rng, n);
  const auto xd = cast<double>(x), dyd = cast<double>(dy), y0d = cast<double>(y0);
  DeviceArray<float, Gpu> dx_(gpu, x), ddy(gpu, dy);
  const Shape s{n};
  const ConstView<double> rx{xd.data(), s}, rdy{dyd.data(), s};

  SECTION("relu forward and backward") {
    auto y = poisoned<float>(gpu, n);
    ops::relu_forward(gpu, dx_.cview(s), y.view(s));
    CHECK(relative_error(y.download(), host_view_op(y0d, [&](auto& o) { ops::relu_forward(ref, rx, TensorView<double>{o.data(), s}); })) <= fp32_tolerance);
    auto g = poisoned<float>(gpu, n);
    ops::relu_backward(gpu, dx_.cview(s), ddy.cview(s), g.view(s));
    CHECK(relative_error(g.download(), host_view_op(y0d, [&](auto& o) { ops::relu_backward(ref, rx, rdy, TensorView<double>{o.data(), s}); })) <= fp32_tolerance);
  }
  SECTION("gelu forward and backward") {
    auto y = poisoned<float>(gpu, n);
    ops::gelu_forward(gpu, dx_.cview(s), y.view(s));
    CHECK(relative_error(y.download(), host_view_op(y0d, [&](auto& o) { ops::gelu_forward(ref, rx, TensorView<double>{o.data(), s}); })) <= fp32_tolerance);
    auto g = poisoned<float>(gpu, n);
    ops::gelu_backward(gpu, dx_.cview(s), ddy.cview(s), g.view(s));
    CHECK(relative_error(g.download(), host_view_op(y0d, [&](auto& o) { ops::gelu_backward(ref, rx, rdy, TensorView<double>{o.data(), s}); })) <= fp32_tolerance);
  }
  SECTION("residual_add, axpy, copy, fill") {
    auto y = poisoned<float>(gpu, n);
    ops::residual_add(gpu, dx_.cview(s), ddy.cview(s), y.view(s));
    CHECK(relative_error(y.download(), host_view_op(y0d, [&](auto& o) { ops::residual_add(ref, rx, rdy, TensorView<double>{o.data(), s}); })) <= fp32_tolerance);
    DeviceArray<float, Gpu> acc(gpu, y0);
    ops::axpy(gpu, -0.75, dx_.cview(s), acc.view(s));
    CHECK(relative_error(acc.download(), host_view_op(y0d, [&](auto& o) { ops::axpy(ref, -0.75, rx, TensorView<double>{o.data(), s}); })) <= fp32_tolerance);
    auto c = poisoned<float>(gpu, n);
    ops::copy(gpu, dx_.cview(s), c.view(s));
    CHECK(c.download() == x);
    ops::fill(gpu, c.view(s), 2.5f);
    CHECK(c.download() == std::vector<float>(std::size_t(n), 2.5f));
  }
  SECTION("wire_round_trip: bf16 and e4m3 equal the host's float op bitwise") {
    backend::Host<float> host;
    for (const Wire wire : {Wire::full, Wire::bf16, Wire::e4m3}) {
      auto y = poisoned<float>(gpu, n);
      ops::wire_round_trip(gpu, dx_.cview(s), y.view(s), wire);
      std::vector<float> expected(x.size());
      ops::wire_round_trip(host, ConstView<float>{x.data(), s}, TensorView<float>{expected.data(), s}, wire);
      CHECK(y.download() == expected);
    }
    // In place, and a tensor with an infinity passes unchanged.
    std::vector<float> with_inf = x;
    with_inf[std::size_t(n / 2)] = std::numeric_limits<float>::infinity();
    DeviceArray<float, Gpu> inf_(gpu, with_inf);
    ops::wire_round_trip(gpu, inf_.cview(s), inf_.view(s), Wire::e4m3);
    CHECK(inf_.download() == with_inf);
  }
  SECTION("wire_pack and wire_unpack: the host's message bytes, and the round trip's values, bitwise") {
    backend::Host<float> host;
    for (const Wire wire : {Wire::bf16, Wire::e4m3}) {
      const index_t elements = wire_elements<float>(wire, n);
      const Shape ps{elements};
      auto packed = poisoned<float>(gpu, elements);
      ops::wire_pack(gpu, dx_.cview(s), packed.view(ps), wire);
      std::vector<float> expected(std::size_t(elements), 0.0f);
      ops::wire_pack(host, ConstView<float>{x.data(), s}, TensorView<float>{expected.data(), ps}, wire);
      const std::vector<float> got = packed.download();
      CHECK(std::memcmp(got.data(), expected.data(), got.size() * sizeof(float)) == 0);  // with the zeroed padding
      auto y = poisoned<float>(gpu, n);
      ops::wire_unpack(gpu, packed.cview(ps), y.view(s), wire);
      std::vector<float> round(x.size());
      ops::wire_round_trip(host, ConstView<float>{x.data(), s}, TensorView<float>{round.data(), s}, wire);
      const std::vector<float> values = y.download();
      CHECK(std::memcmp(values.data(), round.data(), round.size() * sizeof(float)) == 0);
    }
    // A tensor too small for 448 / amax to be finite: scale 1, signed zeros, as on the host.
    {
      std::vector<float> tiny(std::size_t(n), 1e-37f);
      tiny[0] = -1e-37f;
      DeviceArray<float, Gpu> tiny_(gpu, tiny);
      const Shape ps{wire_elements<float>(Wire::e4m3, n)};
      auto packed = poisoned<float>(gpu, ps[0]);
      ops::wire_pack(gpu, tiny_.cview(s), packed.view(ps), Wire::e4m3);
      auto y = poisoned<float>(gpu, n);
      ops::wire_unpack(gpu, packed.cview(ps), y.view(s), Wire::e4m3);
      std::vector<float> expected(tiny.size());
      ops::wire_round_trip(host, ConstView<float>{tiny.data(), s}, TensorView<float>{expected.data(), s}, Wire::e4m3);
      const std::vector<float> values = y.download();
      CHECK(std::memcmp(values.data(), expected.data(), expected.size() * sizeof(float)) == 0);
      CHECK(std::signbit(values[0]));
    }
    // A tensor with an infinity arrives as all NaN over e4m3.
    std::vector<float> with_inf = x;
    with_inf[std::size_t(n / 2)] = std::numeric_limits<float>::infinity();
    DeviceArray<float, Gpu> inf_(gpu, with_inf);
    const Shape ps{wire_elements<float>(Wire::e4m3, n)};
    auto packed = poisoned<float>(gpu, ps[0]);
    ops::wire_pack(gpu, inf_.cview(s), packed.view(ps), Wire::e4m3);
    DeviceArray<float, Gpu> y(gpu, std::vector<float>(std::size_t(n), 1.0f));  // finite: the NaN must be written
    ops::wire_unpack(gpu, packed.cview(ps), y.view(s), Wire::e4m3);
    for (const float v : y.download()) CHECK(std::isnan(v));
  }
  SECTION("convert to bf16 and back") {
    auto b = gpu.allocate<cupipe::bfloat16>(n, MemoryTag::activations);
    ops::poison(gpu, b.view(s));
    ops::convert(gpu, dx_.cview(s), b.view(s));
    auto back = poisoned<float>(gpu, n);
    ops::convert(gpu, DeviceConstView<cupipe::bfloat16>(b.view(s)), back.view(s));
    std::vector<float> expected;
    for (float v : x) expected.push_back(float(cupipe::bfloat16(v)));
    CHECK(back.download() == expected);
  }
}

TEST_CASE("bias_add and bias_backward match the host", "[gpu][cuda][ops]") {
  const std::uint64_t seed = GENERATE(1, 2);
  const auto [rows, cols] = GENERATE(table<index_t, index_t>({{1, 1}, {3, 7}, {5, 8}, {300, 33}, {257, 768}, {600, 1023}}));
  Rng rng(seed * 31 + std::uint64_t(rows * cols));
  Gpu gpu;
  Ref ref;
  const Shape s{rows, cols}, b{cols};
  const auto y0 = random_floats(rng, rows * cols), bias = random_floats(rng, cols), db0 = random_floats(rng, cols);
  auto y0d = cast<double>(y0), biasd = cast<double>(bias), db0d = cast<double>(db0);
  DeviceArray<float, Gpu> y(gpu, y0), dbias(gpu, bias), db(gpu, db0);
  ops::bias_add(gpu, y.view(s), dbias.cview(b));
  ops::bias_add(ref, TensorView<double>{y0d.data(), s}, ConstView<double>{biasd.data(), b});
  CHECK(relative_error(y.download(), y0d) <= fp32_tolerance);
  // y now holds y0 + bias: use it as dy; bias_backward accumulates onto db0.
  const auto dyd = y0d;
  ops::bias_backward(gpu, y.cview(s), db.view(b));
  ops::bias_backward(ref, ConstView<double>{dyd.data(), s}, TensorView<double>{db0d.data(), b});
  CHECK(relative_error(db.download(), db0d) <= fp32_tolerance);
}

TEST_CASE("layernorm forward and backward match the host", "[gpu][cuda][ops]") {
  const std::uint64_t seed = GENERATE(1, 2);
  const auto [rows, cols] = GENERATE(table<index_t, index_t>({{1, 2}, {3, 7}, {64, 128}, {300, 768}, {17, 1023}, {5, 4096}}));
  Rng rng(seed * 131 + std::uint64_t(rows * cols));
  Gpu gpu;
  Ref ref;
  const Shape s{rows, cols}, c{cols}, r{rows};
  const auto x = random_floats(rng, rows * cols, -2, 3), gamma = random_floats(rng, cols, 0.5, 1.5),
             beta = random_floats(rng, cols), dy = random_floats(rng, rows * cols),
             dg0 = random_floats(rng, cols), dbt0 = random_floats(rng, cols);
  const auto xd = cast<double>(x), gd = cast<double>(gamma), bd = cast<double>(beta), dyd = cast<double>(dy);
  DeviceArray<float, Gpu> dx_(gpu, x), dgamma_in(gpu, gamma), dbeta_in(gpu, beta), ddy(gpu, dy), dg(gpu, dg0),
      dbt(gpu, dbt0);
  auto y = poisoned<float>(gpu, rows * cols), mean = poisoned<float>(gpu, rows), rstd = poisoned<float>(gpu, rows);
  ops::layernorm_forward(gpu, dx_.cview(s), dgamma_in.cview(c), dbeta_in.cview(c), y.view(s), mean.view(r), rstd.view(r), 1e-5);
  std::vector<double> ry(x.size()), rmean(static_cast<std::size_t>(rows)), rrstd(static_cast<std::size_t>(rows));
  ops::layernorm_forward(ref, ConstView<double>{xd.data(), s}, ConstView<double>{gd.data(), c}, ConstView<double>{bd.data(), c},
                         TensorView<double>{ry.data(), s}, TensorView<double>{rmean.data(), r}, TensorView<double>{rrstd.data(), r}, 1e-5);
  CHECK(relative_error(y.download(), ry) <= fp32_tolerance);
  CHECK(relative_error(mean.download(), rmean) <= fp32_tolerance);
  CHECK(relative_error(rstd.download(), rrstd) <= fp32_tolerance);

  auto dxo = poisoned<float>(gpu, rows * cols);
  ops::layernorm_backward_input(gpu, dx_.cview(s), dgamma_in.cview(c), mean.cview(r), rstd.cview(r), ddy.cview(s), dxo.view(s));
  std::vector<double> rdx(x.size());
  ops::layernorm_backward_input(ref, ConstView<double>{xd.data(), s}, ConstView<double>{gd.data(), c},
                                ConstView<double>{rmean.data(), r}, ConstView<double>{rrstd.data(), r},
                                ConstView<double>{dyd.data(), s}, TensorView<double>{rdx.data(), s});
  const auto got_dx = dxo.download();
  if (cols > 2) {
    CHECK(relative_error(got_dx, rdx) <= fp32_tolerance);
  } else {
    // Two columns normalise to +-1 whatever x is, so dx is 0 up to eps and both sides hold rounding
    // noise: no relative test means anything. Compare with the size of the terms that cancel,
    // rstd * |gamma| * |dy| per element.
    double scale = 0, worst = 0;
    for (index_t i = 0; i < rows * cols; ++i) {
      const std::size_t e = std::size_t(i);
      scale = std::max(scale, rrstd[std::size_t(i / cols)] * std::abs(gd[std::size_t(i % cols)]) * std::abs(dyd[e]));
      worst = std::max(worst, std::abs(double(got_dx[e]) - rdx[e]));
    }
    CHECK(worst <= 1e-5 * scale);
  }

  ops::layernorm_backward_weight(gpu, dx_.cview(s), mean.cview(r), rstd.cview(r), ddy.cview(s), dg.view(c), dbt.view(c));
  auto rdg = cast<double>(dg0), rdb = cast<double>(dbt0);
  ops::layernorm_backward_weight(ref, ConstView<double>{xd.data(), s}, ConstView<double>{rmean.data(), r},
                                 ConstView<double>{rrstd.data(), r}, ConstView<double>{dyd.data(), s},
                                 TensorView<double>{rdg.data(), c}, TensorView<double>{rdb.data(), c});
  const auto first = dg.download();
  CHECK(relative_error(first, rdg) <= fp32_tolerance);
  CHECK(relative_error(dbt.download(), rdb) <= fp32_tolerance);

  // Deterministic: the same accumulation from the same start gives the same bits.
  DeviceArray<float, Gpu> again(gpu, dg0), again_b(gpu, dbt0);
  ops::layernorm_backward_weight(gpu, dx_.cview(s), mean.cview(r), rstd.cview(r), ddy.cview(s), again.view(c), again_b.view(c));
  CHECK(again.download() == first);
}

TEST_CASE("causal attention forward and backward match the host", "[gpu][cuda][ops][attention]") {
  // Both kernel choices. (heads, head dim, T, sequences): T = 1, odd T, head dims below, at and between
  // the simple kernels' 32-column steps; for the tiled kernels (64-row tiles, heads of up to 64
  // columns) one tile, whole tiles, a ragged last tile, several sequences, and heads above 64, which
  // fall back to the simple kernels.
  const auto kernel = GENERATE(backend::cuda::AttentionKernel::simple, backend::cuda::AttentionKernel::tiled);
  const auto [heads, D, T, S] = GENERATE(table<index_t, index_t, index_t, index_t>(
      {{1, 4, 1, 3}, {2, 32, 7, 2}, {4, 16, 64, 2}, {12, 64, 128, 1}, {2, 96, 33, 1}, {1, 256, 40, 1}, {2, 64, 200, 2},
       {3, 48, 130, 1}, {1, 64, 65, 3}, {1, 1, 5, 2}, {2, 33, 63, 1}}));
  Rng rng(std::uint64_t(heads * 1000 + D * 10 + T));
  Gpu gpu;
  gpu.attention = kernel;
  // The tiled choice runs the tiled kernels exactly where they take the head (else the simple ones).
  CHECK(backend::cuda::kernels::attention_tiled::takes<float>(D) == (D <= 64));
  Ref ref;
  const index_t C = heads * D, n = T * S;
  const Shape sq{n, 3 * C}, so{n, C}, sl{n, heads};
  const auto qkv = random_floats(rng, n * 3 * C, -1.5, 1.5), dout = random_floats(rng, n * C);
  const auto qkvd = cast<double>(qkv), doutd = cast<double>(dout);
  DeviceArray<float, Gpu> dqkv_in(gpu, qkv), ddout(gpu, dout);
  auto out = poisoned<float>(gpu, n * C), lse = poisoned<float>(gpu, n * heads), dqkv = poisoned<float>(gpu, n * 3 * C);
  ops::causal_attention_forward(gpu, dqkv_in.cview(sq), out.view(so), lse.view(sl), heads, T);
  std::vector<double> rout(std::size_t(n * C)), rlse(std::size_t(n * heads)), rdqkv(std::size_t(n * 3 * C));
  ops::causal_attention_forward(ref, ConstView<double>{qkvd.data(), sq}, TensorView<double>{rout.data(), so},
                                TensorView<double>{rlse.data(), sl}, heads, T);
  CAPTURE(int(kernel), heads, D, T, S);
  CHECK(relative_error(out.download(), rout) <= fp32_tolerance);
  CHECK(relative_error(lse.download(), rlse) <= fp32_tolerance);
  if (kernel == backend::cuda::AttentionKernel::tiled && D <= 64) {
    // The op ran the tiled kernel, not a silent fallback: the same bits as calling that kernel directly.
    auto direct = poisoned<float>(gpu, n * C), direct_lse = poisoned<float>(gpu, n * heads);
    backend::cuda::kernels::attention_tiled::forward(gpu.context(), dqkv_in.cview(sq).data(), direct.view(so).data(),
                                           direct_lse.view(sl).data(), n, C, int(heads),
                                           backend::cuda::kernels::Sequences::uniform(n, T));
    CHECK(direct.download() == out.download());
    CHECK(direct_lse.download() == lse.download());
  }
  // Backward from the GPU's own forward, against the host's from its own.
  ops::causal_attention_backward(gpu, dqkv_in.cview(sq), out.cview(so), lse.cview(sl), ddout.cview(so), dqkv.view(sq), heads, T);
  ops::causal_attention_backward(ref, ConstView<double>{qkvd.data(), sq}, ConstView<double>{rout.data(), so},
                                 ConstView<double>{rlse.data(), sl}, ConstView<double>{doutd.data(), so},
                                 TensorView<double>{rdqkv.data(), sq}, heads, T);
  const auto first = dqkv.download();
  CHECK(relative_error(first, rdqkv) <= fp32_tolerance);
  // Deterministic: no atomics, so a second run gives the same bits.
  ops::causal_attention_backward(gpu, dqkv_in.cview(sq), out.cview(so), lse.cview(sl), ddout.cview(so), dqkv.view(sq), heads, T);
  CHECK(dqkv.download() == first);
}

TEST_CASE("ring attention on CUDA: every rank of a ring of threads equals the host's attention on whole sequences",
          "[gpu][cuda][ops][attention][cp]") {
  // Each rank a thread with its own context on one device, the keys and values passed round a local
  // ring of device memory (as NCCL's ring passes them); its rows against the host op's on the whole
  // sequences, in double. Chunks of fewer and more than 32 rows (the kernels' key groups), heads of
  // up to 32 and of 40 columns.
  const int cp = GENERATE(2, 4);
  const auto [heads, D, T] = GENERATE(table<index_t, index_t, index_t>({{2, 8, 24}, {1, 40, 144}, {3, 16, 64}}));
  constexpr index_t S = 2;
  CAPTURE(cp, heads, D, T);
  const index_t C = heads * D, n = T * S, W = 3 * C;
  Rng rng(std::uint64_t(cp * 100 + D + T));
  const auto qkv = random_floats(rng, n * W, -1.5, 1.5), dout = random_floats(rng, n * C);
  const auto qkvd = cast<double>(qkv), doutd = cast<double>(dout);
  Ref ref;
  std::vector<double> rout(std::size_t(n * C)), rlse(std::size_t(n * heads)), rdqkv(std::size_t(n * W));
  ops::causal_attention_forward(ref, ConstView<double>{qkvd.data(), Shape{n, W}}, TensorView<double>{rout.data(), Shape{n, C}},
                                TensorView<double>{rlse.data(), Shape{n, heads}}, heads, T);
  ops::causal_attention_backward(ref, ConstView<double>{qkvd.data(), Shape{n, W}}, ConstView<double>{rout.data(), Shape{n, C}},
                                 ConstView<double>{rlse.data(), Shape{n, heads}}, ConstView<double>{doutd.data(), Shape{n, C}},
                                 TensorView<double>{rdqkv.data(), Shape{n, W}}, heads, T);
  testing::LocalRing ring(cp, [](void* to, const void* from, std::size_t bytes) {
    CUPIPE_CHECK_CUDA(cudaDeviceSynchronize());  // the kernels that wrote `from`, and those that last read `to`
    CUPIPE_CHECK_CUDA(cudaMemcpy(to, from, bytes, cudaMemcpyDefault));
    CUPIPE_CHECK_CUDA(cudaDeviceSynchronize());
  });
  const auto size = std::size_t(cp);
  std::vector<std::vector<float>> out(size), lse(size), dqkv(size);
  testing::on_threads(cp, [&](int r) {
    testing::LocalRing::Rank group(ring, r);
    Gpu gpu;
    const index_t rows = n / cp;
    const Shape sq{rows, W}, so{rows, C}, sl{rows, heads};
    DeviceArray<float, Gpu> q(gpu, cp::local_rows(std::span<const float>(qkv), T, r, cp, W));
    DeviceArray<float, Gpu> g(gpu, cp::local_rows(std::span<const float>(dout), T, r, cp, C));
    auto o = poisoned<float>(gpu, rows * C), l = poisoned<float>(gpu, rows * heads), d = poisoned<float>(gpu, rows * W);
    ops::ring_attention_forward(gpu, group, q.cview(sq), o.view(so), l.view(sl), heads, T);
    ops::ring_attention_backward(gpu, group, q.cview(sq), o.cview(so), l.cview(sl), g.cview(so), d.view(sq), heads, T);
    out[std::size_t(r)] = o.download();
    lse[std::size_t(r)] = l.download();
    dqkv[std::size_t(r)] = d.download();
  });
  // cp - 1 passes of keys and values forward; backward cp - 1 more, and cp of their gradients.
  CHECK(ring.passes == 3 * cp - 2);
  for (int r = 0; r < cp; ++r) {
    CAPTURE(r);
    CHECK(relative_error(out[std::size_t(r)], cp::local_rows(std::span<const double>(rout), T, r, cp, C)) <= fp32_tolerance);
    CHECK(relative_error(lse[std::size_t(r)], cp::local_rows(std::span<const double>(rlse), T, r, cp, heads)) <= fp32_tolerance);
    CHECK(relative_error(dqkv[std::size_t(r)], cp::local_rows(std::span<const double>(rdqkv), T, r, cp, W)) <= fp32_tolerance);
  }
}

TEST_CASE("ring attention on CUDA refuses a ring of host memory and rows that are not sequences' shares, naming them",
          "[gpu][cuda][ops][attention][cp][errors]") {
  Gpu gpu;
  testing::LocalRing host_ring(2), device_ring(2, [](void*, const void*, std::size_t) {});
  testing::LocalRing::Rank host_rank(host_ring, 0), device_rank(device_ring, 0);
  auto qkv = poisoned<float>(gpu, 8 * 24), out = poisoned<float>(gpu, 8 * 8), lse = poisoned<float>(gpu, 8 * 2);
  CHECK_THROWS_WITH(ops::ring_attention_forward(gpu, host_rank, qkv.cview(Shape{8, 24}), out.view(Shape{8, 8}),
                                                lse.view(Shape{8, 2}), 2, 16),
                    Catch::Contains("passes host memory (MPI's)"));
  CHECK_THROWS_WITH(ops::ring_attention_forward(gpu, device_rank, qkv.cview(Shape{6, 24}), out.view(Shape{6, 8}),
                                                lse.view(Shape{6, 2}), 2, 16),
                    Catch::Contains("6 rows are not whole sequences' shares (8 rows each: 16 tokens over a context-parallel ring of 2)"));
}

TEST_CASE("packed documents run in one attention launch and match the host", "[gpu][cuda][ops][attention][documents]") {
  // Two sequences of 150 rows cut into documents: one of a single row, one over two 64-row tiles
  // with a ragged end, a whole tile, and short ones; the kernels get all seven at once (cu_seqlens),
  // so a block past a short document's end must leave every row alone.
  const auto kernel = GENERATE(backend::cuda::AttentionKernel::simple, backend::cuda::AttentionKernel::tiled);
  const index_t heads = 2, D = 32, T = 150, C = heads * D;
  const std::vector<std::int32_t> starts = document_starts_of({{1, 70, 79}, {64, 64, 5, 17}});
  const index_t n = index_t(starts.size());
  REQUIRE(n == 2 * T);
  const DocumentStarts documents{starts.data(), n};
  Rng rng(151);
  Gpu gpu;
  gpu.attention = kernel;
  Ref ref;
  const Shape sq{n, 3 * C}, so{n, C}, sl{n, heads};
  const auto qkv = random_floats(rng, n * 3 * C, -1.5, 1.5), dout = random_floats(rng, n * C);
  const auto qkvd = cast<double>(qkv), doutd = cast<double>(dout);
  DeviceArray<float, Gpu> dqkv_in(gpu, qkv), ddout(gpu, dout);
  auto out = poisoned<float>(gpu, n * C), lse = poisoned<float>(gpu, n * heads), dqkv = poisoned<float>(gpu, n * 3 * C);
  std::vector<double> rout(std::size_t(n * C)), rlse(std::size_t(n * heads)), rdqkv(std::size_t(n * 3 * C));
  ops::causal_attention_forward(gpu, dqkv_in.cview(sq), out.view(so), lse.view(sl), heads, T, documents);
  ops::causal_attention_forward(ref, ConstView<double>{qkvd.data(), sq}, TensorView<double>{rout.data(), so},
                                TensorView<double>{rlse.data(), sl}, heads, T, documents);
  CAPTURE(backend::cuda::to_string(kernel));
  CHECK(relative_error(out.download(), rout) <= fp32_tolerance);
  CHECK(relative_error(lse.download(), rlse) <= fp32_tolerance);
  ops::causal_attention_backward(gpu, dqkv_in.cview(sq), out.cview(so), lse.cview(sl), ddout.cview(so), dqkv.view(sq), heads, T,
                                 documents);
  ops::causal_attention_backward(ref, ConstView<double>{qkvd.data(), sq}, ConstView<double>{rout.data(), so},
                                 ConstView<double>{rlse.data(), sl}, ConstView<double>{doutd.data(), so},
                                 TensorView<double>{rdqkv.data(), sq}, heads, T, documents);
  CHECK(relative_error(dqkv.download(), rdqkv) <= fp32_tolerance);
  // The borders matter: without them the same rows give other outputs.
  auto whole = poisoned<float>(gpu, n * C);
  ops::causal_attention_forward(gpu, dqkv_in.cview(sq), whole.view(so), lse.view(sl), heads, T);
  CHECK(relative_error(whole.download(), rout) > 1e-3);
  // Borders that do not describe the rows are refused before any launch, naming the row.
  std::vector<std::int32_t> bad = starts;
  bad[5] = 3;
  CHECK_THROWS_WITH(ops::causal_attention_forward(gpu, dqkv_in.cview(sq), out.view(so), lse.view(sl), heads, T,
                                                  DocumentStarts{bad.data(), n}),
                    Catch::Contains("row 5") && Catch::Contains("document start 3"));
}

TEST_CASE("softmax cross-entropy matches the host", "[gpu][cuda][ops]") {
  const std::uint64_t seed = GENERATE(1, 2);
  const auto [rows, cols] = GENERATE(table<index_t, index_t>({{1, 2}, {4, 10}, {33, 1000}, {7, 1001}, {8, 50257}}));
  Rng rng(seed * 977 + std::uint64_t(rows * cols));
  Gpu gpu;
  Ref ref;
  const Shape s{rows, cols}, r{rows};
  const auto z = random_floats(rng, rows * cols, -8, 8);
  const auto labels = random_ints(rng, rows, cols);
  const auto zd = cast<double>(z);
  const index_t normalizer = rows + 3;
  DeviceArray<float, Gpu> dz(gpu, z);
  DeviceArray<std::int32_t, Gpu> dl(gpu, labels);
  auto loss = poisoned<float>(gpu, 1);
  ops::softmax_cross_entropy_forward(gpu, dz.cview(s), dl.cview(r), loss.view(Shape{1}), normalizer);
  std::vector<double> rloss(1);
  const ConstView<std::int32_t> hl{labels.data(), r};
  ops::softmax_cross_entropy_forward(ref, ConstView<double>{zd.data(), s}, hl, TensorView<double>{rloss.data(), Shape{1}}, normalizer);
  // fp32 computes each row's loss as logsumexp(z) - z[label], a difference of terms up to ~16 here; when
  // the label's logit dominates, the result is far smaller than its terms and a relative bound fails
  // on correct code (the first GPU run: 1.2e-4 for 1 x 2). The bound is therefore on the absolute
  // error, a few fp32 ulps of the terms that are subtracted, summed over the rows.
  constexpr double ulp = 1.1920928955078125e-07;
  double terms = 0;
  for (index_t i = 0; i < rows; ++i) {
    const double* row = zd.data() + i * cols;
    const double m = *std::max_element(row, row + cols);
    double sum = 0;
    for (index_t j = 0; j < cols; ++j) sum += std::exp(row[j] - m);
    terms += std::abs(m + std::log(sum)) + std::abs(row[labels[std::size_t(i)]]);
  }
  const double loss_error = std::abs(double(loss.download()[0]) - rloss[0]);
  INFO("rows " << rows << ", cols " << cols << ": loss " << rloss[0] << ", |error| " << loss_error);
  CHECK(loss_error <= 8 * ulp * terms / double(normalizer));

  auto dlog = poisoned<float>(gpu, rows * cols);
  ops::softmax_cross_entropy_backward(gpu, dz.cview(s), dl.cview(r), dlog.view(s), normalizer, 0.5f);
  std::vector<double> rd(z.size());
  ops::softmax_cross_entropy_backward(ref, ConstView<double>{zd.data(), s}, hl, TensorView<double>{rd.data(), s}, normalizer, 0.5);
  // Each gradient is (p - onehot) * scale with p in [0, 1] computed as exp(z - lse) in fp32: its
  // absolute error is a few ulps of exp's argument (|z - lse| <= ~32 here) times p, so at most
  // 32 * 4 ulps of scale, with p - 1 at the label cancelling as the loss does.
  const auto got = dlog.download();
  double worst = 0;
  for (std::size_t i = 0; i < got.size(); ++i) worst = std::max(worst, std::abs(double(got[i]) - rd[i]));
  const double scale = 0.5 / double(normalizer);
  INFO("worst |error| " << worst << ", scale " << scale);
  CHECK(worst <= 128 * ulp * scale);
}

TEST_CASE("softmax cross-entropy with masked (-inf) logits is finite and matches the host", "[gpu][cuda][ops]") {
  // Each row masks a prefix (1, 4, 5 and 900 logits) or every 4th logit, so some threads' first
  // logit is -inf; the label is never masked.
  const index_t cols = GENERATE(as<index_t>{}, 8, 1000);
  constexpr index_t rows = 5;
  Rng rng{std::uint64_t(cols)};
  Gpu gpu;
  Ref ref;
  const Shape s{rows, cols}, r{rows};
  auto z = random_floats(rng, rows * cols, -4, 4);
  const index_t prefixes[4] = {1, 4, 5, std::min<index_t>(900, cols - 2)};
  for (index_t row = 0; row < 4; ++row)
    for (index_t c = 0; c < prefixes[row]; ++c) z[std::size_t(row * cols + c)] = -std::numeric_limits<float>::infinity();
  for (index_t c = 0; c < cols; c += 4) z[std::size_t(4 * cols + c)] = -std::numeric_limits<float>::infinity();
  const std::vector<std::int32_t> labels(std::size_t(rows), std::int32_t(cols - 1));
  const auto zd = cast<double>(z);
  DeviceArray<float, Gpu> dz(gpu, z);
  DeviceArray<std::int32_t, Gpu> dl(gpu, labels);
  auto loss = poisoned<float>(gpu, 1);
  ops::softmax_cross_entropy_forward(gpu, dz.cview(s), dl.cview(r), loss.view(Shape{1}), rows);
  std::vector<double> rloss(1);
  const ConstView<std::int32_t> hl{labels.data(), r};
  ops::softmax_cross_entropy_forward(ref, ConstView<double>{zd.data(), s}, hl, TensorView<double>{rloss.data(), Shape{1}}, rows);
  const auto got = loss.download();
  REQUIRE(std::isfinite(rloss[0]));
  CHECK(std::isfinite(got[0]));
  CHECK(relative_error(got, rloss) <= fp32_tolerance);
  auto dlog = poisoned<float>(gpu, rows * cols);
  ops::softmax_cross_entropy_backward(gpu, dz.cview(s), dl.cview(r), dlog.view(s), rows);
  std::vector<double> rd(z.size());
  ops::softmax_cross_entropy_backward(ref, ConstView<double>{zd.data(), s}, hl, TensorView<double>{rd.data(), s}, rows);
  const auto got_d = dlog.download();
  for (float v : got_d) REQUIRE(std::isfinite(v));  // a masked logit's gradient is 0, not NaN
  CHECK(relative_error(got_d, rd) <= fp32_tolerance);
}

TEST_CASE("causal attention refuses more sequences than its grid takes, before it sizes its scratch",
          "[gpu][cuda][ops][attention][errors]") {
  const auto kernel = GENERATE(backend::cuda::AttentionKernel::simple, backend::cuda::AttentionKernel::tiled);
  Gpu gpu;
  gpu.attention = kernel;
  const index_t rows = 65536;  // sequences of one row: one more than gridDim.z takes
  auto qkv = gpu.allocate(rows * 3, MemoryTag::activations);
  auto out = gpu.allocate(rows, MemoryTag::activations), lse = gpu.allocate(rows, MemoryTag::activations);
  auto dqkv = gpu.allocate(rows * 3, MemoryTag::gradients);
  const Shape sq{rows, 3}, so{rows, 1}, sl{rows, 1};
  CHECK_THROWS_WITH(ops::causal_attention_forward(gpu, DeviceConstView<float>(qkv.view(sq)), out.view(so), lse.view(sl), 1, 1),
                    Catch::Contains("65536 sequences of 1 rows") && Catch::Contains("split the microbatch"));
  const std::int64_t workspace = gpu.memory.in_use(MemoryTag::workspace);
  CHECK_THROWS_WITH(ops::causal_attention_backward(gpu, DeviceConstView<float>(qkv.view(sq)), DeviceConstView<float>(out.view(so)),
                                                   DeviceConstView<float>(lse.view(sl)), DeviceConstView<float>(out.view(so)),
                                                   dqkv.view(sq), 1, 1),
                    Catch::Contains("more than the attention kernels' grid takes"));
  CHECK(gpu.memory.in_use(MemoryTag::workspace) == workspace);
}

TEST_CASE("softmax cross-entropy: a NaN logit makes the loss and its row's gradient NaN, as on the host", "[gpu][cuda][ops]") {
  // Row 1 holds -inf, -inf, -inf, NaN in its first pack (and in its first four logits when a thread
  // takes one at a time): that thread's partial has no finite logit, and the NaN must not be dropped
  // as an empty partial would be.
  const index_t cols = GENERATE(as<index_t>{}, 7, 32, 1000);
  constexpr index_t rows = 3;
  Rng rng{std::uint64_t(cols) + 11};
  Gpu gpu;
  Ref ref;
  const Shape s{rows, cols}, r{rows};
  auto z = random_floats(rng, rows * cols, -4, 4);
  for (index_t c = 0; c < 3; ++c) z[std::size_t(cols + c)] = -std::numeric_limits<float>::infinity();
  z[std::size_t(cols + 3)] = std::numeric_limits<float>::quiet_NaN();
  const std::vector<std::int32_t> labels(std::size_t(rows), std::int32_t(cols - 1));
  const auto zd = cast<double>(z);
  DeviceArray<float, Gpu> dz(gpu, z);
  DeviceArray<std::int32_t, Gpu> dl(gpu, labels);
  auto loss = poisoned<float>(gpu, 1);
  // Poisoned outputs are NaN already: write a finite value first, so a NaN read back was computed.
  ops::fill(gpu, loss.view(Shape{1}), 0.0f);
  ops::softmax_cross_entropy_forward(gpu, dz.cview(s), dl.cview(r), loss.view(Shape{1}), rows);
  std::vector<double> rloss(1);
  const ConstView<std::int32_t> hl{labels.data(), r};
  ops::softmax_cross_entropy_forward(ref, ConstView<double>{zd.data(), s}, hl, TensorView<double>{rloss.data(), Shape{1}}, rows);
  REQUIRE(std::isnan(rloss[0]));
  CHECK(std::isnan(loss.download()[0]));
  DeviceArray<float, Gpu> dlog(gpu, std::vector<float>(std::size_t(rows * cols), 0.0f));
  ops::softmax_cross_entropy_backward(gpu, dz.cview(s), dl.cview(r), dlog.view(s), rows);
  std::vector<double> rd(z.size());
  ops::softmax_cross_entropy_backward(ref, ConstView<double>{zd.data(), s}, hl, TensorView<double>{rd.data(), s}, rows);
  const auto got = dlog.download();
  for (std::size_t i = 0; i < got.size(); ++i) {
    CAPTURE(cols, i);
    CHECK(std::isnan(got[i]) == std::isnan(rd[i]));
  }
}

TEST_CASE("bias_backward refuses more rows than its grid takes before it sizes its scratch", "[gpu][cuda][ops][errors]") {
  Gpu gpu;
  const index_t rows = 65536 * 256;  // one chunk of 256 rows past the grid's 65535
  auto dy = gpu.allocate(rows, MemoryTag::activations);
  auto db = gpu.allocate(1, MemoryTag::gradients);
  const std::int64_t workspace = gpu.memory.in_use(MemoryTag::workspace);
  CHECK_THROWS_WITH(ops::bias_backward(gpu, DeviceConstView<float>(dy.view(Shape{rows, 1})), db.view(Shape{1})),
                    Catch::Contains("more than this kernel's grid allows"));
  CHECK(gpu.memory.in_use(MemoryTag::workspace) == workspace);
}

TEST_CASE("a label out of range is a cupipe::error naming it", "[gpu][cuda][ops][errors]") {
  Gpu gpu;
  const Shape s{4, 10};
  Rng rng(5);
  DeviceArray<float, Gpu> z(gpu, random_floats(rng, 40));
  DeviceArray<std::int32_t, Gpu> labels(gpu, std::vector<std::int32_t>{1, 2, 3, 12});
  auto loss = poisoned<float>(gpu, 1);
  CHECK_THROWS_WITH(ops::softmax_cross_entropy_forward(gpu, z.cview(s), labels.cview(Shape{4}), loss.view(Shape{1}), 4),
                    Catch::Contains("label 12 at row 3 is outside [0, 10)"));
  auto d = poisoned<float>(gpu, 40);
  CHECK_THROWS_WITH(ops::softmax_cross_entropy_backward(gpu, z.cview(s), labels.cview(Shape{4}), d.view(s), 4),
                    Catch::Contains("label 12 at row 3"));
  // The record is cleared after the throw: good labels work again.
  DeviceArray<std::int32_t, Gpu> good(gpu, std::vector<std::int32_t>{1, 2, 3, 4});
  CHECK_NOTHROW(ops::softmax_cross_entropy_forward(gpu, z.cview(s), good.cview(Shape{4}), loss.view(Shape{1}), 4));
  // Deferred checking reports at synchronize().
  gpu.check_inputs = false;
  ops::softmax_cross_entropy_forward(gpu, z.cview(s), labels.cview(Shape{4}), loss.view(Shape{1}), 4);
  CHECK_THROWS_WITH(gpu.synchronize(), Catch::Contains("label 12 at row 3"));
  // A pipeline step defers the checks and reports once (backend::capabilities): reported, the
  // record throws; dropped (a step that failed otherwise), the next synchronize() is clean.
  gpu.check_inputs = true;
  for (const bool report : {true, false}) {
    const bool previous = backend::defer_input_checks(gpu);
    CHECK(previous);
    CHECK_FALSE(gpu.check_inputs);
    ops::softmax_cross_entropy_forward(gpu, z.cview(s), labels.cview(Shape{4}), loss.view(Shape{1}), 4);
    if (report) {
      CHECK_THROWS_WITH(backend::resume_input_checks(gpu, previous, true), Catch::Contains("label 12 at row 3"));
    } else {
      CHECK_NOTHROW(backend::resume_input_checks(gpu, previous, false));
      CHECK_NOTHROW(gpu.synchronize());
    }
    CHECK(gpu.check_inputs);
  }
}

TEST_CASE("embedding forward and backward match the host, deterministically", "[gpu][cuda][ops]") {
  const std::uint64_t seed = GENERATE(1, 2);
  const index_t dim = GENERATE(1, 3, 64, 130);
  const index_t vocab = 50, rows = 300;
  Rng rng(seed * 17 + std::uint64_t(dim));
  Gpu gpu;
  backend::Host<float> host;
  const Shape t{vocab, dim}, s{rows, dim}, r{rows};
  const auto table = random_floats(rng, vocab * dim), dy = random_floats(rng, rows * dim);
  const auto ids = random_ints(rng, rows, vocab - 5);  // some rows of the table get no gradient
  DeviceArray<float, Gpu> dt(gpu, table), ddy(gpu, dy);
  DeviceArray<std::int32_t, Gpu> did(gpu, ids);
  auto y = poisoned<float>(gpu, rows * dim);
  ops::embedding_forward(gpu, did.cview(r), dt.cview(t), y.view(s));
  std::vector<float> ry(dy.size());
  const ConstView<std::int32_t> hid{ids.data(), r};
  ops::embedding_forward(host, hid, ConstView<float>{table.data(), t}, TensorView<float>{ry.data(), s});
  CHECK(y.download() == ry);

  // The backward adds rows in row order, as the host does, so even float results agree exactly.
  ops::embedding_backward(gpu, did.cview(r), ddy.cview(s), dt.view(t));
  std::vector<float> rt = table;
  ops::embedding_backward(host, hid, ConstView<float>{dy.data(), s}, TensorView<float>{rt.data(), t});
  CHECK(dt.download() == rt);

  DeviceArray<std::int32_t, Gpu> bad(gpu, std::vector<std::int32_t>(std::size_t(rows), std::int32_t(vocab)));
  CHECK_THROWS_WITH(ops::embedding_forward(gpu, bad.cview(r), dt.cview(t), y.view(s)),
                    Catch::Contains("token id 50 at row") && Catch::Contains("outside the vocabulary [0, 50)"));
  CHECK_THROWS_WITH(ops::embedding_backward(gpu, bad.cview(r), ddy.cview(s), dt.view(t)), Catch::Contains("token id 50"));
}

TEST_CASE("a mixture of experts' permutations match the host, bitwise but for the gates' dot products", "[gpu][cuda][ops][moe]") {
  const std::uint64_t seed = GENERATE(1, 2);
  const index_t cols = GENERATE(1, 3, 64, 130);
  const index_t k = GENERATE(1, 2);
  const index_t n = 300;
  Rng rng(seed * 31 + std::uint64_t(cols) * 3 + std::uint64_t(k));
  index_t kept = 0;
  const std::vector<std::int32_t> slots = random_moe_slots(rng, n, k, kept);
  Gpu gpu;
  backend::Host<float> host;
  const Shape tokens{n, cols}, rows{kept, cols}, choices{n, k};
  const auto x = random_floats(rng, n * cols), o = random_floats(rng, kept * cols), gates = random_floats(rng, n * k);
  const auto dy = random_floats(rng, n * cols), dxs = random_floats(rng, kept * cols), dx0 = random_floats(rng, n * cols);
  DeviceArray<float, Gpu> dx_in(gpu, x), d_out(gpu, o), dgate_in(gpu, gates), ddy(gpu, dy), ddxs(gpu, dxs), ddx(gpu, dx0);
  DeviceArray<std::int32_t, Gpu> dslots(gpu, slots);
  const ConstView<std::int32_t> hslots{slots.data(), choices};

  auto xs = poisoned<float>(gpu, kept * cols);  // every kept row is written
  ops::moe_permute(gpu, dx_in.cview(tokens), dslots.cview(choices), xs.view(rows));
  std::vector<float> rxs(std::size_t(kept * cols));
  ops::moe_permute(host, ConstView<float>{x.data(), tokens}, hslots, TensorView<float>{rxs.data(), rows});
  CHECK(xs.download() == rxs);

  // The choices in the host's order, each product rounded before its sum: the host's bits.
  auto y = poisoned<float>(gpu, n * cols);
  ops::moe_unpermute(gpu, d_out.cview(rows), dslots.cview(choices), dgate_in.cview(choices), y.view(tokens));
  std::vector<float> ry(std::size_t(n * cols));
  ops::moe_unpermute(host, ConstView<float>{o.data(), rows}, hslots, ConstView<float>{gates.data(), choices},
                     TensorView<float>{ry.data(), tokens});
  CHECK(y.download() == ry);

  auto d_o = poisoned<float>(gpu, kept * cols);
  auto dgates = poisoned<float>(gpu, n * k);
  ops::moe_unpermute_backward(gpu, ddy.cview(tokens), d_out.cview(rows), dslots.cview(choices), dgate_in.cview(choices),
                              d_o.view(rows), dgates.view(choices));
  std::vector<float> rdo(std::size_t(kept * cols)), rdgates(std::size_t(n * k));
  ops::moe_unpermute_backward(host, ConstView<float>{dy.data(), tokens}, ConstView<float>{o.data(), rows}, hslots,
                              ConstView<float>{gates.data(), choices}, TensorView<float>{rdo.data(), rows},
                              TensorView<float>{rdgates.data(), choices});
  CHECK(d_o.download() == rdo);
  CHECK(relative_error(dgates.download(), rdgates) < fp32_tolerance);  // a warp's sum, not the host's running one

  ops::moe_permute_backward(gpu, ddxs.cview(rows), dslots.cview(choices), ddx.view(tokens));
  std::vector<float> rdx = dx0;
  ops::moe_permute_backward(host, ConstView<float>{dxs.data(), rows}, hslots, TensorView<float>{rdx.data(), tokens});
  CHECK(ddx.download() == rdx);

  std::vector<std::int32_t> past = slots;
  past[3] = std::int32_t(kept);
  DeviceArray<std::int32_t, Gpu> bad(gpu, past);
  CHECK_THROWS_WITH(ops::moe_permute(gpu, dx_in.cview(tokens), bad.cview(choices), xs.view(rows)),
                    Catch::Contains("moe_permute: slot " + std::to_string(kept) + " at choice 3 is outside the " +
                                    std::to_string(kept) + " expert-sorted rows"));
  CHECK_THROWS_WITH(ops::moe_unpermute_backward(gpu, ddy.cview(tokens), d_out.cview(rows), bad.cview(choices),
                                                dgate_in.cview(choices), d_o.view(rows), dgates.view(choices)),
                    Catch::Contains("moe_unpermute_backward: slot " + std::to_string(kept)));
}

TEST_CASE("a mixture-of-experts layer on CUDA equals the host's: its choices, drops, output and gradients", "[gpu][cuda][moe]") {
  // fp32 GEMMs, so that the router's logits are the host's to rounding and every token picks the
  // same experts; capacity 1.25 drops some choices, the same ones.
  constexpr index_t C = 32, H = 64, T = 16;
  using M = MixtureOfExperts<C, H, T, moe::Routing{4, 2, 1.25}>;
  const index_t n = 3 * T, per_row = M::saved_per_row(C);
  index_t params = 0;
  for (const ParamSpec& spec : M::params(C)) params += spec.numel();
  Rng rng(7);
  std::vector<float> p(static_cast<std::size_t>(params));
  M::init(std::span<float>(p), C, rng);
  const auto x = random_floats(rng, n * C), dy = random_floats(rng, n * C);
  const Shape rows{n, C}, saved_shape{n, per_row};

  backend::Host<float> host;
  moe::Tally host_tally;
  host.moe_tally = &host_tally;
  std::vector<float> hy(std::size_t(n * C)), hsaved(std::size_t(n * per_row)), hdx(std::size_t(n * C)), hg(p.size(), 0.0f);
  const ConstView<float> hx{x.data(), rows}, hdy{dy.data(), rows};
  const TensorView<float> hs{hsaved.data(), saved_shape};
  M::forward(host, p.data(), hx, TensorView<float>{hy.data(), rows}, hs);
  M::backward_input(host, p.data(), hx, hs, hdy, TensorView<float>{hdx.data(), rows});
  M::backward_weight(host, hx, hs, hdy, hg.data());

  Gpu gpu;
  gpu.math = backend::cuda::MathMode::fp32;
  moe::Tally gpu_tally;
  gpu.moe_tally = &gpu_tally;
  DeviceArray<float, Gpu> dp(gpu, p), dx_in(gpu, x), ddy(gpu, dy), dg(gpu, std::vector<float>(p.size(), 0.0f));
  auto y = poisoned<float>(gpu, n * C), saved = poisoned<float>(gpu, n * per_row), dx = poisoned<float>(gpu, n * C);
  M::forward(gpu, dp.buffer.data(), dx_in.cview(rows), y.view(rows), saved.view(saved_shape));
  M::backward_input(gpu, dp.buffer.data(), dx_in.cview(rows), saved.view(saved_shape), ddy.cview(rows), dx.view(rows));
  M::backward_weight(gpu, dx_in.cview(rows), saved.view(saved_shape), ddy.cview(rows), dg.buffer.data());

  CHECK(gpu_tally.load == host_tally.load);
  CHECK(gpu_tally.dropped == host_tally.dropped);
  CHECK(host_tally.dropped > 0);
  CHECK(relative_error(y.download(), hy) < fp32_tolerance);
  CHECK(relative_error(dx.download(), hdx) < fp32_tolerance);
  CHECK(relative_error(dg.download(), hg) < fp32_tolerance);
}

// Another width than the case above: nvcc 13.0's front end rewrites a second spelling of a
// specialization with a class-type argument (moe::Routing) into code its host compiler rejects.
using ExpertsWhole = MixtureOfExperts<16, 64, 16, moe::Routing{4, 2, 1.25}>;
using ExpertsPart = MixtureOfExperts<16, 64, 16, moe::Routing{4, 2, 1.25}, 2>;

TEST_CASE("a mixture-of-experts layer with expert parallelism on CUDA: two ranks on threads equal the host's whole layer",
          "[gpu][cuda][moe][experts]") {
  // Two contexts on one device, each a rank of a local expert group: of host memory, so that the
  // all-to-alls stage through the host (moe/backend_transfer.hpp), or of device memory (cudaMemcpy,
  // as NCCL's group takes the rows where they are); the rows are reordered on the device. Against
  // the host's whole layer on each rank's rows (fp32 GEMMs: the same choices).
  const bool device_group = GENERATE(false, true);
  CAPTURE(device_group);
  constexpr index_t C = 16, T = 16;
  using Whole = ExpertsWhole;
  using Part = ExpertsPart;
  const index_t n = 2 * T, per_row = Part::saved_per_row(C);
  const testing::ExpertReference<Whole, float> ref(C, n, 17);
  const Shape rows{n, C};

  testing::LocalExperts shared(2, device_group ? testing::LocalExperts::Copy([](void* to, const void* from, std::size_t bytes) {
    CUPIPE_CHECK_CUDA(cudaMemcpy(to, from, bytes, cudaMemcpyDefault));
    CUPIPE_CHECK_CUDA(cudaDeviceSynchronize());  // a device-to-device cudaMemcpy may return before it is done
  }) : testing::LocalExperts::Copy{});
  std::array<std::vector<float>, 2> y, dx, g;
  std::array<moe::Tally, 2> tallies;
  testing::on_threads(2, [&](int rank) {
    const std::size_t t = std::size_t(rank);
    testing::LocalExpertGroup group(shared, rank);
    Gpu gpu;
    gpu.math = backend::cuda::MathMode::fp32;
    gpu.moe_tally = &tallies[t];
    gpu.expert_group = &group;
    const std::vector<float> part = testing::expert_part<Whole, Part>(ref.p, C, rank);
    DeviceArray<float, Gpu> dp(gpu, part), dx_in(gpu, ref.x[t]), ddy(gpu, ref.dy[t]), dg(gpu, std::vector<float>(part.size(), 0.0f));
    auto yd = poisoned<float>(gpu, n * C), saved = poisoned<float>(gpu, n * per_row), dxd = poisoned<float>(gpu, n * C);
    const Shape saved_shape{n, per_row};
    Part::forward(gpu, dp.buffer.data(), dx_in.cview(rows), yd.view(rows), saved.view(saved_shape));
    Part::backward_input(gpu, dp.buffer.data(), dx_in.cview(rows), saved.view(saved_shape), ddy.cview(rows), dxd.view(rows));
    Part::backward_weight(gpu, dx_in.cview(rows), saved.view(saved_shape), ddy.cview(rows), dg.buffer.data());
    y[t] = yd.download();
    dx[t] = dxd.download();
    g[t] = dg.download();
  });
  const std::size_t router = std::size_t(Whole::E * C);
  for (std::size_t t = 0; t < 2; ++t) {
    CAPTURE(t);
    CHECK(tallies[t].all_to_alls == 4);
    CHECK(relative_error(y[t], ref.y[t]) < fp32_tolerance);
    CHECK(relative_error(dx[t], ref.dx[t]) < fp32_tolerance);
    const std::vector<float> expert_sums = testing::expert_part<Whole, Part>(ref.summed, C, int(t));
    CHECK(relative_error(std::vector<float>(g[t].begin(), g[t].begin() + std::ptrdiff_t(router)),
                         std::vector<float>(ref.g[t].begin(), ref.g[t].begin() + std::ptrdiff_t(router))) < fp32_tolerance);
    CHECK(relative_error(std::vector<float>(g[t].begin() + std::ptrdiff_t(router), g[t].end()),
                         std::vector<float>(expert_sums.begin() + std::ptrdiff_t(router), expert_sums.end())) < fp32_tolerance);
  }
  CHECK(tallies[0].dropped + tallies[1].dropped > 0);
}

TEST_CASE("an overlapped pair taking turns on CUDA equals the pair back to back, bitwise, with tokens in flight beside "
          "the partner",
          "[gpu][cuda][moe][experts][turns]") {
  // Two ranks on threads, each a CUDA context with device-memory groups (as NCCL's). DualPipeV's pair:
  // the F is microbatch a's forward, the B microbatch b's backward (its forward ran first). Back to
  // back on one thread, then taking turns (pipeline/paired_turns.hpp): the F on a second thread, on
  // the side stream and its own group, the B on the main stream, each handing over its turn while
  // its all-to-all is in flight. Same kernels on the same rows: the same bits.
  constexpr index_t C = 16, T = 16;
  using Whole = ExpertsWhole;
  using Part = ExpertsPart;
  const index_t n = 2 * T, per_row = Part::saved_per_row(C);
  const testing::ExpertReference<Whole, float> ref(C, n, 23);
  const Shape rows{n, C}, saved_shape{n, per_row};
  const testing::LocalExperts::Copy copy = [](void* to, const void* from, std::size_t bytes) {
    CUPIPE_CHECK_CUDA(cudaMemcpy(to, from, bytes, cudaMemcpyDefault));
    CUPIPE_CHECK_CUDA(cudaDeviceSynchronize());  // a device-to-device cudaMemcpy may return before it is done
  };
  struct Result {
    std::vector<float> y, dx, g;
    moe::Tally tally;
    long hand_overs = 0;
    bool restored = true;
  };
  const auto run = [&](bool turns) {
    testing::LocalExperts shared(2, copy), paired_shared(2, copy);
    std::array<Result, 2> out;
    testing::on_threads(2, [&](int rank) {
      const std::size_t t = std::size_t(rank);
      testing::LocalExpertGroup group(shared, rank), paired(paired_shared, rank);
      Gpu gpu;
      gpu.math = backend::cuda::MathMode::fp32;
      gpu.moe_tally = &out[t].tally;
      gpu.expert_group = &group;
      const std::vector<float> part = testing::expert_part<Whole, Part>(ref.p, C, rank);
      DeviceArray<float, Gpu> dp(gpu, part), xa(gpu, ref.x[1 - t]), xb(gpu, ref.x[t]), dyb(gpu, ref.dy[t]),
          dg(gpu, std::vector<float>(part.size(), 0.0f));
      auto ya = poisoned<float>(gpu, n * C), yb = poisoned<float>(gpu, n * C), dxb = poisoned<float>(gpu, n * C);
      auto saved_a = poisoned<float>(gpu, n * per_row), saved_b = poisoned<float>(gpu, n * per_row);
      Part::forward(gpu, dp.buffer.data(), xb.cview(rows), yb.view(rows), saved_b.view(saved_shape));
      const auto f = [&] {
        if (turns) backend::capabilities<Gpu>::overlap_begin(gpu);  // the F's ops on the side stream
        Part::forward(gpu, dp.buffer.data(), xa.cview(rows), ya.view(rows), saved_a.view(saved_shape));
      };
      const auto b = [&] {
        Part::backward_input(gpu, dp.buffer.data(), xb.cview(rows), saved_b.view(saved_shape), dyb.cview(rows), dxb.view(rows));
        Part::backward_weight(gpu, xb.cview(rows), saved_b.view(saved_shape), dyb.cview(rows), dg.buffer.data());
      };
      if (turns) {
        gpu.paired_expert_group = &paired;
        pipeline::PairedTurns pair;
        const std::array<std::exception_ptr, 2> errors = pipeline::take_turns(gpu, pair, f, b);
        // Before the join, which clears the side stream itself; no Catch assertion on a thread.
        out[t].restored = gpu.expert_group == &group && !gpu.side_stream() && gpu.context().overlapping();
        backend::capabilities<Gpu>::overlap_join(gpu);
        for (const std::exception_ptr& e : errors)
          if (e) std::rethrow_exception(e);
        out[t].hand_overs = pair.hand_overs();
      } else {
        f();
        b();
      }
      out[t].y = ya.download();
      out[t].dx = dxb.download();
      out[t].g = dg.download();
    });
    return out;
  };
  const std::array<Result, 2> alone = run(false), paired = run(true);
  for (std::size_t t = 0; t < 2; ++t) {
    CAPTURE(t);
    CHECK(paired[t].y == alone[t].y);
    CHECK(paired[t].dx == alone[t].dx);
    CHECK(paired[t].g == alone[t].g);
    CHECK(paired[t].tally.load == alone[t].tally.load);
    CHECK(paired[t].tally.all_to_alls == alone[t].tally.all_to_alls);
    CHECK(alone[t].tally.all_to_alls_beside_partner == 0);
    CHECK(paired[t].tally.all_to_alls_beside_partner > 0);
    CHECK(paired[t].hand_overs > 0);
    CHECK(paired[t].restored);
  }
}

TEST_CASE("vocabulary-part embedding and cross-entropy match the host", "[gpu][cuda][ops][tensor_parallel]") {
  // One rank's part of a vocabulary of 1000 split in 4 (a vocabulary-parallel embedding and head):
  // ids and labels fall in every part, so rows of other parts must come out zero / without gradient.
  const index_t vocab = 1000, part_rows = 250, dim = GENERATE(3, 64), rows = 97;
  const ops::VocabPart part{GENERATE(index_t(0), index_t(500)), vocab};
  Rng rng(std::uint64_t(dim + part.first));
  Gpu gpu;
  backend::Host<float> host;
  Ref ref;
  const Shape t{part_rows, dim}, s{rows, dim}, r{rows}, zs{rows, part_rows};
  const auto table = random_floats(rng, part_rows * dim), dy = random_floats(rng, rows * dim);
  const auto ids = random_ints(rng, rows, vocab), labels = random_ints(rng, rows, vocab);
  DeviceArray<float, Gpu> dt(gpu, table), ddy(gpu, dy);
  DeviceArray<std::int32_t, Gpu> did(gpu, ids), dl(gpu, labels);
  const ConstView<std::int32_t> hid{ids.data(), r}, hl{labels.data(), r};
  auto y = poisoned<float>(gpu, rows * dim);
  ops::embedding_forward(gpu, did.cview(r), dt.cview(t), y.view(s), part);
  std::vector<float> ry(dy.size());
  ops::embedding_forward(host, hid, ConstView<float>{table.data(), t}, TensorView<float>{ry.data(), s}, part);
  CHECK(y.download() == ry);
  ops::embedding_backward(gpu, did.cview(r), ddy.cview(s), dt.view(t), part);
  std::vector<float> rt = table;
  ops::embedding_backward(host, hid, ConstView<float>{dy.data(), s}, TensorView<float>{rt.data(), t}, part);
  CHECK(dt.download() == rt);

  const auto z = random_floats(rng, rows * part_rows, -8, 8);
  const auto zd = cast<double>(z);
  DeviceArray<float, Gpu> dz(gpu, z);
  auto stats = poisoned<float>(gpu, rows * 3);
  ops::softmax_cross_entropy_part_stats(gpu, dz.cview(zs), dl.cview(r), stats.view(Shape{rows, 3}), part);
  std::vector<double> rstats(static_cast<std::size_t>(rows * 3));
  ops::softmax_cross_entropy_part_stats(ref, ConstView<double>{zd.data(), zs}, hl, TensorView<double>{rstats.data(), Shape{rows, 3}}, part);
  const auto got = stats.download();
  for (std::size_t i = 0; i < got.size(); ++i) CHECK(std::abs(double(got[i]) - rstats[i]) <= 1e-5 * std::max(1.0, std::abs(rstats[i])));

  // A whole-row log-sum-exp (any value above every logit will do for the comparison).
  std::vector<float> lse(static_cast<std::size_t>(rows));
  for (auto& v : lse) v = float(9 + rng.uniform(0, 1));
  DeviceArray<float, Gpu> dlse(gpu, lse);
  const auto lsed = cast<double>(lse);
  auto dlog = poisoned<float>(gpu, rows * part_rows);
  ops::softmax_cross_entropy_part_backward(gpu, dz.cview(zs), dl.cview(r), dlse.cview(r), dlog.view(zs), rows, part);
  std::vector<double> rd(z.size());
  ops::softmax_cross_entropy_part_backward(ref, ConstView<double>{zd.data(), zs}, hl, ConstView<double>{lsed.data(), r},
                                           TensorView<double>{rd.data(), zs}, rows, part);
  const auto gd = dlog.download();
  double worst = 0;
  for (std::size_t i = 0; i < gd.size(); ++i) worst = std::max(worst, std::abs(double(gd[i]) - rd[i]));
  CHECK(worst <= 128 * 1.1920928955078125e-07 / double(rows));

  DeviceArray<std::int32_t, Gpu> bad(gpu, std::vector<std::int32_t>(std::size_t(rows), std::int32_t(vocab)));
  CHECK_THROWS_WITH(ops::embedding_forward(gpu, bad.cview(r), dt.cview(t), y.view(s), part),
                    Catch::Contains("token id 1000 at row") && Catch::Contains("[0, 1000)"));
  CHECK_THROWS_WITH(ops::softmax_cross_entropy_part_stats(gpu, dz.cview(zs), bad.cview(r), stats.view(Shape{rows, 3}), part),
                    Catch::Contains("label 1000 at row") && Catch::Contains("[0, 1000)"));
}

TEST_CASE("optimizer updates match the host", "[gpu][cuda][ops]") {
  const std::uint64_t seed = GENERATE(1, 2);
  const index_t n = GENERATE(1, 7, 4096, 10001);
  Rng rng(seed * 3 + std::uint64_t(n));
  Gpu gpu;
  Ref ref;
  const Shape s{n};
  const auto p0 = random_floats(rng, n), g = random_floats(rng, n), m0 = random_floats(rng, n, -0.1, 0.1),
             v0 = random_floats(rng, n, 0, 0.01);
  auto pd = cast<double>(p0), gd = cast<double>(g), md = cast<double>(m0), vd = cast<double>(v0);

  SECTION("sgd with momentum, plain and nesterov") {
    const bool nesterov = GENERATE(false, true);
    const ops::SgdHyper h{.lr = 0.1, .momentum = 0.9, .weight_decay = 0.01, .nesterov = nesterov};
    DeviceArray<float, Gpu> p(gpu, p0), dg(gpu, g), vel(gpu, m0);
    for (int step = 0; step < 3; ++step) {
      ops::sgd_update(gpu, p.view(s), dg.cview(s), vel.view(s), h, 0.5f);
      ops::sgd_update(ref, TensorView<double>{pd.data(), s}, ConstView<double>{gd.data(), s}, TensorView<double>{md.data(), s}, h, 0.5);
    }
    CHECK(relative_error(p.download(), pd) <= fp32_tolerance);
    CHECK(relative_error(vel.download(), md) <= fp32_tolerance);
  }
  SECTION("adamw") {
    const ops::AdamWHyper h{.lr = 1e-2, .beta1 = 0.9, .beta2 = 0.95, .eps = 1e-8, .weight_decay = 0.1};
    DeviceArray<float, Gpu> p(gpu, p0), dg(gpu, g), m(gpu, m0), v(gpu, v0);
    for (std::int64_t step = 1; step <= 3; ++step) {
      ops::adamw_update(gpu, p.view(s), dg.cview(s), m.view(s), v.view(s), h, step, 0.5f);
      ops::adamw_update(ref, TensorView<double>{pd.data(), s}, ConstView<double>{gd.data(), s}, TensorView<double>{md.data(), s},
                        TensorView<double>{vd.data(), s}, h, step, 0.5);
    }
    CHECK(relative_error(p.download(), pd) <= fp32_tolerance);
    CHECK(relative_error(m.download(), md) <= fp32_tolerance);
    CHECK(relative_error(v.download(), vd) <= fp32_tolerance);
  }
  SECTION("adamw with fp32 master weights for bf16 parameters") {
    const ops::AdamWHyper h{};
    DeviceArray<float, Gpu> master(gpu, p0), dg(gpu, g), m(gpu, m0), v(gpu, v0);
    auto param = gpu.allocate<cupipe::bfloat16>(n, MemoryTag::weights);
    ops::poison(gpu, param.view(s));
    for (std::int64_t step = 1; step <= 2; ++step) {
      ops::adamw_update_master(gpu, master.view(s), param.view(s), dg.cview(s), m.view(s), v.view(s), h, step, 1.0f);
      ops::adamw_update(ref, TensorView<double>{pd.data(), s}, ConstView<double>{gd.data(), s}, TensorView<double>{md.data(), s},
                        TensorView<double>{vd.data(), s}, h, step, 1.0);
    }
    const auto got_master = master.download();
    CHECK(relative_error(got_master, pd) <= fp32_tolerance);
    std::vector<cupipe::bfloat16> got(static_cast<std::size_t>(n));
    gpu.download(param.data(), std::span<cupipe::bfloat16>(got));
    for (std::size_t i = 0; i < got.size(); ++i) REQUIRE(got[i].bits == cupipe::bfloat16(got_master[i]).bits);
  }
}

TEST_CASE("sum_of_squares matches the host", "[gpu][cuda][ops]") {
  const index_t n = GENERATE(1, 5, 1000, (1 << 20) + 3);
  Rng rng(static_cast<std::uint64_t>(n));
  Gpu gpu;
  Ref ref;
  const auto x = random_floats(rng, n, -2, 2);
  const auto xd = cast<double>(x);
  DeviceArray<float, Gpu> dx_(gpu, x);
  const double got = ops::sum_of_squares(gpu, dx_.cview(Shape{n}));
  const double want = ops::sum_of_squares(ref, ConstView<double>{xd.data(), Shape{n}});
  CHECK(std::abs(got - want) <= 1e-12 * want);
  CHECK(ops::sum_of_squares(gpu, dx_.cview(Shape{n})) == got);  // fixed reduction order
  // Enqueued into a slot of device memory (no wait), twice back to back through the same scratch,
  // then read with one copy: the same bits as the waiting op; an empty view writes 0.
  auto slots = gpu.allocate<double>(3, MemoryTag::workspace);
  ops::sum_of_squares_into(gpu, dx_.cview(Shape{n}), slots.data());
  ops::sum_of_squares_into(gpu, dx_.cview(Shape{n / 2 + 1}), slots.data() + 1);
  ops::sum_of_squares_into(gpu, dx_.cview(Shape{0}), slots.data() + 2);
  std::vector<double> back(3, -1.0);
  gpu.download(slots.data(), std::span<double>(back));
  CHECK(back[0] == got);
  CHECK(back[1] == ops::sum_of_squares(gpu, dx_.cview(Shape{n / 2 + 1})));
  CHECK(back[2] == 0.0);
  static_assert(pipeline::defers_sums_of_squares<Gpu>);
}

namespace {

struct GemmCase {
  index_t m, n, k;
};

/// c = alpha op(a) op(b) + beta c on the host in double.
std::vector<double> host_gemm(Transpose ta, Transpose tb, double alpha, const std::vector<double>& a, Shape as,
                              const std::vector<double>& b, Shape bs, double beta, std::vector<double> c, Shape cs) {
  Ref ref;
  ops::gemm(ref, ta, tb, alpha, ConstView<double>{a.data(), as}, ConstView<double>{b.data(), bs}, beta,
            TensorView<double>{c.data(), cs});
  return c;
}

}  // namespace

TEST_CASE("gemm matches the host in fp32, tf32 and bf16", "[gpu][cuda][ops][gemm]") {
  const GemmCase shape = GENERATE(GemmCase{1, 1, 1}, GemmCase{7, 13, 5}, GemmCase{64, 128, 64}, GemmCase{129, 65, 257},
                                  GemmCase{33, 768, 3}, GemmCase{5, 6, 0});
  const Transpose ta = GENERATE(Transpose::no, Transpose::yes), tb = GENERATE(Transpose::no, Transpose::yes);
  const auto [m, n, k] = shape;
  Rng rng(std::uint64_t(m * 1000003 + n * 1009 + k) + (ta == Transpose::yes) * 2 + (tb == Transpose::yes));
  const Shape as = ta == Transpose::yes ? Shape{k, m} : Shape{m, k};
  const Shape bs = tb == Transpose::yes ? Shape{n, k} : Shape{k, n};
  const Shape cs{m, n};
  const auto a = random_floats(rng, m * k), b = random_floats(rng, k * n), c0 = random_floats(rng, m * n);
  Gpu gpu;
  DeviceArray<float, Gpu> da(gpu, a), db(gpu, b);

  SECTION("fp32 and tf32, with alpha and beta") {
    const bool tf32 = GENERATE(false, true);
    gpu.math = tf32 ? backend::cuda::MathMode::tf32 : backend::cuda::MathMode::fp32;
    DeviceArray<float, Gpu> dc(gpu, c0);
    ops::gemm(gpu, ta, tb, 0.5f, da.cview(as), db.cview(bs), -1.25f, dc.view(cs));
    const auto want = host_gemm(ta, tb, 0.5, cast<double>(a), as, cast<double>(b), bs, -1.25, cast<double>(c0), cs);
    CHECK(relative_error(dc.download(), want) <= (tf32 ? tf32_tolerance : fp32_tolerance));

    // beta = 0 does not read c, so NaN there does not survive; the second call reuses the cached plan.
    auto poisoned_c = poisoned<float>(gpu, m * n);
    const std::size_t plans = gpu.context().gemm_plans().size();
    ops::gemm(gpu, ta, tb, 1.0f, da.cview(as), db.cview(bs), 0.0f, poisoned_c.view(cs));
    ops::gemm(gpu, ta, tb, 1.0f, da.cview(as), db.cview(bs), 0.0f, poisoned_c.view(cs));
    CHECK(gpu.context().gemm_plans().size() <= plans + 1);
    const auto want0 = host_gemm(ta, tb, 1.0, cast<double>(a), as, cast<double>(b), bs, 0.0, std::vector<double>(std::size_t(m * n)), cs);
    CHECK(relative_error(poisoned_c.download(), want0) <= (tf32 ? tf32_tolerance : fp32_tolerance));
  }
  SECTION("bf16 operands, fp32 accumulation, fp32 or bf16 output") {
    auto a16 = gpu.allocate<cupipe::bfloat16>(m * k, MemoryTag::activations);
    auto b16 = gpu.allocate<cupipe::bfloat16>(k * n, MemoryTag::activations);
    ops::convert(gpu, da.cview(Shape{m * k}), a16.view(Shape{m * k}));
    ops::convert(gpu, db.cview(Shape{k * n}), b16.view(Shape{k * n}));
    std::vector<double> ar, br;  // the reference sees the same rounded inputs
    for (float v : a) ar.push_back(double(float(cupipe::bfloat16(v))));
    for (float v : b) br.push_back(double(float(cupipe::bfloat16(v))));
    const auto want = host_gemm(ta, tb, 1.0, ar, as, br, bs, 0.0, std::vector<double>(std::size_t(m * n)), cs);
    auto c32 = poisoned<float>(gpu, m * n);
    ops::gemm(gpu, ta, tb, 1.0f, DeviceConstView<cupipe::bfloat16>(a16.view(as)), DeviceConstView<cupipe::bfloat16>(b16.view(bs)), 0.0f,
              c32.view(cs));
    CHECK(relative_error(c32.download(), want) <= bf16_tolerance);
    auto c16 = gpu.allocate<cupipe::bfloat16>(m * n, MemoryTag::activations);
    ops::poison(gpu, c16.view(cs));
    ops::gemm(gpu, ta, tb, 1.0f, DeviceConstView<cupipe::bfloat16>(a16.view(as)), DeviceConstView<cupipe::bfloat16>(b16.view(bs)), 0.0f,
              c16.view(cs));
    auto back = poisoned<float>(gpu, m * n);
    ops::convert(gpu, DeviceConstView<cupipe::bfloat16>(c16.view(cs)), back.view(cs));
    CHECK(relative_error(back.download(), want) <= bf16_tolerance);
  }
}

TEST_CASE("fused gemm_bias and gemm_bias_gelu match gemm, bias_add and gelu on the host", "[gpu][cuda][ops][gemm]") {
  const GemmCase shape = GENERATE(GemmCase{7, 13, 5}, GemmCase{64, 128, 64}, GemmCase{100, 256, 96}, GemmCase{9, 30, 0});
  const auto [m, n, k] = shape;
  Rng rng(std::uint64_t(m + n + k));
  const Shape as{m, k}, bs{n, k}, cs{m, n};  // Linear's layout: x (m, k) W^T, W (n, k)
  const auto a = random_floats(rng, m * k), b = random_floats(rng, n * k), bias = random_floats(rng, n);
  Gpu gpu;
  // fp32: exact products, and the GELU from the kernels (gelu_epilogue_allowed); tf32: TF32 products
  // and cuBLASLt's GELU epilogue, which may use the hardware tanh approximation.
  const bool tf32 = GENERATE(false, true);
  gpu.math = tf32 ? backend::cuda::MathMode::tf32 : backend::cuda::MathMode::fp32;
  const double tolerance = tf32 ? tf32_tolerance : fp32_tolerance;
  Ref ref;
  DeviceArray<float, Gpu> da(gpu, a), db(gpu, b), dbias(gpu, bias);
  auto pre_want = host_gemm(Transpose::no, Transpose::yes, 1.0, cast<double>(a), as, cast<double>(b), bs, 0.0,
                            std::vector<double>(std::size_t(m * n)), cs);
  const auto biasd = cast<double>(bias);
  ops::bias_add(ref, TensorView<double>{pre_want.data(), cs}, ConstView<double>{biasd.data(), Shape{n}});
  std::vector<double> gelu_want(pre_want.size());
  ops::gelu_forward(ref, ConstView<double>{pre_want.data(), cs}, TensorView<double>{gelu_want.data(), cs});

  CAPTURE(m, n, k, tf32);
  auto y = poisoned<float>(gpu, m * n);
  ops::gemm_bias(gpu, Transpose::no, Transpose::yes, 1.0f, da.cview(as), db.cview(bs), dbias.cview(Shape{n}), y.view(cs));
  CHECK(relative_error(y.download(), pre_want) <= tolerance);

  auto g = poisoned<float>(gpu, m * n), pre = poisoned<float>(gpu, m * n);
  ops::gemm_bias_gelu(gpu, Transpose::no, Transpose::yes, 1.0f, da.cview(as), db.cview(bs), dbias.cview(Shape{n}),
                      pre.view(cs), g.view(cs));
  CHECK(relative_error(g.download(), gelu_want) <= tolerance);
  CHECK(relative_error(pre.download(), pre_want) <= tolerance);
  auto g2 = poisoned<float>(gpu, m * n);
  ops::gemm_bias_gelu(gpu, Transpose::no, Transpose::yes, 1.0f, da.cview(as), db.cview(bs), dbias.cview(Shape{n}),
                      DeviceView<float>{}, g2.view(cs));
  CHECK(relative_error(g2.download(), gelu_want) <= tolerance);
}

// Linear's weight gradient takes the fused op on CUDA, and a LinearGELU pairs with the Linear after it
// (layers/linear.hpp), in fp32 and in bf16 storage; the host backend does neither.
static_assert(detail::fuses_bias_grad<backend::Cuda<float>, float> && detail::fuses_dgelu<backend::Cuda<float>, float>);
static_assert(detail::fuses_bias_grad<backend::Cuda<cupipe::bfloat16, float>, cupipe::bfloat16> &&
              detail::fuses_dgelu<backend::Cuda<cupipe::bfloat16, float>, cupipe::bfloat16>);
static_assert(backward_pair<LinearGELU<8, 32>, Linear<32, 8>, backend::Cuda<float>, float>::fused);
static_assert(!backward_pair<LinearGELU<8, 32>, Linear<32, 8>, backend::Host<float>, float>::fused);

TEST_CASE("fused gemm_bias_grad and gemm_dgelu match gemm, bias_backward and gelu_backward on the host", "[gpu][cuda][ops][gemm]") {
  // (rows, out, in) of a Linear: dy (rows, out), x (rows, in), W (out, in).
  const GemmCase shape = GENERATE(GemmCase{7, 13, 5}, GemmCase{64, 128, 64}, GemmCase{100, 256, 96}, GemmCase{33, 24, 40},
                                  GemmCase{0, 8, 16});
  const auto [rows, out, in] = shape;
  Rng rng(std::uint64_t(rows * 7 + out * 3 + in));
  const Shape dys{rows, out}, xs{rows, in}, ws{out, in};
  const auto dy = random_floats(rng, rows * out), x = random_floats(rng, rows * in), w = random_floats(rng, out * in);
  const auto dw0 = random_floats(rng, out * in), db0 = random_floats(rng, out + 1), pre = random_floats(rng, rows * in);
  Gpu gpu;
  // fp32: exact products and the GELU kernel; tf32: TF32 products, the BGRADB and DGELU epilogues.
  const bool tf32 = GENERATE(false, true);
  gpu.math = tf32 ? backend::cuda::MathMode::tf32 : backend::cuda::MathMode::fp32;
  const double tolerance = tf32 ? tf32_tolerance : fp32_tolerance;
  Ref ref;
  DeviceArray<float, Gpu> ddy(gpu, dy), dx(gpu, x), dwt(gpu, w), dpre(gpu, pre);

  SECTION("gemm_bias_grad accumulates both gradients, call after call") {
    // The bias gradient at offset 0 and at offset 1 (4 bytes: the BGRADB sums go to scratch either
    // way; the add into dbias then takes the kernel's unaligned path), as a Linear's bias sits in a
    // stage's flat gradients. alpha 1 takes the epilogue (Linear's case), alpha 0.5 the unfused
    // path (the sums are never scaled), so both paths run in both math modes.
    const index_t offset = GENERATE(index_t(0), index_t(1));
    const float alpha = GENERATE(1.0f, 0.5f);
    DeviceArray<float, Gpu> ddw(gpu, dw0), ddb(gpu, db0);
    const DeviceView<float> db_view{ddb.buffer.data() + offset, Shape{out}};
    for (int call = 0; call < 2; ++call)
      ops::gemm_bias_grad(gpu, alpha, ddy.cview(dys), dx.cview(xs), 1.0f, ddw.view(ws), db_view);
    auto dw_want = cast<double>(dw0);
    std::vector<double> db_want = cast<double>(db0);
    for (int call = 0; call < 2; ++call) {
      dw_want = host_gemm(Transpose::yes, Transpose::no, alpha, cast<double>(dy), dys, cast<double>(x), xs, 1.0, dw_want, ws);
      const auto dyd = cast<double>(dy);
      ops::bias_backward(ref, ConstView<double>{dyd.data(), dys}, TensorView<double>{db_want.data() + offset, Shape{out}});
    }
    CAPTURE(rows, out, in, offset, alpha, tf32);
    CHECK(relative_error(ddw.download(), dw_want) <= tolerance);
    CHECK(relative_error(ddb.download(), db_want) <= tolerance);  // includes the untouched neighbour
  }
  SECTION("gemm_dgelu is the product carried through GELU's gradient") {
    if (rows == 0) return;  // nothing to compare
    auto prod = host_gemm(Transpose::no, Transpose::no, 1.0, cast<double>(dy), dys, cast<double>(w), ws, 0.0,
                          std::vector<double>(std::size_t(rows * in)), xs);
    const auto pred = cast<double>(pre);
    std::vector<double> want(prod.size());
    ops::gelu_backward(ref, ConstView<double>{pred.data(), xs}, ConstView<double>{prod.data(), xs}, TensorView<double>{want.data(), xs});
    auto d = poisoned<float>(gpu, rows * in);
    ops::gemm_dgelu(gpu, Transpose::no, Transpose::no, 1.0f, ddy.cview(dys), dwt.cview(ws), dpre.cview(xs), d.view(xs));
    CAPTURE(rows, out, in, tf32);
    CHECK(relative_error(d.download(), want) <= tolerance);
  }
  SECTION("bf16 operands: fp32 gradients, a bf16 GELU-input gradient") {
    if (rows == 0 || tf32) return;  // bf16 has no TF32 setting; one pass is enough
    using Bf16Gpu = backend::Cuda<cupipe::bfloat16, float>;
    Bf16Gpu g16;
    const auto round = [](const std::vector<float>& v) {
      std::vector<cupipe::bfloat16> out;
      for (float f : v) out.push_back(cupipe::bfloat16(f));
      return out;
    };
    const auto widen = [](const std::vector<cupipe::bfloat16>& v) {
      std::vector<double> out;
      for (cupipe::bfloat16 b : v) out.push_back(double(float(b)));
      return out;
    };
    const auto dy16 = round(dy), x16 = round(x), w16 = round(w), pre16 = round(pre);
    DeviceArray<cupipe::bfloat16, Bf16Gpu> ddy16(g16, dy16), dx16(g16, x16), dw16(g16, w16), dpre16(g16, pre16);
    DeviceArray<float, Bf16Gpu> ddw(g16, dw0), ddb(g16, std::vector<float>(db0.begin(), db0.begin() + out));
    ops::gemm_bias_grad(g16, 1.0f, ddy16.cview(dys), dx16.cview(xs), 1.0f, ddw.view(ws), ddb.view(Shape{out}));
    const auto dw_want = host_gemm(Transpose::yes, Transpose::no, 1.0, widen(dy16), dys, widen(x16), xs, 1.0, cast<double>(dw0), ws);
    std::vector<double> db_want(db0.begin(), db0.begin() + out);
    const auto dyw = widen(dy16);
    ops::bias_backward(ref, ConstView<double>{dyw.data(), dys}, TensorView<double>{db_want.data(), Shape{out}});
    CAPTURE(rows, out, in);
    CHECK(relative_error(ddw.download(), dw_want) <= fp32_tolerance);  // exact bf16 products, fp32 sums
    CHECK(relative_error(ddb.download(), db_want) <= fp32_tolerance);

    auto prod = host_gemm(Transpose::no, Transpose::no, 1.0, dyw, dys, widen(w16), ws, 0.0, std::vector<double>(std::size_t(rows * in)), xs);
    const auto prew = widen(pre16);
    std::vector<double> want(prod.size());
    ops::gelu_backward(ref, ConstView<double>{prew.data(), xs}, ConstView<double>{prod.data(), xs}, TensorView<double>{want.data(), xs});
    DeviceArray<cupipe::bfloat16, Bf16Gpu> d16(g16, rows * in);
    ops::gemm_dgelu(g16, Transpose::no, Transpose::no, 1.0f, ddy16.cview(dys), dw16.cview(ws), dpre16.cview(xs), d16.view(xs));
    CHECK(relative_error(widen(d16.download()), want) <= bf16_tolerance);
  }
}

TEST_CASE("a cuBLASLt plan with an epilogue and no algorithm is unavailable, not an error", "[gpu][cuda][ops][gemm]") {
  // BGRADB on double operands: an epilogue outside cuBLASLt's fp64 kernels on every architecture we
  // know. Before, GemmPlan threw when the heuristic offered nothing; now the op falls back. If this
  // device does have an algorithm, the plan is available and runs, which this case also accepts.
  Gpu gpu;
  auto a = gpu.allocate<double>(64, MemoryTag::activations), c = gpu.allocate<double>(64, MemoryTag::activations);
  backend::cuda::GemmKey key;
  key.m = key.n = key.k = 8;
  key.lda = key.ldb = key.ldc = 8;
  key.ta = Transpose::yes;
  key.ab_type = key.c_type = CUDA_R_64F;
  key.compute = CUBLAS_COMPUTE_64F;
  key.scale_type = CUDA_R_64F;
  key.epilogue = backend::cuda::GemmEpilogue::bgradb;
  const double one = 1.0;
  const backend::cuda::GemmArgs args{a.data(), a.data(), c.data(), c.data(), nullptr, &one, &one};
  backend::cuda::Context& ctx = gpu.context();
  std::optional<backend::cuda::GemmPlan> plan;
  REQUIRE_NOTHROW(plan.emplace(ctx.cublas_lt(), key, args, backend::cuda::Context::gemm_workspace_bytes));
  WARN("cuBLASLt BGRADB on fp64: " << (plan->available() ? "an algorithm" : "no algorithm (the fallback case)"));
  if (!plan->available())
    CHECK_THROWS_WITH(plan->run(ctx.cublas_lt(), key, args, ctx.gemm_workspace(), backend::cuda::Context::gemm_workspace_bytes, ctx.stream()),
                      Catch::Contains("the caller must fall back"));
}

TEST_CASE("CUDA ops validate shapes before launching, with the host's messages", "[gpu][cuda][ops][errors]") {
  Gpu gpu;
  auto buf = gpu.allocate<float>(64, MemoryTag::activations);
  CHECK_THROWS_WITH(ops::gemm(gpu, Transpose::no, Transpose::no, 1.0f, buf.view(Shape{2, 3}), buf.view(Shape{4, 5}), 0.0f,
                              buf.view(Shape{2, 5})),
                    Catch::Contains("gemm: op(a) is (2, 3) and op(b) is (4, 5)"));
  CHECK_THROWS_WITH(ops::bias_add(gpu, buf.view(Shape{4, 8}), buf.view(Shape{7})),
                    Catch::Contains("bias_add: bias expected shape (8,) but got (7,)"));
  CHECK_THROWS_WITH(ops::layernorm_forward(gpu, buf.view(Shape{2, 4}), buf.view(Shape{4}), buf.view(Shape{4}),
                                           buf.view(Shape{2, 4}), buf.view(Shape{3}), buf.view(Shape{2}), 1e-5),
                    Catch::Contains("layernorm_forward: mean expected shape (2,) but got (3,)"));
}
