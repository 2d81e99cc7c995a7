// SPDX-License-Identifier: Apache-2.0
// --precision bf16 (backend::Host<bfloat16, float>) for the two-chunk schedules (interleaved, BFS,
// ZBV, V-Half, V-Min, DualPipeV) and the asynchronous ones (PipeDream, 2BW): trainer.hpp's
// train_family in its own translation unit, beside train_bf16.cpp's flush family.
#include "trainer.hpp"

namespace fmnist {

template int train_family<examples::ScheduleFamily::chunked, HostBf16>(const Flags&, io::Dataset&, const io::Dataset&,
                                                                     const Launch&);
template int train_family<examples::ScheduleFamily::asynchronous, HostBf16>(const Flags&, io::Dataset&,
                                                                          const io::Dataset&, const Launch&);

}  // namespace fmnist
