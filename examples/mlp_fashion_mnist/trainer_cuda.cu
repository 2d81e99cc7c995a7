// SPDX-License-Identifier: Apache-2.0
// The trainer on backend::Cuda<float>, and with --precision bf16 on backend::Cuda<bfloat16, float>:
// stages in one process, placed on GPUs with --devices. Every schedule trains in both precisions, at
// 1, 2 and 4 stages (trainer.hpp's train_family): the flush family here, the two-chunk and
// asynchronous families in trainer_cuda_other.cu, a unit of its own that builds beside this one
// (left out of builds configured with -DCUPIPE_TRAINER_SCHEDULES=flush or 1f1b: CI's CUDA stage,
// where nothing CUDA runs, and gpu_pack.sh's pack; each instantiation is nvcc's to compile, per GPU
// architecture).
// --stage-backends host,cuda (or cuda,host): an fp32 CPU stage and an fp32 GPU stage in one pipeline.
#include "trainer_cuda.cuh"
#include "trainer_schedules.hpp"

namespace fmnist {

template int train_family<examples::ScheduleFamily::flush, backend::Cuda<T>>(const Flags&, io::Dataset&,
                                                                             const io::Dataset&, const Launch&);
template int train_family<examples::ScheduleFamily::flush, CudaBf16>(const Flags&, io::Dataset&, const io::Dataset&,
                                                                     const Launch&);

int train_cuda(const Flags& f, io::Dataset& train_set, const io::Dataset& test_set, const Launch& launch) {
  // Every context the pipeline makes takes this arithmetic for its float GEMMs (bf16 GEMMs are bf16).
  backend::cuda::set_default_math(f.math == "fp32" ? backend::cuda::MathMode::fp32 : backend::cuda::MathMode::tf32);
  // main.cpp's require_built_schedule let the schedule through: its family is compiled.
  return examples::with_family(f.schedule, [&]<examples::ScheduleFamily F>() {
    if (f.precision == "bf16") return train_family<F, CudaBf16>(f, train_set, test_set, launch);
    return train_family<F, backend::Cuda<T>>(f, train_set, test_set, launch);
  });
}

int train_mixed_cuda(const Flags& f, io::Dataset& train_set, const io::Dataset& test_set, const Launch& launch) {
  backend::cuda::set_default_math(f.math == "fp32" ? backend::cuda::MathMode::fp32 : backend::cuda::MathMode::tf32);
  // main.cpp's check_stage_backends let only host,cuda and cuda,host through.
  return train_two_backends<backend::Host<float>, backend::Cuda<float>>(f, train_set, test_set, launch,
                                                                        f.stage_backends == "cuda,host");
}

}  // namespace fmnist
