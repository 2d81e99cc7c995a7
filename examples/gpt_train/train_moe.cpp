// SPDX-License-Identifier: Apache-2.0
// gpt_train --experts: trainer.hpp's train_family for the flush schedules (GPipe, 1F1B, ZB-H1,
// ZB-H2; 1 or 2 stages) and DualPipeV (2 stages) on the host in fp32, for the mixtures of experts
// this trainer builds (moe_presets in trainer.hpp), in its own unit.
#include "trainer.hpp"

namespace gpt_trainer {

int train_moe(const Flags& f, const io::TokenCorpus& corpus, const io::TokenSplit& split, const Launch& launch) {
  using examples::ScheduleFamily;
  const bool flush = examples::family_of_name(f.schedule) == ScheduleFamily::flush;
  if (moe_preset(f) == 1)
    return flush ? train_family<ScheduleFamily::flush, backend::Host<T>, moe_top1>(f, corpus, split, launch)
                 : train_family<ScheduleFamily::chunked, backend::Host<T>, moe_top1>(f, corpus, split, launch);
  if (moe_preset(f) == 2)
    return flush ? train_family<ScheduleFamily::flush, backend::Host<T>, moe_top2>(f, corpus, split, launch)
                 : train_family<ScheduleFamily::chunked, backend::Host<T>, moe_top2>(f, corpus, split, launch);
  CUPIPE_THROW(moe_presets_refusal(f));
}

}  // namespace gpt_trainer
