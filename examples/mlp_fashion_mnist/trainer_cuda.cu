// SPDX-License-Identifier: Apache-2.0
// The trainer on backend::Cuda<float>: stages in one process, placed on GPUs with --devices. Each
// schedule x stage count is a template instantiation that nvcc compiles for every GPU architecture,
// so this file instantiates the three flush schedules most users want, at 1, 2 and 4 stages.
#include "cupipe/cupipe.cuh"
#include "trainer.hpp"

namespace fmnist {

int train_cuda(const Flags& f, schedule::PolicyId policy, io::Dataset& train_set, const io::Dataset& test_set,
               const Launch& launch) {
  int rc = 1;
  auto run = [&]<class Schedule>() {
    with_stage_count<1, 2, 4>(f.stages, [&]<int P>() {
      rc = with_optimizer(f, [&](auto optimizer) {
        return train<Schedule, P, backend::Cuda<T>>(f, train_set, test_set, optimizer, launch);
      });
    });
  };
  switch (policy) {
    case schedule::PolicyId::gpipe: run.template operator()<schedule::GPipe>(); break;
    case schedule::PolicyId::one_f_one_b: run.template operator()<schedule::OneFOneB>(); break;
    case schedule::PolicyId::zb_h1: run.template operator()<schedule::ZeroBubbleH1>(); break;
    default:
      CUPIPE_THROW("--backend cuda: this build runs gpipe, 1f1b and zb-h1 on CUDA (each schedule is compiled per GPU "
                   "architecture; add others in examples/mlp_fashion_mnist/trainer_cuda.cu)");
  }
  return rc;
}

}  // namespace fmnist
