// SPDX-License-Identifier: Apache-2.0
// Must not compile: a stage without layers.
#include "cupipe/cupipe.hpp"
#include "cupipe/pipeline/stage_list.hpp"

constexpr auto layers = cupipe::Stage<>::size;
