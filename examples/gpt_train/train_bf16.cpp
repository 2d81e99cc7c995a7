// SPDX-License-Identifier: Apache-2.0
// gpt_train --precision bf16 on the host: the training loop instantiated for
// backend::Host<bfloat16, float> (bf16 weights in use, activations and messages; fp32 master weights,
// gradients, AdamW state, LayerNorm and attention statistics and the loss), in its own translation
// unit so it compiles beside main.cpp. The one-chunk flush schedules (gpipe, 1f1b, zb-h1, zb-h2) at
// 1, 2 and 4 stages, and with --tp 2 or 4 1F1B on 1 or 2 stages: each schedule x stage count x
// tensor-parallel degree instantiates the whole loop again. A build
// configured with -DCUPIPE_TRAINER_SCHEDULES=flush leaves this unit out (examples/gpt_train/CMakeLists.txt).
#include <type_traits>

#include "trainer.hpp"
#include "trainer_schedules.hpp"

namespace gpt_trainer {

int train_bf16(const Flags& f, const io::TokenCorpus& corpus, const io::TokenSplit& split, const Launch& launch) {
  using Bf16 = backend::Host<cupipe::bfloat16, float>;  // in full: OpenBLAS declares a ::bfloat16 too
  int rc = 1;
  schedule::with_policy(f.schedule, [&]<class Schedule>() {
    if constexpr (!cupipe::examples::bf16_builds<Schedule>) {
      cupipe::examples::refuse_bf16_schedule<Schedule>();
    } else {
      with_stage_count<1, 2, 4>(f.stages, [&]<int P>() {
        // --tp: main.cpp let only 1f1b on 1 or 2 stages through, as in fp32.
        if constexpr (std::is_same_v<Schedule, schedule::OneFOneB> && P <= 2) {
          if (f.tp == 2) rc = train<gpt::tiny, Schedule, P, Bf16, 2>(f, corpus, split, launch);
          if (f.tp == 4) rc = train<gpt::tiny, Schedule, P, Bf16, 4>(f, corpus, split, launch);
        }
        if (f.tp == 1) rc = train<gpt::tiny, Schedule, P, Bf16>(f, corpus, split, launch);
      });
    }
  });
  return rc;
}

}  // namespace gpt_trainer
