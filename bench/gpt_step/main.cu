// SPDX-License-Identifier: Apache-2.0
// One GPT-2-124M-shaped training step on one GPU (CUDA backend, fp32 or tf32 GEMMs, or bf16 storage with
// fp32 master weights, gradients and optimizer state: --precision bf16): tokens/s and
// MFU, where the peak is not a constant from a data sheet but this device's GEMM rate measured in
// the same run (a large square ops::gemm in the same math mode). Model FLOPs per token follow the
// PaLM/llm.c count: 6 N for the parameters (N counted once for the tied wte/lm_head) plus 6 L C T
// for causal attention.
//   bench_gpt_step [--batch B] [--steps N] [--math fp32|tf32] [--precision fp32|bf16] [--microbatches M]
//                  [--attention auto|cudnn|mma|tiled|simple]
// With --precision bf16 the peak is a bf16 GEMM's (fp32 accumulation) and --math does not apply.
#include <chrono>
#include <cstdio>
#include <cstring>
#include <string>
#include <type_traits>
#include <vector>

#include "cupipe/backend/cuda/peak.cuh"
#include "cupipe/cupipe.cuh"
#include "cupipe/gpt/model.hpp"

using namespace cupipe;

namespace {

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// The model's types live in a function template: nvcc 13's host-code generator (cudafe++) loses a
// class-type template argument (gpt::Config) in namespace-scope aliases.
template <gpt::Config config, class Storage>
int run(int argc, char** argv) {
  using Model = gpt::Model<config>;
  using Pipe = Pipeline<partition<Model, 1>, schedule::GPipe, backend::Cuda<Storage, float>>;
  constexpr bool bf16 = std::is_same_v<Storage, cupipe::bfloat16>;  // in full: OpenBLAS declares a ::bfloat16 too
  int batch = 8, steps = 10, microbatches = 1;
  std::string math = "fp32", attention = "auto";
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    const bool has_value = i + 1 < argc;
    if (arg == "--batch" && has_value) batch = std::stoi(argv[++i]);
    else if (arg == "--steps" && has_value) steps = std::stoi(argv[++i]);
    else if (arg == "--microbatches" && has_value) microbatches = std::stoi(argv[++i]);
    else if (arg == "--math" && has_value) math = argv[++i];
    else if (arg == "--attention" && has_value) attention = argv[++i];
    else if (arg == "--precision" && has_value) ++i;  // read by main
    else CUPIPE_THROW("bench_gpt_step: unknown argument '", arg,
                      "' (--batch B, --steps N, --microbatches M, --math fp32|tf32, --precision fp32|bf16, "
                      "--attention auto|cudnn|mma|tiled|simple)");
  }
  CUPIPE_REQUIRE(math == "fp32" || math == "tf32", "bench_gpt_step: --math must be fp32 or tf32, got '", math, "'");
  const backend::cuda::AttentionKernel attention_kernel = backend::cuda::parse_attention(attention, "bench_gpt_step: --attention");
  CUPIPE_REQUIRE(batch > 0 && steps > 0 && microbatches > 0, "bench_gpt_step: --batch, --steps and --microbatches must be positive");
  const backend::cuda::MathMode mode = math == "tf32" ? backend::cuda::MathMode::tf32 : backend::cuda::MathMode::fp32;
  const std::string gemms = bf16 ? "bf16" : math;

  const double peak = backend::cuda::measured_gemm_tflops<Storage>(0, mode);
  Pipe pipe({.microbatches = microbatches, .seed = 1});
  pipe.backend(0).math = mode;
  pipe.backend(0).attention = attention_kernel;
  const index_t rows = index_t(batch) * config.context;
  // What the attention runs, as its first call would choose it (one microbatch's rows).
  const std::string attention_line =
      ops::attention_choice(pipe.backend(0), rows / microbatches, config.channels, config.heads, config.context).describe();
  Rng rng(2);
  std::vector<std::int32_t> ids(static_cast<std::size_t>(rows)), next(ids.size());
  for (auto& t : ids) t = std::int32_t(rng.below(50257));
  for (auto& t : next) t = std::int32_t(rng.below(50257));
  const ConstView<std::int32_t> x{ids.data(), Shape{rows, 1}}, y{next.data(), Shape{rows}};
  const optim::AdamW adamw({.lr = 6e-4, .weight_decay = 0.1, .clip_norm = 1.0});
  for (int i = 0; i < 2; ++i) pipe.train_step(x, y, adamw);  // warm-up: plans, pools
  pipe.backend(0).synchronize();
  const auto t0 = std::chrono::steady_clock::now();
  double loss = 0;
  for (int i = 0; i < steps; ++i) loss = pipe.train_step(x, y, adamw).loss;
  pipe.backend(0).synchronize();
  const double per_step = seconds_since(t0) / steps;
  const double tokens_per_second = double(rows) / per_step;
  const double flops_per_token = config.flops_per_token();
  const double achieved = tokens_per_second * flops_per_token / 1e12;
  std::printf("GPT-2 124M shape (V %lld, T %lld, %lld x C %lld, %lld heads), batch %d x %lld tokens, %s GEMMs, %s attention\n",
              (long long)config.vocab, (long long)config.context, (long long)config.layers, (long long)config.channels,
              (long long)config.heads, batch, (long long)config.context, gemms.c_str(), attention_line.c_str());
  std::printf("step %.1f ms, %.0f tokens/s, %.1f TFLOP/s achieved; measured %s GEMM peak %.1f TFLOP/s: MFU %.1f%% "
              "(loss %.4f)\n", per_step * 1e3, tokens_per_second, achieved, gemms.c_str(), peak, 100 * achieved / peak, loss);
  // What ran, for scripts/gpu_results.py: the precision of the GEMMs, the batch, and the attention path
  // asked for (auto: the default) and taken.
  const std::string attention_taken(backend::cuda::to_string(
      ops::attention_choice(pipe.backend(0), rows / microbatches, config.channels, config.heads, config.context).kernel));
  std::printf("{\"tokens_per_second\":%.1f,\"step_ms\":%.3f,\"achieved_tflops\":%.3f,\"peak_tflops\":%.3f,\"mfu\":%.4f,"
              "\"precision\":\"%s\",\"batch\":%d,\"attention\":\"%s\",\"attention_taken\":\"%s\"}\n",
              tokens_per_second, per_step * 1e3, achieved, peak, achieved / peak, gemms.c_str(), batch, attention.c_str(),
              attention_taken.c_str());
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    std::string precision = "fp32";
    for (int i = 1; i + 1 < argc; ++i)
      if (std::string(argv[i]) == "--precision") precision = argv[i + 1];
    CUPIPE_REQUIRE(precision == "fp32" || precision == "bf16", "bench_gpt_step: --precision must be fp32 or bf16, got '",
                   precision, "'");
    // gpt::gpt2_124m, spelled out (nvcc 13 quirk above).
    if (precision == "bf16") return run<gpt::Config{50304, 1024, 12, 12, 768}, cupipe::bfloat16>(argc, argv);
    return run<gpt::Config{50304, 1024, 12, 12, 768}, float>(argc, argv);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_gpt_step: %s\n", e.what());
    return 1;
  }
}
