// SPDX-License-Identifier: Apache-2.0
// gpt_train on backend::Cuda<float>: stages in one process, placed on GPUs with --devices, GEMMs in
// fp32 or tf32 (--math); with --precision bf16 on backend::Cuda<bfloat16, float>. Before training,
// the GEMM rate of each GPU in use is measured in that mode (gpu::measured_gemm_tflops): the
// denominator of the MFU each step prints. Each preset x schedule x stage count is a template
// instantiation that nvcc compiles for every GPU architecture, so this file instantiates 1F1B, GPipe
// and the zero-bubble schedules at 1, 2 and 4 stages (in bf16: 1F1B).
#include <type_traits>

#include "cupipe/backend/cuda/peak.cuh"
#include "cupipe/cupipe.cuh"
#include "trainer.hpp"
#include "trainer_schedules.hpp"

namespace gpt_trainer {

namespace {

// The model's size is a template argument of this function, not of a namespace-scope alias: nvcc
// 13's host-code generator loses a class-type template argument there (docs/architecture.md).
template <gpt::Config config>
int train_preset(const Flags& f, const io::TokenCorpus& corpus, const io::TokenSplit& split, const Launch& launch,
                 const DeviceRate& rate, gpu::MathMode math) {
  int rc = 1;
  // The first line of a CUDA run says which attention path runs (backend/cuda/attention_path.cuh:
  // CUPIPE_ATTENTION chooses another), as the first local stage's first microbatch will take it.
  auto say_attention = [&f, &launch](auto& pipe) {
    for (int k = 0; k < pipe.plan().config.stages; ++k) {
      if (!pipe.local(k)) continue;
      const index_t rows = index_t((f.batch + f.microbatches - 1) / f.microbatches) * config.context;
      const std::string line =
          ops::attention_choice(pipe.backend(k), rows, config.channels, config.heads, config.context).describe();
      if (launch.leader()) std::printf("attention: %s\n", line.c_str());
      return;
    }
  };
  auto set_math = [math, &say_attention](auto& pipe) {
    for (int k = 0; k < pipe.plan().config.stages; ++k) pipe.backend(k).math = math;
    say_attention(pipe);
  };
  with_policy(f.schedule, [&]<class Schedule>() {
    if constexpr (Schedule::update == schedule::UpdateRule::flush && Schedule::chunks == 1 &&
                  cupipe::examples::trainer_builds<Schedule>) {
      with_stage_count<1, 2, 4>(f.stages, [&]<int P>() {
        if (f.precision != "bf16") {
          rc = train<config, Schedule, P, backend::Cuda<T>>(f, corpus, split, launch, rate, set_math);
        } else if constexpr (std::is_same_v<Schedule, schedule::OneFOneB>) {
          using Bf16 = backend::Cuda<cupipe::bfloat16, float>;  // in full: OpenBLAS declares a ::bfloat16 too
          rc = train<config, Schedule, P, Bf16>(f, corpus, split, launch, rate, say_attention);
        } else {
          CUPIPE_THROW("--precision bf16 --backend cuda trains with 1f1b in this build, not ", Schedule::name,
                       " (each schedule is compiled per GPU architecture; see examples/gpt_train/trainer_cuda.cu)");
        }
      });
    } else {
      CUPIPE_THROW("--backend cuda: this build runs the one-chunk flush schedules on CUDA (each schedule is compiled "
                   "per GPU architecture; see examples/gpt_train/trainer_cuda.cu), not ", Schedule::name);
    }
  });
  return rc;
}

}  // namespace

int train_cuda(const Flags& f, const io::TokenCorpus& corpus, const io::TokenSplit& split, const Launch& launch) {
  const gpu::MathMode math = f.math == "tf32" ? gpu::MathMode::tf32 : gpu::MathMode::fp32;
  const bool bf16 = f.precision == "bf16";
  DeviceRate rate{0, bf16 ? "bf16" : f.math};
  for (int device : devices_in_use(f))
    rate.peak_tflops += bf16 ? gpu::measured_gemm_tflops<cupipe::bfloat16>(device, math) : gpu::measured_gemm_tflops(device, math);
  // gpt::gpt2_124m and gpt::tiny, spelled out as in bench/gpt_step (the same nvcc quirk).
  if (f.preset == "gpt2-124m") return train_preset<gpt::Config{50304, 1024, 12, 12, 768}>(f, corpus, split, launch, rate, math);
  return train_preset<gpt::Config{256, 64, 4, 4, 128}>(f, corpus, split, launch, rate, math);
}

}  // namespace gpt_trainer
