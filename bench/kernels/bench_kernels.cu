// SPDX-License-Identifier: Apache-2.0
// Kernel benchmarks of backend::Cuda. First the device's own ceilings, measured in this run: a large
// device-to-device copy (GB/s, bytes read plus written) and the best large GEMM cuBLASLt offers in
// fp32, tf32 and bf16 (TFLOP/s). Then each op at GPT-2-like shapes (B*T = 8192 rows), reported as a
// percentage of the ceiling that bounds it; GEMMs also against the fastest of cuBLASLt's heuristic
// candidates for the same problem.
//   bench_kernels [--json out.json] [--repeats N] [--warmup N] [--quick]
// Targets (documented, not asserted): memory-bound kernels >= 85% of copy bandwidth; GEMM >= 0.95x the
// best heuristic candidate.
#include <cuda_runtime_api.h>

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>
#include <unordered_set>
#include <vector>

#include "cupipe/cupipe.cuh"
#include "harness.cuh"

using namespace cupipe;
using bench::Harness;
using bench::Result;
using ops::Transpose;
using Gpu = backend::Cuda<float>;

namespace {

struct Options {
  std::string json;
  int repeats = 20;
  int warmup = 3;
  bool quick = false;
};

std::string shape_text(std::initializer_list<index_t> extents) {
  std::string out = "(";
  for (index_t e : extents) out += (out.size() > 1 ? ", " : "") + std::to_string(e);
  return out + ")";
}

/// Fills a device array with uniform values in [low, high), never zeros: GPUs run cooler and faster on zeros.
template <class U>
void fill_random(Gpu& be, U* device, index_t n, std::uint64_t seed, double low = -1, double high = 1) {
  Rng rng(seed);
  std::vector<U> host(static_cast<std::size_t>(n));
  for (U& v : host) v = U(float(rng.uniform(low, high)));
  be.upload(std::span<const U>(host), device);
}

Result make_result(std::string group, std::string name, std::string shape) {
  Result r;
  r.group = std::move(group);
  r.name = std::move(name);
  r.shape = std::move(shape);
  return r;
}

// --- ceilings -----------------------------------------------------------------------------------

void measure_copy_ceiling(Gpu& be, Harness& h) {
  const std::size_t bytes = std::size_t(1) << 30;
  auto src = be.allocate<std::byte>(index_t(bytes), MemoryTag::workspace);
  auto dst = be.allocate<std::byte>(index_t(bytes), MemoryTag::workspace);
  CUPIPE_CHECK_CUDA(cudaMemsetAsync(src.data(), 1, bytes, be.stream()));
  Result r = make_result("ceiling", "device-to-device copy", "1 GiB");
  r.bytes = 2.0 * double(bytes);
  r.timing = h.time([&] {
    CUPIPE_CHECK_CUDA(cudaMemcpyAsync(dst.data(), src.data(), bytes, cudaMemcpyDeviceToDevice, be.stream()));
  });
  h.set_ceiling("copy", r.gbps(), "GB/s");
  r.ceiling = "copy";
  r.ceiling_value = r.gbps();
  h.add(r);
}

/// Times every candidate cuBLASLt proposes for `key` and returns the fastest time (ms).
double best_heuristic_ms(Gpu& be, Harness& h, const gpu::GemmKey& key, const gpu::GemmArgs& args) {
  gpu::Context& ctx = be.context();
  gpu::GemmPlan plan(ctx.cublas_lt(), key, args, gpu::Context::gemm_workspace_bytes);
  void* workspace = ctx.gemm_workspace();
  double best = 0;
  for (const gpu::GemmCandidate& candidate :
       plan.heuristics(ctx.cublas_lt(), key, gpu::Context::gemm_workspace_bytes, 16)) {
    if (candidate.workspace_bytes > gpu::Context::gemm_workspace_bytes) continue;
    const double ms = h.time([&] {
      plan.run(ctx.cublas_lt(), key, args, workspace, gpu::Context::gemm_workspace_bytes, ctx.stream(), &candidate.algo);
    }).median_ms;
    if (best == 0 || ms < best) best = ms;
  }
  return best;
}

enum class GemmKind { fp32, tf32, bf16 };

const char* kind_name(GemmKind kind) {
  return kind == GemmKind::fp32 ? "fp32" : kind == GemmKind::tf32 ? "tf32" : "bf16";
}

/// One GEMM problem: c (m, n) = op(a) op(b), timed through ops::gemm and against the best candidate.
Result run_gemm(Gpu& be, Harness& h, GemmKind kind, const std::string& name, index_t m, index_t n, index_t k,
                Transpose ta, Transpose tb) {
  const Shape as = ta == Transpose::yes ? Shape{k, m} : Shape{m, k};
  const Shape bs = tb == Transpose::yes ? Shape{n, k} : Shape{k, n};
  const Shape cs{m, n};
  be.math = kind == GemmKind::tf32 ? gpu::MathMode::tf32 : gpu::MathMode::fp32;
  gpu::GemmKey key;
  key.m = m, key.n = n, key.k = k, key.lda = as.cols(), key.ldb = bs.cols(), key.ldc = n, key.ta = ta, key.tb = tb;
  const float alpha = 1, beta = 0;
  Result r = make_result("gemm", name + " (" + kind_name(kind) + ")",
                         shape_text({m, n, k}) + (ta == Transpose::yes ? " T" : " N") + (tb == Transpose::yes ? "T" : "N"));
  r.flops = 2.0 * double(m) * double(n) * double(k);
  if (kind == GemmKind::bf16) {
    auto a = be.allocate<cupipe::bfloat16>(m * k, MemoryTag::activations);
    auto b = be.allocate<cupipe::bfloat16>(k * n, MemoryTag::activations);
    auto c = be.allocate<cupipe::bfloat16>(m * n, MemoryTag::activations);
    fill_random(be, a.data(), m * k, 1);
    fill_random(be, b.data(), k * n, 2);
    r.timing = h.time([&] {
      ops::gemm(be, ta, tb, 1.0f, ConstView<cupipe::bfloat16>(a.view(as)), ConstView<cupipe::bfloat16>(b.view(bs)), 0.0f,
                c.view(cs));
    });
    key.ab_type = key.c_type = CUDA_R_16BF;
    key.compute = CUBLAS_COMPUTE_32F;
    r.reference_ms = best_heuristic_ms(be, h, key, {a.data(), b.data(), c.data(), nullptr, nullptr, &alpha, &beta});
  } else {
    auto a = be.allocate<float>(m * k, MemoryTag::activations);
    auto b = be.allocate<float>(k * n, MemoryTag::activations);
    auto c = be.allocate<float>(m * n, MemoryTag::activations);
    fill_random(be, a.data(), m * k, 1);
    fill_random(be, b.data(), k * n, 2);
    r.timing = h.time([&] { ops::gemm(be, ta, tb, 1.0f, a.view(as), b.view(bs), 0.0f, c.view(cs)); });
    key.compute = kind == GemmKind::tf32 ? CUBLAS_COMPUTE_32F_FAST_TF32 : CUBLAS_COMPUTE_32F;
    r.reference_ms = best_heuristic_ms(be, h, key, {a.data(), b.data(), c.data(), nullptr, nullptr, &alpha, &beta});
  }
  be.math = gpu::MathMode::fp32;
  return r;
}

void measure_gemm_ceilings(Gpu& be, Harness& h, index_t size) {
  for (GemmKind kind : {GemmKind::fp32, GemmKind::tf32, GemmKind::bf16}) {
    Result r = run_gemm(be, h, kind, "large square", size, size, size, Transpose::no, Transpose::no);
    // The ceiling is the faster of our op and the best candidate, as TFLOP/s.
    const double best_ms = r.reference_ms > 0 ? std::min(r.reference_ms, r.timing.median_ms) : r.timing.median_ms;
    const std::string name = std::string("gemm_") + kind_name(kind);
    h.set_ceiling(name, r.flops / (best_ms * 1e-3) / 1e12, "TFLOP/s");
    r.group = "ceiling";
    r.ceiling = name;
    r.ceiling_value = h.ceiling(name);
    h.add(r);
  }
}

// --- ops ------------------------------------------------------------------------------------------

Result memory_bound(Harness& h, std::string group, std::string name, std::string shape, double bytes) {
  Result r = make_result(std::move(group), std::move(name), std::move(shape));
  r.bytes = bytes;
  r.ceiling = "copy";
  r.ceiling_value = h.ceiling("copy");
  return r;
}

void bench_layernorm(Gpu& be, Harness& h, index_t rows, index_t cols) {
  const Shape s{rows, cols}, c{cols}, r{rows};
  auto x = be.allocate(rows * cols, MemoryTag::activations), y = be.allocate(rows * cols, MemoryTag::activations);
  auto dy = be.allocate(rows * cols, MemoryTag::activations), dx = be.allocate(rows * cols, MemoryTag::activations);
  auto gamma = be.allocate(cols, MemoryTag::weights), beta = be.allocate(cols, MemoryTag::weights);
  auto dgamma = be.allocate(cols, MemoryTag::gradients), dbeta = be.allocate(cols, MemoryTag::gradients);
  auto mean = be.allocate(rows, MemoryTag::activations), rstd = be.allocate(rows, MemoryTag::activations);
  fill_random(be, x.data(), rows * cols, 3);
  fill_random(be, dy.data(), rows * cols, 4);
  fill_random(be, gamma.data(), cols, 5, 0.5, 1.5);
  fill_random(be, beta.data(), cols, 6);
  fill_random(be, dgamma.data(), cols, 7);
  fill_random(be, dbeta.data(), cols, 8);
  const double f = sizeof(float), rc = double(rows * cols);
  const std::string shape = shape_text({rows, cols});

  Result fwd = memory_bound(h, "layernorm", "forward", shape, f * (2 * rc + 2.0 * cols + 2.0 * rows));
  fwd.timing = h.time([&] {
    ops::layernorm_forward(be, x.view(s), gamma.view(c), beta.view(c), y.view(s), mean.view(r), rstd.view(r), 1e-5);
  });
  h.add(fwd);
  Result bwd = memory_bound(h, "layernorm", "backward input", shape, f * (3 * rc + double(cols) + 2.0 * rows));
  bwd.timing = h.time([&] {
    ops::layernorm_backward_input(be, x.view(s), gamma.view(c), mean.view(r), rstd.view(r), dy.view(s), dx.view(s));
  });
  h.add(bwd);
  Result wgt = memory_bound(h, "layernorm", "backward weight", shape, f * (2 * rc + 4.0 * cols + 2.0 * rows));
  wgt.timing = h.time([&] {
    ops::layernorm_backward_weight(be, x.view(s), mean.view(r), rstd.view(r), dy.view(s), dgamma.view(c), dbeta.view(c));
  });
  h.add(wgt);
}

void bench_gelu(Gpu& be, Harness& h, index_t rows, index_t cols) {
  // The MLP's hidden activation: (B*T, 4C).
  const index_t n = rows * 4 * cols;
  const Shape s{rows, 4 * cols};
  auto x = be.allocate(n, MemoryTag::activations), y = be.allocate(n, MemoryTag::activations);
  auto dy = be.allocate(n, MemoryTag::activations);
  fill_random(be, x.data(), n, 9, -3, 3);
  fill_random(be, dy.data(), n, 10);
  const std::string shape = shape_text({rows, 4 * cols});
  Result fwd = memory_bound(h, "gelu", "forward", shape, 2.0 * sizeof(float) * double(n));
  fwd.timing = h.time([&] { ops::gelu_forward(be, x.view(s), y.view(s)); });
  h.add(fwd);
  Result bwd = memory_bound(h, "gelu", "backward", shape, 3.0 * sizeof(float) * double(n));
  bwd.timing = h.time([&] { ops::gelu_backward(be, x.view(s), dy.view(s), y.view(s)); });
  h.add(bwd);
}

void bench_softmax_xent(Gpu& be, Harness& h, index_t rows, index_t vocab) {
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
  const std::string shape = shape_text({rows, vocab});
  Result fwd = memory_bound(h, "softmax_xent", "forward", shape, f * rv + 4.0 * double(rows));
  fwd.timing = h.time([&] { ops::softmax_cross_entropy_forward(be, z.view(s), labels.view(r), loss.view(Shape{1}), rows); });
  h.add(fwd);
  Result bwd = memory_bound(h, "softmax_xent", "backward", shape, 2 * f * rv + 4.0 * double(rows));
  bwd.timing = h.time([&] { ops::softmax_cross_entropy_backward(be, z.view(s), labels.view(r), dz.view(s), rows); });
  h.add(bwd);
  be.check_inputs = true;
  be.synchronize();
}

void bench_adamw(Gpu& be, Harness& h, index_t n) {
  const Shape s{n};
  auto p = be.allocate(n, MemoryTag::weights), g = be.allocate(n, MemoryTag::gradients);
  auto m = be.allocate(n, MemoryTag::optimizer), v = be.allocate(n, MemoryTag::optimizer);
  fill_random(be, p.data(), n, 13);
  fill_random(be, g.data(), n, 14);
  fill_random(be, m.data(), n, 15, -0.01, 0.01);
  fill_random(be, v.data(), n, 16, 0, 1e-4);
  const ops::AdamWHyper hyper{.lr = 1e-4};
  Result r = memory_bound(h, "adamw", "update (fp32)", shape_text({n}), 7.0 * sizeof(float) * double(n));
  std::int64_t step = 1;
  r.timing = h.time([&] { ops::adamw_update(be, p.view(s), g.view(s), m.view(s), v.view(s), hyper, step++, 1.0f); });
  h.add(r);
}

void bench_embedding_backward(Gpu& be, Harness& h, index_t rows, index_t vocab, index_t cols) {
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
  const double bytes = sizeof(float) * (double(rows * cols) + 2 * unique * double(cols)) + 4.0 * double(rows);
  be.check_inputs = false;
  Result res = memory_bound(h, "embedding", "backward", shape_text({rows, cols}) + " vocab " + std::to_string(vocab), bytes);
  res.timing = h.time([&] { ops::embedding_backward(be, ids.view(r), dy.view(s), dtable.view(t)); });
  h.add(res);
  be.check_inputs = true;
  be.synchronize();
}

int run(const Options& options) {
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
  const nlohmann::json device{{"name", prop.name},
                              {"compute_capability", std::to_string(prop.major) + "." + std::to_string(prop.minor)},
                              {"sm_count", prop.multiProcessorCount},
                              {"l2_bytes", prop.l2CacheSize},
                              {"global_memory_bytes", prop.totalGlobalMem}};
  std::printf("# cupipe kernel benchmarks on %s (sm_%d%d, %d SMs, %d MiB L2)\n\n", prop.name, prop.major, prop.minor,
              prop.multiProcessorCount, prop.l2CacheSize >> 20);
  Harness h(be.stream(), std::size_t(prop.l2CacheSize), options.warmup, options.repeats);
  h.print_header();

  measure_copy_ceiling(be, h);
  be.context().pool().trim();
  measure_gemm_ceilings(be, h, options.quick ? 4096 : 8192);
  be.context().pool().trim();

  const index_t rows = 8192;  // B * T
  const std::vector<index_t> widths = options.quick ? std::vector<index_t>{768} : std::vector<index_t>{768, 1024, 4096};
  for (index_t c : widths) {
    bench_layernorm(be, h, rows, c);
    bench_gelu(be, h, rows, c);
    bench_embedding_backward(be, h, rows, 50257, c);
    be.context().pool().trim();
  }
  bench_softmax_xent(be, h, rows, options.quick ? 8192 : 50257);
  be.context().pool().trim();
  bench_adamw(be, h, 124'000'000);
  be.context().pool().trim();

  // GPT-2 small block (C = 768), forward and the two backward products of each Linear.
  struct Problem {
    const char* name;
    index_t m, n, k;
    Transpose ta, tb;
  };
  const index_t C = 768;
  const std::vector<Problem> problems{
      {"qkv forward", rows, 3 * C, C, Transpose::no, Transpose::yes},
      {"attn proj forward", rows, C, C, Transpose::no, Transpose::yes},
      {"fc forward", rows, 4 * C, C, Transpose::no, Transpose::yes},
      {"fc proj forward", rows, C, 4 * C, Transpose::no, Transpose::yes},
      {"fc backward dx", rows, C, 4 * C, Transpose::no, Transpose::no},
      {"fc backward dW", 4 * C, C, rows, Transpose::yes, Transpose::no},
  };
  for (GemmKind kind : {GemmKind::tf32, GemmKind::bf16}) {
    for (const Problem& p : problems) {
      Result r = run_gemm(be, h, kind, p.name, p.m, p.n, p.k, p.ta, p.tb);
      r.ceiling = std::string("gemm_") + kind_name(kind);
      r.ceiling_value = h.ceiling(r.ceiling);
      h.add(r);
    }
    be.context().pool().trim();
  }

  std::printf("\nTargets (not asserted): memory-bound ops >= 85%% of the copy ceiling; GEMM >= 0.95x the best heuristic.\n");
  if (!options.json.empty()) {
    h.write_json(options.json, device);
    std::printf("JSON written to %s\n", options.json.c_str());
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  Options options;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--json" && i + 1 < argc) options.json = argv[++i];
    else if (arg == "--repeats" && i + 1 < argc) options.repeats = std::max(1, std::atoi(argv[++i]));
    else if (arg == "--warmup" && i + 1 < argc) options.warmup = std::max(0, std::atoi(argv[++i]));
    else if (arg == "--quick") options.quick = true;
    else {
      std::fprintf(stderr, "usage: %s [--json out.json] [--repeats N] [--warmup N] [--quick]\n", argv[0]);
      return 1;
    }
  }
  try {
    return run(options);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_kernels: %s\n", e.what());
    return 1;
  }
}
