// SPDX-License-Identifier: Apache-2.0
// Must not compile: two layers cannot fill three stages.
#include "cupipe/cupipe.hpp"
#include "cupipe/pipeline/stage_list.hpp"

using Model = cupipe::Sequential<cupipe::Linear<4, 4>, cupipe::Linear<4, 2>>;
constexpr auto stages = cupipe::partition<Model, 3>::size;
