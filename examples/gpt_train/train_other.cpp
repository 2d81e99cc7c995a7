// SPDX-License-Identifier: Apache-2.0
// The host training loops (trainer.hpp's train_family) for the two-chunk schedules (interleaved, BFS,
// ZBV, V-Half, V-Min, DualPipeV) and the asynchronous ones (PipeDream, 2BW), in one translation unit
// beside train_flush.cpp: a unit per family cost each trainer another 25-30 s of parsing the headers.
#include "trainer.hpp"

namespace gpt_trainer {

template int train_family<examples::ScheduleFamily::chunked>(const Flags&, const io::TokenCorpus&, const io::TokenSplit&, const Launch&, const DeviceRate&, AsBuilt);
template int train_family<examples::ScheduleFamily::asynchronous>(const Flags&, const io::TokenCorpus&, const io::TokenSplit&, const Launch&, const DeviceRate&, AsBuilt);

}  // namespace gpt_trainer
