// SPDX-License-Identifier: Apache-2.0
// The trainer on backend::Cuda<float>, and with --precision bf16 on backend::Cuda<bfloat16, float>:
// stages in one process, placed on GPUs with --devices. Each schedule x stage count is a template
// instantiation that nvcc compiles for every GPU architecture, so this file instantiates the
// registry's one-chunk flush schedules only, at 1, 2 and 4 stages (in bf16: 1F1B and GPipe).
// --stage-backends host,cuda (or cuda,host): an fp32 CPU stage and an fp32 GPU stage in one pipeline.
#include <type_traits>

#include "cupipe/cupipe.cuh"
#include "trainer.hpp"
#include "trainer_schedules.hpp"

namespace fmnist {

int train_cuda(const Flags& f, io::Dataset& train_set, const io::Dataset& test_set, const Launch& launch) {
  // Every context the pipeline makes takes this arithmetic for its float GEMMs (bf16 GEMMs are bf16).
  gpu::set_default_math(f.math == "fp32" ? gpu::MathMode::fp32 : gpu::MathMode::tf32);
  int rc = 1;
  with_policy(f.schedule, [&]<class Schedule>() {
    if constexpr (Schedule::update == schedule::UpdateRule::flush && Schedule::chunks == 1 &&
                  cupipe::examples::trainer_builds<Schedule>) {
      with_stage_count<1, 2, 4>(f.stages, [&]<int P>() {
        rc = with_optimizer(f, [&](auto optimizer) {
          if (f.precision != "bf16") return train<Schedule, P, backend::Cuda<T>>(f, train_set, test_set, optimizer, launch);
          if constexpr (std::is_same_v<Schedule, schedule::OneFOneB> || std::is_same_v<Schedule, schedule::GPipe>) {
            using Bf16 = backend::Cuda<cupipe::bfloat16, float>;  // in full: OpenBLAS declares a ::bfloat16 too
            return train<Schedule, P, Bf16>(f, train_set, test_set, optimizer, launch);
          } else {
            CUPIPE_THROW("--precision bf16 --backend cuda trains with 1f1b or gpipe in this build, not ", Schedule::name,
                         " (each schedule is compiled per GPU architecture; see examples/mlp_fashion_mnist/trainer_cuda.cu)");
          }
        });
      });
    } else {
      CUPIPE_THROW("--backend cuda: this build runs the one-chunk flush schedules on CUDA (each schedule is compiled "
                   "per GPU architecture; see examples/mlp_fashion_mnist/trainer_cuda.cu), not ", Schedule::name);
    }
  });
  return rc;
}

int train_mixed_cuda(const Flags& f, io::Dataset& train_set, const io::Dataset& test_set, const Launch& launch) {
  gpu::set_default_math(f.math == "fp32" ? gpu::MathMode::fp32 : gpu::MathMode::tf32);
  // main.cpp's check_stage_backends let only host,cuda and cuda,host through.
  return train_two_backends<backend::Host<float>, backend::Cuda<float>>(f, train_set, test_set, launch,
                                                                        f.stage_backends == "cuda,host");
}

}  // namespace fmnist
