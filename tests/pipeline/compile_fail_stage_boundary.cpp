// SPDX-License-Identifier: Apache-2.0
// Must not compile: stage 0 ends with 5 features, stage 1 starts with 6.
#include "cupipe/cupipe.hpp"
#include "cupipe/pipeline/stage_list.hpp"

using Bad = cupipe::StageList<cupipe::Stage<cupipe::Linear<4, 5>>, cupipe::Stage<cupipe::Linear<6, 2>>>;
constexpr auto out_features = Bad::out_features;
