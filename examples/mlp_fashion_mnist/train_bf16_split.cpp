// SPDX-License-Identifier: Apache-2.0
// --stage-backends host:bf16,host (or host,host:bf16) with stage 1 starting at layer 4, after the
// second Linear and ReLU (--split-at 4, or what --plan auto chooses for stages of unequal speed):
// trainer.hpp's train_two_backends in its own translation unit, beside train_bf16.cpp's split at
// layer 2.
#include "trainer.hpp"

namespace fmnist {

int train_mixed_from_layer_4(const Flags& f, io::Dataset& train_set, const io::Dataset& test_set, const Launch& launch) {
  return train_two_backends<backend::Host<float>, HostBf16, stage_backend_cuts[1]>(f, train_set, test_set, launch,
                                                                                   f.stage_backends == "host:bf16,host");
}

}  // namespace fmnist
