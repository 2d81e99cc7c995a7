// SPDX-License-Identifier: Apache-2.0
// gpt_train on backend::Cuda<float>: stages in one process, placed on GPUs with --devices, GEMMs in
// fp32 or tf32 (--math); with --precision bf16 on backend::Cuda<bfloat16, float>. Before training,
// the GEMM rate of each GPU in use is measured in that mode (backend::cuda::measured_gemm_tflops): the
// denominator of the MFU each step prints. Every schedule trains in both precisions, for both presets
// (trainer_cuda.cuh): the flush family here, the two-chunk and asynchronous families in
// trainer_cuda_other.cu, a unit of its own that builds beside this one (left out of builds configured
// with -DCUPIPE_TRAINER_SCHEDULES=flush or 1f1b: CI's CUDA stage, where nothing CUDA runs, and
// gpu_pack.sh's pack; each instantiation is nvcc's to compile, per GPU architecture).
#include "cupipe/backend/cuda/peak.cuh"
#include "trainer_cuda.cuh"
#include "trainer_schedules.hpp"

namespace gpt_trainer {

template int train_cuda_family<examples::ScheduleFamily::flush>(const Flags&, const io::TokenCorpus&,
                                                                const io::TokenSplit&, const Launch&,
                                                                const DeviceRate&, backend::cuda::MathMode);

int train_cuda(const Flags& f, const io::TokenCorpus& corpus, const io::TokenSplit& split, const Launch& launch) {
  const backend::cuda::MathMode math = f.math == "tf32" ? backend::cuda::MathMode::tf32 : backend::cuda::MathMode::fp32;
  const bool bf16 = f.precision == "bf16";
  DeviceRate rate{0, bf16 ? "bf16" : f.math};
  for (int device : devices_in_use(f))
    rate.peak_tflops += bf16 ? backend::cuda::measured_gemm_tflops<cupipe::bfloat16>(device, math) : backend::cuda::measured_gemm_tflops(device, math);
  // main.cpp's require_built_schedule let the schedule through: its family is compiled.
  return examples::with_family(f.schedule, [&]<examples::ScheduleFamily F>() {
    return train_cuda_family<F>(f, corpus, split, launch, rate, math);
  });
}

}  // namespace gpt_trainer
