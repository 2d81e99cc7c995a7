// SPDX-License-Identifier: Apache-2.0
// Kernel benchmarks of backend::Cuda, on bench/harness with its CUDA timer (events, L2 flushed before
// every timed run). First the device's own ceilings, measured in this run: a large device-to-device
// copy (GB/s, bytes read plus written) and the best large GEMM cuBLASLt offers in fp32, tf32 and bf16
// (TFLOP/s). Then each op at GPT-2-like shapes (B*T = 8192 rows), reported as a percentage of the
// ceiling that bounds it; GEMMs also against the fastest of cuBLASLt's heuristic candidates for the
// same problem, timed side by side, and on Hopper in FP8 (backend::CudaFp8, both recipes) against
// bf16. A percentage needs its ceiling in the same run: a --filter that leaves out `ceiling/...`
// leaves it "-".
//   bench_kernels [--json out.json] [--repeats N] [--warmup N] [--quick] [--filter REGEX] [--list]
// Targets (documented, not asserted): memory-bound kernels >= 85% of copy bandwidth; GEMM >= 0.95x the
// best heuristic candidate.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <map>
#include <string>
#include <unordered_set>
#include <vector>

#include "../harness/cuda_timer.cuh"
#include "../harness/harness.hpp"
#include "cupipe/cupipe.cuh"

using namespace cupipe;
using bench::CudaTimer;
using bench::State;
using ops::Transpose;
using Gpu = backend::Cuda<float>;
using Bf16Gpu = backend::Cuda<cupipe::bfloat16, float>;  // bf16 storage, fp32 compute

namespace {

std::string shape_text(std::initializer_list<index_t> extents) {
  std::string out = "(";
  for (index_t e : extents) {
    if (out.size() > 1) out.append(", ");
    out.append(std::to_string(e));
  }
  return out + ")";
}

/// Fills a device array with uniform values in [low, high), never zeros: GPUs run cooler and faster on zeros.
template <class B, class U>
void fill_random(B& be, U* device, index_t n, std::uint64_t seed, double low = -1, double high = 1) {
  Rng rng(seed);
  std::vector<U> host(static_cast<std::size_t>(n));
  for (U& v : host) v = U(float(rng.uniform(low, high)));
  be.upload(std::span<const U>(host), device);
}

/// The device's ceilings, measured by the `ceiling/...` benchmarks of this run (0: not measured).
struct Ceilings {
  double copy_gbps = 0;
  std::map<std::string, double> gemm_tflops;  // "gemm_fp32", "gemm_tf32", "gemm_bf16"
};

/// Reports the state's GB/s against the copy ceiling.
void against_copy(State& state, const Ceilings& ceilings) {
  state.summary("ceiling", "vs ceiling", std::string("copy"));
  if (ceilings.copy_gbps > 0) state.summary("percent_of_ceiling", "% of ceiling", 100 * state.gbps() / ceilings.copy_gbps, 1);
}

/// Everything a benchmark body needs: the backend, the timer and the ceilings measured so far.
struct Bench {
  Gpu& be;
  CudaTimer& timer;
  Ceilings& ceilings;
  Bf16Gpu& be16;       ///< a bf16-storage context on the same device, with its own stream
  CudaTimer& timer16;  ///< timing be16's stream
  std::size_t l2_bytes = 0;
};

/// Runs `body(be, timer)` on the float context or, for state.text("precision") == "bf16", on the
/// bf16-storage one.
template <class Body>
void on_precision(Bench& b, State& state, Body&& body) {
  const std::string precision = state.text("precision");
  CUPIPE_REQUIRE(precision == "fp32" || precision == "bf16", "bench_kernels: precision '", precision,
                 "' is not fp32 or bf16");
  if (precision == "bf16") body(b.be16, b.timer16);
  else body(b.be, b.timer);
}

// --- ceilings -----------------------------------------------------------------------------------

void copy_ceiling(Bench& b, State& state) {
  const std::size_t bytes = std::size_t(1) << 30;
  auto src = b.be.allocate<std::byte>(index_t(bytes), MemoryTag::workspace);
  auto dst = b.be.allocate<std::byte>(index_t(bytes), MemoryTag::workspace);
  CUPIPE_CHECK_CUDA(cudaMemsetAsync(src.data(), 1, bytes, b.be.stream()));
  state.add_reads(double(bytes));
  state.add_writes(double(bytes));
  state.exec(b.timer, [&] {
    CUPIPE_CHECK_CUDA(cudaMemcpyAsync(dst.data(), src.data(), bytes, cudaMemcpyDeviceToDevice, b.be.stream()));
  });
  b.ceilings.copy_gbps = state.gbps();
  state.summary("shape", "shape", std::string("1 GiB"));
  against_copy(state, b.ceilings);
  b.be.context().pool().trim();
}

enum class GemmKind { fp32, tf32, bf16 };

GemmKind parse_kind(const std::string& name) {
  if (name == "fp32") return GemmKind::fp32;
  if (name == "tf32") return GemmKind::tf32;
  CUPIPE_REQUIRE(name == "bf16", "bench_kernels: precision expected fp32, tf32 or bf16 but got '", name, "'");
  return GemmKind::bf16;
}

/// The fastest of every candidate cuBLASLt proposes for `key`, timed like the state (seconds).
double best_heuristic_seconds(Bench& b, const State& state, const backend::cuda::GemmKey& key, const backend::cuda::GemmArgs& args) {
  backend::cuda::Context& ctx = b.be.context();
  backend::cuda::GemmPlan plan(ctx.cublas_lt(), key, args, backend::cuda::Context::gemm_workspace_bytes);
  void* workspace = ctx.gemm_workspace();
  double best = 0;
  for (const backend::cuda::GemmCandidate& candidate :
       plan.heuristics(ctx.cublas_lt(), key, backend::cuda::Context::gemm_workspace_bytes, 16)) {
    if (candidate.workspace_bytes > backend::cuda::Context::gemm_workspace_bytes) continue;
    const double seconds = state.measure_other(b.timer, [&] {
      plan.run(ctx.cublas_lt(), key, args, workspace, backend::cuda::Context::gemm_workspace_bytes, ctx.stream(), &candidate.algo);
    }).median;
    if (best == 0 || seconds < best) best = seconds;
  }
  return best;
}

/// c (m, n) = op(a) op(b), timed through ops::gemm and, side by side, the best cuBLASLt candidate.
/// Returns the faster of the two (seconds).
double run_gemm(Bench& b, State& state, GemmKind kind, index_t m, index_t n, index_t k, Transpose ta, Transpose tb) {
  Gpu& be = b.be;
  const Shape as = ta == Transpose::yes ? Shape{k, m} : Shape{m, k};
  const Shape bs = tb == Transpose::yes ? Shape{n, k} : Shape{k, n};
  const Shape cs{m, n};
  be.math = kind == GemmKind::tf32 ? backend::cuda::MathMode::tf32 : backend::cuda::MathMode::fp32;
  backend::cuda::GemmKey key;
  key.m = m, key.n = n, key.k = k, key.lda = as.cols(), key.ldb = bs.cols(), key.ldc = n, key.ta = ta, key.tb = tb;
  const float alpha = 1, beta = 0;
  state.summary("shape", "shape",
                shape_text({m, n, k}) + (ta == Transpose::yes ? " T" : " N") + (tb == Transpose::yes ? "T" : "N"));
  state.add_flops(2.0 * double(m) * double(n) * double(k));
  double reference = 0;
  if (kind == GemmKind::bf16) {
    auto a = be.allocate<cupipe::bfloat16>(m * k, MemoryTag::activations);
    auto bm = be.allocate<cupipe::bfloat16>(k * n, MemoryTag::activations);
    auto c = be.allocate<cupipe::bfloat16>(m * n, MemoryTag::activations);
    fill_random(be, a.data(), m * k, 1);
    fill_random(be, bm.data(), k * n, 2);
    state.exec(b.timer, [&] {
      ops::gemm(be, ta, tb, 1.0f, DeviceConstView<cupipe::bfloat16>(a.view(as)), DeviceConstView<cupipe::bfloat16>(bm.view(bs)), 0.0f,
                c.view(cs));
    });
    key.ab_type = key.c_type = CUDA_R_16BF;
    key.compute = CUBLAS_COMPUTE_32F;
    reference = best_heuristic_seconds(b, state, key, {a.data(), bm.data(), c.data(), nullptr, nullptr, &alpha, &beta});
  } else {
    auto a = be.allocate<float>(m * k, MemoryTag::activations);
    auto bm = be.allocate<float>(k * n, MemoryTag::activations);
    auto c = be.allocate<float>(m * n, MemoryTag::activations);
    fill_random(be, a.data(), m * k, 1);
    fill_random(be, bm.data(), k * n, 2);
    state.exec(b.timer, [&] { ops::gemm(be, ta, tb, 1.0f, a.view(as), bm.view(bs), 0.0f, c.view(cs)); });
    key.compute = kind == GemmKind::tf32 ? CUBLAS_COMPUTE_32F_FAST_TF32 : CUBLAS_COMPUTE_32F;
    reference = best_heuristic_seconds(b, state, key, {a.data(), bm.data(), c.data(), nullptr, nullptr, &alpha, &beta});
  }
  be.math = backend::cuda::MathMode::fp32;
  const double ours = state.timing().median;
  if (reference > 0) {
    state.summary("best_heuristic_us", "best heuristic us", reference * 1e6, 1);
    state.summary("ratio_best_heuristic_over_ours", "best heuristic / ours", reference / ours, 3);
  }
  be.context().pool().trim();
  return reference > 0 ? std::min(reference, ours) : ours;
}

void gemm_ceiling(Bench& b, State& state, index_t size) {
  const std::string precision = state.text("precision");
  const double best = run_gemm(b, state, parse_kind(precision), size, size, size, Transpose::no, Transpose::no);
  // The ceiling is the faster of our op and the best candidate.
  const std::string name = "gemm_" + precision;
  b.ceilings.gemm_tflops[name] = state.flops() / best / 1e12;
  state.summary("ceiling", "vs ceiling", name);
  state.summary("ceiling_tflops", "ceiling TFLOP/s", b.ceilings.gemm_tflops[name], 2);
  state.summary("percent_of_ceiling", "% of ceiling", 100 * state.tflops() / b.ceilings.gemm_tflops[name], 1);
}

// --- ops ------------------------------------------------------------------------------------------

constexpr index_t rows = 8192;  // B * T

/// LayerNorm over (rows, width): activations in the storage type, statistics and weight gradients in
/// the compute type (as the layer keeps them).
void layernorm(Bench& b, State& state) {
  on_precision(b, state, [&]<class B>(B& be, CudaTimer& timer) {
    using T = typename B::value_type;
    using C = typename B::compute_type;
    const index_t cols = state.integer("width");
    const std::string pass = state.text("pass");
    const Shape s{rows, cols}, c{cols}, r{rows};
    auto x = be.template allocate<T>(rows * cols, MemoryTag::activations), y = be.template allocate<T>(rows * cols, MemoryTag::activations);
    auto dy = be.template allocate<T>(rows * cols, MemoryTag::activations), dx = be.template allocate<T>(rows * cols, MemoryTag::activations);
    auto gamma = be.template allocate<T>(cols, MemoryTag::weights), beta = be.template allocate<T>(cols, MemoryTag::weights);
    auto dgamma = be.template allocate<C>(cols, MemoryTag::gradients), dbeta = be.template allocate<C>(cols, MemoryTag::gradients);
    auto mean = be.template allocate<C>(rows, MemoryTag::activations), rstd = be.template allocate<C>(rows, MemoryTag::activations);
    fill_random(be, x.data(), rows * cols, 3);
    fill_random(be, dy.data(), rows * cols, 4);
    fill_random(be, gamma.data(), cols, 5, 0.5, 1.5);
    fill_random(be, beta.data(), cols, 6);
    fill_random(be, dgamma.data(), cols, 7);
    fill_random(be, dbeta.data(), cols, 8);
    const auto cv = [](auto& buffer, Shape shape) {
      return DeviceConstView<typename std::remove_reference_t<decltype(buffer)>::value_type>(buffer.view(shape));
    };
    // The statistics the backward passes read.
    ops::layernorm_forward(be, cv(x, s), cv(gamma, c), cv(beta, c), y.view(s), mean.view(r), rstd.view(r), 1e-5);
    const double t = sizeof(T), f = sizeof(C), rc = double(rows * cols);
    state.summary("shape", "shape", shape_text({rows, cols}));
    if (pass == "forward") {
      state.add_reads(t * (rc + 2.0 * cols));          // x, gamma, beta
      state.add_writes(t * rc + f * 2.0 * rows);       // y, mean, rstd
      state.exec(timer, [&] {
        ops::layernorm_forward(be, cv(x, s), cv(gamma, c), cv(beta, c), y.view(s), mean.view(r), rstd.view(r), 1e-5);
      });
    } else if (pass == "backward input") {
      state.add_reads(t * (2 * rc + double(cols)) + f * 2.0 * rows);  // x, dy, gamma, mean, rstd
      state.add_writes(t * rc);                                       // dx
      state.exec(timer, [&] {
        ops::layernorm_backward_input(be, cv(x, s), cv(gamma, c), cv(mean, r), cv(rstd, r), cv(dy, s), dx.view(s));
      });
    } else {
      CUPIPE_REQUIRE(pass == "backward weight", "bench_kernels: layernorm pass '", pass, "' is not one of forward, "
                     "backward input, backward weight");
      state.add_reads(t * 2 * rc + f * (2.0 * rows + 2.0 * cols));  // x, dy, mean, rstd, dgamma, dbeta
      state.add_writes(f * 2.0 * cols);                             // dgamma, dbeta
      state.exec(timer, [&] {
        ops::layernorm_backward_weight(be, cv(x, s), cv(mean, r), cv(rstd, r), cv(dy, s), dgamma.view(c), dbeta.view(c));
      });
    }
    against_copy(state, b.ceilings);
    be.context().pool().trim();
  });
}

void gelu(Bench& b, State& state) {
  on_precision(b, state, [&]<class B>(B& be, CudaTimer& timer) {
    using T = typename B::value_type;
    // The MLP's hidden activation: (B*T, 4C).
    const index_t cols = 4 * state.integer("width"), n = rows * cols;
    const Shape s{rows, cols};
    auto x = be.template allocate<T>(n, MemoryTag::activations), y = be.template allocate<T>(n, MemoryTag::activations);
    auto dy = be.template allocate<T>(n, MemoryTag::activations);
    fill_random(be, x.data(), n, 9, -3, 3);
    fill_random(be, dy.data(), n, 10);
    const DeviceConstView<T> xs = x.view(s), dys = dy.view(s);
    const double t = sizeof(T);
    state.summary("shape", "shape", shape_text({rows, cols}));
    if (state.text("pass") == "forward") {
      state.add_reads(t * double(n));
      state.add_writes(t * double(n));
      state.exec(timer, [&] { ops::gelu_forward(be, xs, y.view(s)); });
    } else {
      state.add_reads(2 * t * double(n));
      state.add_writes(t * double(n));
      state.exec(timer, [&] { ops::gelu_backward(be, xs, dys, y.view(s)); });
    }
    against_copy(state, b.ceilings);
    be.context().pool().trim();
  });
}

void softmax_xent(Bench& b, State& state) {
  Gpu& be = b.be;
  const index_t vocab = state.integer("vocab");
  const Shape s{rows, vocab}, r{rows};
  auto z = be.allocate(rows * vocab, MemoryTag::activations), dz = be.allocate(rows * vocab, MemoryTag::activations);
  auto loss = be.allocate(1, MemoryTag::activations);
  auto labels = be.allocate<std::int32_t>(rows, MemoryTag::activations);
  fill_random(be, z.data(), rows * vocab, 11, -4, 4);
  Rng rng(12);
  std::vector<std::int32_t> host_labels(static_cast<std::size_t>(rows));
  for (auto& l : host_labels) l = std::int32_t(rng.below(std::uint64_t(vocab)));
  be.upload(std::span<const std::int32_t>(host_labels), labels.data());
  // Device-side label checks would add a host wait to every timed run; bad labels are not the point here.
  be.check_inputs = false;
  const double f = sizeof(float), rv = double(rows * vocab);
  state.summary("shape", "shape", shape_text({rows, vocab}));
  if (state.text("pass") == "forward") {
    state.add_reads(f * rv + 4.0 * double(rows));  // logits, labels
    state.exec(b.timer, [&] { ops::softmax_cross_entropy_forward(be, z.view(s), labels.view(r), loss.view(Shape{1}), rows); });
  } else {
    state.add_reads(f * rv + 4.0 * double(rows));
    state.add_writes(f * rv);  // dlogits
    state.exec(b.timer, [&] { ops::softmax_cross_entropy_backward(be, z.view(s), labels.view(r), dz.view(s), rows); });
  }
  be.check_inputs = true;
  be.synchronize();
  against_copy(state, b.ceilings);
  be.context().pool().trim();
}

/// Causal attention at GPT-2 small's shape: 8 sequences of T tokens, 12 heads of 64 columns. FLOPs
/// counted as the algorithm's: forward 2 products (QK^T, PV), backward 5 (S again, dP, dV, dQ, dK), each
/// 2 * T (T + 1) / 2 * D per sequence and head (FlashAttention's count, halved for the causal mask).
/// Paths (backend/cuda/attention_path.cuh): simple and tiled in fp32 and bf16, ours on tensor cores
/// (mma) and cuDNN's fused SDPA in bf16 only; a path that cannot run here is a skipped row, with why.
void attention(Bench& b, State& state) {
  on_precision(b, state, [&]<class B>(B& be, CudaTimer& timer) {
    using T = typename B::value_type;
    using C = typename B::compute_type;
    const index_t T_ = state.integer("context"), heads = 12, width = 768, n = 8 * T_;
    const std::string pass = state.text("pass");
    const backend::cuda::AttentionKernel asked = backend::cuda::parse_attention(state.text("kernel"), "bench_kernels: kernel");
    const backend::cuda::AttentionKernel before = be.attention;
    struct Restore {  // the other benches' context runs as it did, also after a throw
      B& be;
      backend::cuda::AttentionKernel kernel;
      ~Restore() { be.attention = kernel; }
    } restore{be, before};
    be.attention = asked;
    backend::cuda::AttentionChoice choice;
    try {
      choice = ops::attention_choice(be, n, width, heads, T_);
    } catch (const std::exception& e) {
      state.skip(e.what());
      return;
    }
    if (choice.kernel != asked) {
      state.skip("runs " + std::string(backend::cuda::to_string(choice.kernel)) + ": " + choice.reason);
      return;
    }
    const Shape sq{n, 3 * width}, so{n, width}, sl{n, heads};
    auto qkv = be.template allocate<T>(n * 3 * width, MemoryTag::activations);
    auto out = be.template allocate<T>(n * width, MemoryTag::activations);
    auto lse = be.template allocate<C>(n * heads, MemoryTag::activations);
    auto dout = be.template allocate<T>(n * width, MemoryTag::activations);
    auto dqkv = be.template allocate<T>(n * 3 * width, MemoryTag::activations);
    fill_random(be, qkv.data(), n * 3 * width, 21);
    fill_random(be, dout.data(), n * width, 22);
    ops::causal_attention_forward(be, DeviceConstView<T>(qkv.view(sq)), out.view(so), lse.view(sl), heads, T_);
    const double pairs = 8.0 * double(heads) * double(T_) * double(T_ + 1) / 2.0, D = double(width / heads);
    state.summary("shape", "shape", "8 x " + std::to_string(T_) + " tokens, 12 heads x 64");
    if (pass == "forward") {
      state.add_flops(2 * 2 * pairs * D);
      state.exec(timer, [&] { ops::causal_attention_forward(be, DeviceConstView<T>(qkv.view(sq)), out.view(so), lse.view(sl), heads, T_); });
    } else {
      state.add_flops(5 * 2 * pairs * D);
      state.exec(timer, [&] {
        ops::causal_attention_backward(be, DeviceConstView<T>(qkv.view(sq)), DeviceConstView<T>(out.view(so)),
                                       DeviceConstView<C>(lse.view(sl)), DeviceConstView<T>(dout.view(so)), dqkv.view(sq), heads, T_);
      });
    }
    be.context().pool().trim();
  });
}

/// One step of context parallelism's ring attention (backend/cuda/kernels/ring_attention.cuh), rank
/// 0 of a ring of 2 at GPT-2 small's shape (8 sequences of T tokens, 12 heads of 64, fp32): step 0
/// against its own chunks (0 and 3), step 1 against the other rank's (1 and 2). The pass between
/// them is NCCL's and needs two GPUs (nccl:np2_context_stages1); this times the kernels it overlaps.
/// FLOPs as attention's (forward 2 products, backward 5) over the pairs the step's causal mask keeps;
/// reads, the forward's: each visible key's and value's row once per query (the simple form reads
/// them from L2/HBM). Prediction (ring_attention.cuh's roofline): a forward step at T 1024 reads
/// about 6.4 GB, at most 1.3 ms on an H200 at 4.8 TB/s, less where L2 holds the rows.
void ring_attention(Bench& b, State& state) {
  Gpu& be = b.be;
  namespace k = backend::cuda::kernels::ring_attention;
  constexpr int ring = 2;
  const index_t T_ = state.integer("context"), heads = 12, width = 768, D = width / heads, rows = 8 * T_ / ring;
  const int step = int(state.integer("step"));
  const index_t c = cp::chunk_rows(T_, ring);
  const auto mine = cp::chunks_of(0, ring), theirs = cp::chunks_of(cp::ring_source(0, step, ring), ring);
  const k::Step st{c, mine[0], mine[1], theirs[0], theirs[1]};
  double pairs = 0;  // (query, key) pairs of one sequence and head that this step's mask keeps
  for (const int q : mine)
    for (index_t t = 0; t < c; ++t)
      for (const int key : theirs) pairs += double(std::clamp<index_t>(q * c + t - key * c + 1, 0, c));
  pairs *= 8.0 * double(heads);
  auto qkv = be.allocate(rows * 3 * width, MemoryTag::activations), kv = be.allocate(rows * 2 * width, MemoryTag::activations);
  auto out = be.allocate(rows * width, MemoryTag::activations), lse = be.allocate(rows * heads, MemoryTag::activations);
  auto dout = be.allocate(rows * width, MemoryTag::activations), dqkv = be.allocate(rows * 3 * width, MemoryTag::activations);
  auto dkv = be.allocate(rows * 2 * width, MemoryTag::activations), delta = be.allocate(rows * heads, MemoryTag::activations);
  fill_random(be, qkv.data(), rows * 3 * width, 31);
  fill_random(be, dout.data(), rows * width, 32);
  fill_random(be, dkv.data(), rows * 2 * width, 33);
  k::pack(be.context(), qkv.data(), kv.data(), rows, width);
  // A whole forward (both steps, the second merged into the first), so that lse and delta are a step's.
  for (int s = 0; s < ring; ++s) {
    const auto other = cp::chunks_of(cp::ring_source(0, s, ring), ring);
    k::forward_step(be.context(), qkv.data(), kv.data(), out.data(), lse.data(), rows, width, int(heads),
                    k::Step{c, mine[0], mine[1], other[0], other[1]}, s == 0);
  }
  k::delta(be.context(), out.data(), dout.data(), delta.data(), rows, width, int(heads));
  state.summary("shape", "shape", "rank 0 of 2: 8 x " + std::to_string(T_ / ring) + " of " + std::to_string(T_) +
                                      " tokens, 12 heads x 64, step " + std::to_string(step));
  if (state.text("pass") == "forward") {
    state.add_flops(2 * 2 * pairs * double(D));
    state.add_reads(pairs * 2 * double(D) * sizeof(float));
    state.exec(b.timer, [&] {
      k::forward_step(be.context(), qkv.data(), kv.data(), out.data(), lse.data(), rows, width, int(heads), st, step == 0);
    });
  } else {
    state.add_flops(5 * 2 * pairs * double(D));
    state.exec(b.timer, [&] {
      k::backward_step(be.context(), qkv.data(), kv.data(), lse.data(), dout.data(), delta.data(), dqkv.data(), dkv.data(),
                       rows, width, int(heads), st, step == 0);
    });
  }
  be.context().pool().trim();
}

void adamw(Bench& b, State& state) {
  Gpu& be = b.be;
  const index_t n = state.integer("parameters");
  const Shape s{n};
  auto p = be.allocate(n, MemoryTag::weights), g = be.allocate(n, MemoryTag::gradients);
  auto m = be.allocate(n, MemoryTag::optimizer), v = be.allocate(n, MemoryTag::optimizer);
  fill_random(be, p.data(), n, 13);
  fill_random(be, g.data(), n, 14);
  fill_random(be, m.data(), n, 15, -0.01, 0.01);
  fill_random(be, v.data(), n, 16, 0, 1e-4);
  const ops::AdamWHyper hyper{.lr = 1e-4};
  state.summary("shape", "shape", shape_text({n}) + " fp32");
  state.add_reads(4.0 * sizeof(float) * double(n));   // p, g, m, v
  state.add_writes(3.0 * sizeof(float) * double(n));  // p, m, v
  std::int64_t step = 1;
  state.exec(b.timer, [&] { ops::adamw_update(be, p.view(s), g.view(s), m.view(s), v.view(s), hyper, step++, 1.0f); });
  against_copy(state, b.ceilings);
  be.context().pool().trim();
}

void embedding_backward(Bench& b, State& state) {
  Gpu& be = b.be;
  const index_t cols = state.integer("width"), vocab = 50257;
  const Shape t{vocab, cols}, s{rows, cols}, r{rows};
  auto dtable = be.allocate(vocab * cols, MemoryTag::gradients), dy = be.allocate(rows * cols, MemoryTag::activations);
  auto ids = be.allocate<std::int32_t>(rows, MemoryTag::activations);
  fill_random(be, dtable.data(), vocab * cols, 17);
  fill_random(be, dy.data(), rows * cols, 18);
  Rng rng(19);
  std::vector<std::int32_t> host_ids(static_cast<std::size_t>(rows));
  for (auto& id : host_ids) id = std::int32_t(rng.below(std::uint64_t(vocab)));
  be.upload(std::span<const std::int32_t>(host_ids), ids.data());
  const double unique = double(std::unordered_set<std::int32_t>(host_ids.begin(), host_ids.end()).size());
  // dy once, each touched table row read and written once, the ids.
  state.add_reads(sizeof(float) * (double(rows * cols) + unique * double(cols)) + 4.0 * double(rows));
  state.add_writes(sizeof(float) * unique * double(cols));
  state.summary("shape", "shape", shape_text({rows, cols}) + " vocab " + std::to_string(vocab));
  be.check_inputs = false;
  state.exec(b.timer, [&] { ops::embedding_backward(be, ids.view(r), dy.view(s), dtable.view(t)); });
  be.check_inputs = true;
  be.synchronize();
  against_copy(state, b.ceilings);
  be.context().pool().trim();
}

/// A mixture of experts' token movement (backend/cuda/kernels/moe.cuh), top-2 and dropless: each of
/// the B*T tokens' two choices a row of the expert-sorted (2 B*T, C), in a shuffled order, as a
/// router's choices scatter them. Bytes as the kernels' roofline counts them.
void moe(Bench& b, State& state) {
  on_precision(b, state, [&]<class B>(B& be, CudaTimer& timer) {
    using T = typename B::value_type;
    constexpr index_t k = 2;
    const index_t cols = state.integer("width"), slots_n = rows * k;
    const Shape tokens{rows, cols}, sorted{slots_n, cols}, choices{rows, k};
    auto x = be.template allocate<T>(rows * cols, MemoryTag::activations), y = be.template allocate<T>(rows * cols, MemoryTag::activations);
    auto xs = be.template allocate<T>(slots_n * cols, MemoryTag::activations), d_o = be.template allocate<T>(slots_n * cols, MemoryTag::activations);
    auto gates = be.template allocate<T>(slots_n, MemoryTag::activations), dgates = be.template allocate<T>(slots_n, MemoryTag::activations);
    auto slots = be.template allocate<std::int32_t>(slots_n, MemoryTag::activations);
    fill_random(be, x.data(), rows * cols, 31);
    fill_random(be, xs.data(), slots_n * cols, 32);
    fill_random(be, gates.data(), slots_n, 33, 0, 1);
    Rng rng(34);
    std::vector<std::int32_t> order(static_cast<std::size_t>(slots_n));
    for (std::size_t i = 0; i < order.size(); ++i) order[i] = std::int32_t(i);
    for (std::size_t i = order.size(); i > 1; --i) std::swap(order[i - 1], order[std::size_t(rng.below(i))]);
    be.upload(std::span<const std::int32_t>(order), slots.data());
    const DeviceConstView<std::int32_t> sv = slots.view(choices);
    const double t = sizeof(T), row = t * double(cols), n = double(rows), kn = double(slots_n);
    const std::string pass = state.text("pass");
    state.summary("shape", "shape", shape_text({rows, cols}) + " top-2");
    be.check_inputs = false;
    if (pass == "permute") {
      state.add_reads(kn * row + 4 * kn);
      state.add_writes(kn * row);
      state.exec(timer, [&] { ops::moe_permute(be, x.view(tokens), sv, xs.view(sorted)); });
    } else if (pass == "unpermute") {
      state.add_reads(kn * row + (4 + t) * kn);
      state.add_writes(n * row);
      state.exec(timer, [&] { ops::moe_unpermute(be, xs.view(sorted), sv, gates.view(choices), y.view(tokens)); });
    } else if (pass == "unpermute backward") {
      state.add_reads(2 * kn * row + (4 + t) * kn);  // dy once per choice, o once
      state.add_writes(kn * row + t * kn);
      state.exec(timer, [&] {
        ops::moe_unpermute_backward(be, x.view(tokens), xs.view(sorted), sv, gates.view(choices), d_o.view(sorted),
                                    dgates.view(choices));
      });
    } else {
      state.add_reads(kn * row + n * row + 4 * kn);
      state.add_writes(n * row);
      state.exec(timer, [&] { ops::moe_permute_backward(be, xs.view(sorted), sv, y.view(tokens)); });
    }
    be.check_inputs = true;
    be.synchronize();
    against_copy(state, b.ceilings);
    be.context().pool().trim();
  });
}

/// GPT-2 small block (C = 768), forward and the two backward products of each Linear.
struct Problem {
  const char* name;
  index_t m, n, k;
  Transpose ta, tb;
};
constexpr index_t C = 768;
const std::vector<Problem> gpt2_problems{
    {"qkv forward", rows, 3 * C, C, Transpose::no, Transpose::yes},
    {"attn proj forward", rows, C, C, Transpose::no, Transpose::yes},
    {"fc forward", rows, 4 * C, C, Transpose::no, Transpose::yes},
    {"fc proj forward", rows, C, 4 * C, Transpose::no, Transpose::yes},
    {"fc backward dx", rows, C, 4 * C, Transpose::no, Transpose::no},
    {"fc backward dW", 4 * C, C, rows, Transpose::yes, Transpose::no},
};

void gemm(Bench& b, State& state) {
  const std::string precision = state.text("precision"), problem = state.text("problem");
  const auto p = std::find_if(gpt2_problems.begin(), gpt2_problems.end(), [&](const Problem& q) { return q.name == problem; });
  CUPIPE_REQUIRE(p != gpt2_problems.end(), "bench_kernels: no GEMM problem named '", problem, "'");
  run_gemm(b, state, parse_kind(precision), p->m, p->n, p->k, p->ta, p->tb);
  const std::string ceiling = "gemm_" + precision;
  state.summary("ceiling", "vs ceiling", ceiling);
  if (b.ceilings.gemm_tflops.contains(ceiling))
    state.summary("percent_of_ceiling", "% of ceiling", 100 * state.tflops() / b.ceilings.gemm_tflops[ceiling], 1);
}

/// One of the problems above in FP8 on backend::CudaFp8<R> (each operand quantised, then cuBLASLt's
/// FP8 GEMM: what a layer pays), against the same GEMM in bf16 on Cuda<bfloat16, float>, timed side by
/// side in this run. The weight gradient accumulates into fp32 (beta 1) on both, as training does;
/// delayed scaling is timed after one closed step, so its scales come from the history (one pass per
/// operand) as in every step after the first.
template <class R>
void fp8_gemm_on(Bench& b, State& state, const Problem& p) {
  backend::CudaFp8<R> fp8(0);
  CudaTimer timer(fp8.stream(), b.l2_bytes);
  const Shape as = p.ta == Transpose::yes ? Shape{p.k, p.m} : Shape{p.m, p.k};
  const Shape bs = p.tb == Transpose::yes ? Shape{p.n, p.k} : Shape{p.k, p.n};
  const Shape cs{p.m, p.n};
  const bool weight_grad = p.ta == Transpose::yes;
  state.summary("shape", "shape",
                shape_text({p.m, p.n, p.k}) + (p.ta == Transpose::yes ? " T" : " N") + (p.tb == Transpose::yes ? "T" : "N"));
  state.add_flops(2.0 * double(p.m) * double(p.n) * double(p.k));
  const auto time_on = [&](auto& be, CudaTimer& t, bool main) {
    auto a = be.template allocate<cupipe::bfloat16>(as.numel(), MemoryTag::activations);
    auto bm = be.template allocate<cupipe::bfloat16>(bs.numel(), MemoryTag::activations);
    fill_random(be, a.data(), as.numel(), 1);
    fill_random(be, bm.data(), bs.numel(), 2, -0.05, 0.05);
    const DeviceConstView<cupipe::bfloat16> av(a.view(as)), bv(bm.view(bs));
    double seconds = 0;
    if (weight_grad) {
      auto c = be.template allocate<float>(cs.numel(), MemoryTag::gradients);
      fill_random(be, c.data(), cs.numel(), 3);
      const auto run = [&] { ops::gemm(be, p.ta, p.tb, 1.0f, av, bv, 1.0f, c.view(cs)); };
      run();
      backend::end_step(be);
      if (main) state.exec(t, run);
      else seconds = state.measure_other(t, run).median;
    } else {
      auto c = be.template allocate<cupipe::bfloat16>(cs.numel(), MemoryTag::activations);
      const auto run = [&] { ops::gemm(be, p.ta, p.tb, 1.0f, av, bv, 0.0f, c.view(cs)); };
      run();
      backend::end_step(be);
      if (main) state.exec(t, run);
      else seconds = state.measure_other(t, run).median;
    }
    be.context().pool().trim();
    return seconds;
  };
  time_on(fp8, timer, true);
  const double bf16 = time_on(b.be16, b.timer16, false);
  const double ours = state.timing().median;
  state.summary("bf16_us", "bf16 us", bf16 * 1e6, 1);
  state.summary("speedup_over_bf16", "bf16 / fp8", bf16 / ours, 3);
  if (b.ceilings.gemm_tflops.contains("gemm_bf16"))
    state.summary("bf16_ceiling_multiple", "x bf16 ceiling", state.tflops() / b.ceilings.gemm_tflops["gemm_bf16"], 2);
}

void fp8_gemm(Bench& b, State& state) {
  const std::string recipe = state.text("recipe"), problem = state.text("problem");
  const auto p = std::find_if(gpt2_problems.begin(), gpt2_problems.end(), [&](const Problem& q) { return q.name == problem; });
  CUPIPE_REQUIRE(p != gpt2_problems.end(), "bench_kernels: no GEMM problem named '", problem, "'");
  CUPIPE_REQUIRE(recipe == "block" || recipe == "delayed", "bench_kernels: FP8 recipe expected block or delayed, got '",
                 recipe, "'");
  if (recipe == "block") fp8_gemm_on<fp8::Blockwise>(b, state, *p);
  else fp8_gemm_on<fp8::PerTensorDelayed>(b, state, *p);
}

int run(int argc, char** argv) {
  bench::Harness harness("cupipe kernel benchmarks");
  bool quick = false;
  for (const std::string& arg : harness.parse(argc, argv)) {
    CUPIPE_REQUIRE(arg == "--quick", "bench_kernels: unknown argument '", arg, "'; use --quick and ", bench::harness_usage);
    quick = true;
  }
  int count = 0;
  const cudaError_t status = cudaGetDeviceCount(&count);
  if (status != cudaSuccess || count == 0) {
    std::fprintf(stderr, "bench_kernels: no CUDA device (%s); nothing measured\n",
                 status != cudaSuccess ? cudaGetErrorString(status) : "0 devices");
    return 2;
  }
  Gpu be(0);
  cudaDeviceProp prop{};
  CUPIPE_CHECK_CUDA(cudaGetDeviceProperties(&prop, 0));
  harness.context() = {{"device",
                        {{"name", prop.name},
                         {"compute_capability", std::to_string(prop.major) + "." + std::to_string(prop.minor)},
                         {"sm_count", prop.multiProcessorCount},
                         {"l2_bytes", prop.l2CacheSize},
                         {"global_memory_bytes", prop.totalGlobalMem}}},
                       {"rows", rows},
                       {"targets", "memory-bound ops >= 85% of the copy ceiling; GEMM >= 0.95x the best heuristic"}};
  std::printf("Device: %s (sm_%d%d, %d SMs, %d MiB L2)\n\n", prop.name, prop.major, prop.minor, prop.multiProcessorCount,
              prop.l2CacheSize >> 20);
  CudaTimer timer(be.stream(), std::size_t(prop.l2CacheSize));
  Bf16Gpu be16(0);
  CudaTimer timer16(be16.stream(), std::size_t(prop.l2CacheSize));
  Ceilings ceilings;
  Bench b{be, timer, ceilings, be16, timer16, std::size_t(prop.l2CacheSize)};
  // Every kernel benchmark: 3 warm-up runs, median of 20 (--warmup, --repeats override).
  auto add = [&](std::string name, void (*body)(Bench&, State&)) -> bench::Benchmark& {
    return harness.add(std::move(name), [&b, body](State& state) { body(b, state); }).runs(3, 20);
  };
  const std::vector<std::int64_t> widths = quick ? std::vector<std::int64_t>{768} : std::vector<std::int64_t>{768, 1024, 4096};
  const index_t gemm_ceiling_size = quick ? 4096 : 8192;

  add("ceiling/copy", copy_ceiling).note("Device-to-device copy of 1 GiB; GB/s counts bytes read plus written.");
  harness.add("ceiling/gemm", [&](State& state) { gemm_ceiling(b, state, gemm_ceiling_size); })
      .runs(3, 20)
      .axis("precision", std::vector<std::string>{"fp32", "tf32", "bf16"})
      .note("Large square GEMM; the ceiling is the faster of ops::gemm and the best cuBLASLt heuristic candidate.");
  add("layernorm", layernorm)
      .axis("precision", {"fp32", "bf16"})
      .int_axis("width", widths)
      .axis("pass", {"forward", "backward input", "backward weight"})
      .note("bf16: activations in bf16, mean, rstd and the weight gradients in fp32 (Cuda<bfloat16, float>).");
  add("gelu", gelu)
      .axis("precision", {"fp32", "bf16"})
      .int_axis("width", widths)
      .axis("pass", {"forward", "backward"})
      .note("The MLP's hidden activation, (B*T, 4C).");
  add("embedding_backward", embedding_backward).int_axis("width", widths);
  add("moe", moe)
      .axis("precision", {"fp32", "bf16"})
      .int_axis("width", widths)
      .axis("pass", {"permute", "unpermute", "unpermute backward", "permute backward"})
      .note("A mixture of experts' token movement, top-2, dropless, in a router's shuffled order (kernels/moe.cuh's roofline).");
  add("softmax_xent", softmax_xent).int_axis("vocab", {quick ? 8192 : 50257}).axis("pass", {"forward", "backward"});
  add("adamw", adamw).int_axis("parameters", {124'000'000});
  add("attention", attention)
      .axis("precision", {"fp32", "bf16"})
      .int_axis("context", {quick ? 256 : 1024})
      .axis("kernel", {"simple", "tiled", "mma", "cudnn"})
      .axis("pass", {"forward", "backward"})
      .note("Causal attention: simple (a warp per query), tiled (64-row tiles in shared memory), mma (ours on tensor "
            "cores, bf16 only), cudnn (cuDNN's fused SDPA, bf16 only). PyTorch's flash SDPA at the same shape: bench/gpt_step/sdpa_pytorch.py, same lease.");
  add("ring_attention", ring_attention)
      .int_axis("context", {quick ? 256 : 1024})
      .int_axis("step", {0, 1})
      .axis("pass", {"forward", "backward"})
      .note("Context parallelism's ring attention, one step's kernels (a warp per query or key, fp32), rank 0 of a ring "
            "of 2; the pass beside them is NCCL's (two GPUs). Predicted: forward step 1 at T 1024 at most 1.3 ms.");
  std::vector<std::string> problems;
  for (const Problem& p : gpt2_problems) problems.emplace_back(p.name);
  add("gemm", gemm)
      .axis("precision", std::vector<std::string>{"tf32", "bf16"})
      .axis("problem", problems)
      .note("GPT-2 small (C = 768) Linear products; best heuristic: the fastest cuBLASLt candidate, timed in this run.");
  if (prop.major == 9)  // cuBLASLt's block-scaled FP8 GEMM is Hopper's
    add("fp8_gemm", fp8_gemm)
        .axis("recipe", {"block", "delayed"})
        .axis("problem", problems)
        .note("The same products in FP8 (backend::CudaFp8: quantising the operands, then cuBLASLt's FP8 GEMM) against "
              "bf16's, timed side by side; block: DeepSeek-V3's 1 x 128 / 128 x 128 scales, delayed: one scale per "
              "tensor, E5M2 gradients. Predicted: fc forward 1.5x bf16's speed (fp8.cuh's roofline).");

  harness.run();
  std::printf("Targets (not asserted): memory-bound ops >= 85%% of the copy ceiling; GEMM >= 0.95x the best heuristic.\n");
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return run(argc, argv);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_kernels: %s\n", e.what());
    return 1;
  }
}
