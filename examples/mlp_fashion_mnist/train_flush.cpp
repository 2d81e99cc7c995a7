// SPDX-License-Identifier: Apache-2.0
// The host training loop for GPipe, 1F1B, ZB-H1 and ZB-H2 (trainer.hpp's train_family), in its own translation unit so that
// the schedule families compile side by side.
#include "trainer.hpp"

namespace fmnist {

template int train_family<examples::ScheduleFamily::flush>(const Flags&, io::Dataset&, const io::Dataset&, const Launch&);

}  // namespace fmnist
