// SPDX-License-Identifier: Apache-2.0
// What gpt_train's CUDA units share: how a CUDA pipeline is set up before training (CudaSetup) and the
// preset and precision dispatch of one family of schedules (train_cuda_family), whose flush family
// trainer_cuda.cu compiles and whose two-chunk and asynchronous families trainer_cuda_other.cu does,
// each in fp32 and bf16 for both presets.
#pragma once

#include <string>

#include "cupipe/cupipe.cuh"
#include "trainer.hpp"

namespace gpt_trainer {

/// backend::Cuda<bfloat16, float>: --precision bf16 --backend cuda.
using CudaBf16 = backend::Cuda<cupipe::bfloat16, float>;  // in full: OpenBLAS declares a ::bfloat16 too

/// Sets up a CUDA pipeline of `config` before its first step: the fp32 GEMMs' arithmetic (--math; bf16
/// GEMMs are bf16 either way), and the first line of the run, which says which attention path runs
/// (backend/cuda/attention_path.cuh: CUPIPE_ATTENTION chooses another), as the first local stage's
/// first microbatch will take it.
template <gpt::Config config>
struct CudaSetup {
  const Flags* flags = nullptr;
  const Launch* launch = nullptr;
  backend::cuda::MathMode math = backend::cuda::MathMode::tf32;
  bool set_math = true;  ///< false in bf16

  template <class Pipe>
  void operator()(Pipe& pipe) const {
    if (set_math)
      for (int k = 0; k < pipe.plan().config.stages; ++k) pipe.backend(k).math = math;
    for (int k = 0; k < pipe.plan().config.stages; ++k) {
      if (!pipe.local(k)) continue;
      const index_t rows = index_t((flags->batch + flags->microbatches - 1) / flags->microbatches) * config.context;
      const std::string line =
          ops::attention_choice(pipe.backend(k), rows, config.channels, config.heads, config.context).describe();
      if (launch->leader()) std::printf("attention: %s\n", line.c_str());
      return;
    }
  }
};

/// Trains `config` on CUDA with a --schedule of family F, in fp32 (--math sets the GEMMs' arithmetic)
/// or bf16.
template <examples::ScheduleFamily F, gpt::Config config>
int train_cuda_preset(const Flags& f, const io::TokenCorpus& corpus, const io::TokenSplit& split, const Launch& launch,
                      const DeviceRate& rate, backend::cuda::MathMode math) {
  const CudaSetup<config> setup{&f, &launch, math, f.precision != "bf16"};
  if (f.precision == "bf16") return train_family<F, CudaBf16, config>(f, corpus, split, launch, rate, setup);
  return train_family<F, backend::Cuda<T>, config>(f, corpus, split, launch, rate, setup);
}

/// Trains --preset on CUDA with a --schedule of family F. gpt::gpt2_124m and gpt::tiny are spelled out
/// as in bench/gpt_step: the model's size is a template argument of a function, not of a
/// namespace-scope alias, because nvcc 13's host-code generator loses a class-type template argument
/// there (docs/architecture.md).
template <examples::ScheduleFamily F>
int train_cuda_family(const Flags& f, const io::TokenCorpus& corpus, const io::TokenSplit& split, const Launch& launch,
                      const DeviceRate& rate, backend::cuda::MathMode math) {
  if (f.preset == "gpt2-124m")
    return train_cuda_preset<F, gpt::Config{50304, 1024, 12, 12, 768}>(f, corpus, split, launch, rate, math);
  return train_cuda_preset<F, gpt::Config{256, 64, 4, 4, 128}>(f, corpus, split, launch, rate, math);
}
#define CUPIPE_GPT_CUDA_FAMILY(F)                                                                                  \
  extern template int train_cuda_family<examples::ScheduleFamily::F>(const Flags&, const io::TokenCorpus&,        \
                                                                     const io::TokenSplit&, const Launch&,       \
                                                                     const DeviceRate&, backend::cuda::MathMode);
CUPIPE_GPT_CUDA_FAMILY(flush)
CUPIPE_GPT_CUDA_FAMILY(chunked)
CUPIPE_GPT_CUDA_FAMILY(asynchronous)
#undef CUPIPE_GPT_CUDA_FAMILY

}  // namespace gpt_trainer
