// SPDX-License-Identifier: Apache-2.0
// The host training loop for GPipe, 1F1B, ZB-H1 and ZB-H2 (and 1F1B with --tp) (trainer.hpp's train_family), in its own translation unit so that
// the schedule families compile side by side.
#include "trainer.hpp"

namespace gpt_trainer {

template int train_family<examples::ScheduleFamily::flush>(const Flags&, const io::TokenCorpus&, const io::TokenSplit&,
                                                          const Launch&, const DeviceRate&, AsBuilt);

}  // namespace gpt_trainer
