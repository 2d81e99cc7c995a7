// SPDX-License-Identifier: Apache-2.0
// --precision bf16: the host training loop (trainer.hpp's train_family) instantiated for
// backend::Host<bfloat16, float> (bf16 weights in use, activations and messages; fp32 master
// weights, gradients, optimizer state and loss) for GPipe, 1F1B, ZB-H1 and ZB-H2, in its own
// translation unit so it compiles beside main.cpp; train_bf16_other.cpp holds the other families. A
// build configured with -DCUPIPE_TRAINER_SCHEDULES=flush or 1f1b leaves both units out
// (examples/mlp_fashion_mnist/CMakeLists.txt).
// --stage-backends host:bf16,host (or host,host:bf16): one stage in bf16, the other in fp32, in one
// pipeline (backend::PerWorker), under gpipe or 1f1b.
#include "trainer.hpp"

namespace fmnist {

template int train_family<examples::ScheduleFamily::flush, HostBf16>(const Flags&, io::Dataset&, const io::Dataset&,
                                                                   const Launch&);

int train_mixed(const Flags& f, io::Dataset& train_set, const io::Dataset& test_set, const Launch& launch) {
  // main.cpp's check_stage_backends let only host:bf16,host and host,host:bf16 through, and --split-at
  // 0 (the partition's, layer 2), 2 or 4.
  if (f.split_at == 4) return train_mixed_from_layer_4(f, train_set, test_set, launch);
  return train_two_backends<backend::Host<float>, HostBf16>(f, train_set, test_set, launch, f.stage_backends == "host:bf16,host");
}

}  // namespace fmnist
