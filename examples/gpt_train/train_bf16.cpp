// SPDX-License-Identifier: Apache-2.0
// gpt_train --precision bf16 on the host: trainer.hpp's train_family instantiated for
// backend::Host<bfloat16, float> (bf16 weights in use, activations and messages; fp32 master weights,
// gradients, AdamW state, LayerNorm and attention statistics and the loss) for GPipe, 1F1B, ZB-H1
// and ZB-H2 (and 1F1B with --tp), in its own translation unit so it compiles beside main.cpp;
// train_bf16_other.cpp holds the other families. A build configured with
// -DCUPIPE_TRAINER_SCHEDULES=flush or 1f1b leaves both units out (examples/gpt_train/CMakeLists.txt).
#include "trainer.hpp"

namespace gpt_trainer {

template int train_family<examples::ScheduleFamily::flush, HostBf16>(const Flags&, const io::TokenCorpus&,
                                                                   const io::TokenSplit&, const Launch&, const DeviceRate&, AsBuilt);

}  // namespace gpt_trainer
