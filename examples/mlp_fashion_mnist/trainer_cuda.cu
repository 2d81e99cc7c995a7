// SPDX-License-Identifier: Apache-2.0
// The trainer on backend::Cuda<float>, and with --precision bf16 on backend::Cuda<bfloat16, float>:
// stages in one process, placed on GPUs with --devices. Every schedule trains in both precisions, at
// 1, 2 and 4 stages (trainer.hpp's train_family): the flush family here, the two-chunk and
// asynchronous families in trainer_cuda_other.cu, a unit of its own that builds beside this one
// (left out of builds configured with -DCUPIPE_TRAINER_SCHEDULES=flush or 1f1b: CI's CUDA stage,
// where nothing CUDA runs, and gpu_pack.sh's pack; each instantiation is nvcc's to compile, per GPU
// architecture).
// --stage-backends host,cuda (or cuda,host): an fp32 CPU stage and an fp32 GPU stage in one pipeline,
// stage 1 from layer 2 or 4, and the GPU stage's calibration for --plan auto (calibrate_cuda).
#include "cupipe/planner/calibrate.hpp"
#include "plan_auto.hpp"
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
  // main.cpp's check_stage_backends let only host,cuda and cuda,host through, split at one of
  // stage_backend_cuts (0: the first).
  const bool cuda_first = f.stage_backends == "cuda,host";
  if (std::size_t(f.split_at) == stage_backend_cuts[1])
    return train_two_backends<backend::Host<float>, backend::Cuda<float>, stage_backend_cuts[1]>(f, train_set, test_set,
                                                                                                 launch, cuda_first);
  return train_two_backends<backend::Host<float>, backend::Cuda<float>>(f, train_set, test_set, launch, cuda_first);
}

planner::CostModel calibrate_cuda(const Flags& f, const io::Dataset& train_set, index_t rows) {
  // The arithmetic the stage will train with, as train_mixed_cuda sets it.
  backend::cuda::set_default_math(f.math == "fp32" ? backend::cuda::MathMode::fp32 : backend::cuda::MathMode::tf32);
  return planner::calibrate<Model, backend::Cuda<T>>(ConstView<T>{train_set.images.data(), Shape{rows, 784}}, 3, 1,
                                                     examples::profiled_microbatch_counts(rows));
}

}  // namespace fmnist
