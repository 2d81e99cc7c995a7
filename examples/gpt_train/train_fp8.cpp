// SPDX-License-Identifier: Apache-2.0
// gpt_train --precision fp8-block or fp8-delayed on the host: trainer.hpp's train_family for the
// flush schedules (GPipe, 1F1B, ZB-H1, ZB-H2) on backend::HostFp8<fp8::Blockwise> and
// HostFp8<fp8::PerTensorDelayed>: Host<bfloat16, float> whose layer GEMMs run in FP8, emulated
// (backend/host/fp8.hpp). In its own unit, and only in builds with every schedule
// (examples/gpt_train/CMakeLists.txt).
#include "trainer.hpp"

namespace gpt_trainer {

template int train_family<examples::ScheduleFamily::flush, HostFp8Block>(const Flags&, const io::TokenCorpus&,
                                                                        const io::TokenSplit&, const Launch&,
                                                                        const DeviceRate&, AsBuilt);
template int train_family<examples::ScheduleFamily::flush, HostFp8Delayed>(const Flags&, const io::TokenCorpus&,
                                                                          const io::TokenSplit&, const Launch&,
                                                                          const DeviceRate&, AsBuilt);

}  // namespace gpt_trainer
