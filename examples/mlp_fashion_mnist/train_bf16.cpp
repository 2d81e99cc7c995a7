// SPDX-License-Identifier: Apache-2.0
// --precision bf16: the training loop instantiated for backend::Host<bfloat16, float> (bf16 weights
// in use, activations and messages; fp32 master weights, gradients, optimizer state and loss), in
// its own translation unit so it compiles beside main.cpp. The one-chunk flush schedules only
// (gpipe, 1f1b, zb-h1, zb-h2): each schedule x stage count instantiates the whole loop again. A build
// configured with -DCUPIPE_TRAINER_SCHEDULES=flush leaves this unit out (examples/mlp_fashion_mnist/CMakeLists.txt).
// --stage-backends host:bf16,host (or host,host:bf16): one stage in bf16, the other in fp32, in one
// pipeline (backend::PerWorker), under gpipe or 1f1b.
#include "trainer.hpp"
#include "trainer_schedules.hpp"

namespace fmnist {

int train_bf16(const Flags& f, io::Dataset& train_set, const io::Dataset& test_set, const Launch& launch) {
  using Bf16 = backend::Host<cupipe::bfloat16, float>;  // in full: OpenBLAS declares a ::bfloat16 too
  int rc = 0;
  schedule::with_policy(f.schedule, [&]<class Schedule>() {
    if constexpr (!cupipe::examples::bf16_builds<Schedule>) {
      cupipe::examples::refuse_bf16_schedule<Schedule>();
    } else {
      with_stage_count<1, 2, 3, 4>(f.stages, [&]<int P>() {
        rc = with_optimizer(f, [&](auto optimizer) { return train<Schedule, P, Bf16>(f, train_set, test_set, optimizer, launch); });
      });
    }
  });
  return rc;
}

int train_mixed(const Flags& f, io::Dataset& train_set, const io::Dataset& test_set, const Launch& launch) {
  using Bf16 = backend::Host<cupipe::bfloat16, float>;
  // main.cpp's check_stage_backends let only host:bf16,host and host,host:bf16 through.
  return train_two_backends<backend::Host<float>, Bf16>(f, train_set, test_set, launch, f.stage_backends == "host:bf16,host");
}

}  // namespace fmnist
