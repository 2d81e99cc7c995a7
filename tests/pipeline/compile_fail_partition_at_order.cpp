// SPDX-License-Identifier: Apache-2.0
// Must not compile: partition_at's stages must start at ascending layers inside the body.
#include "cupipe/cupipe.hpp"
#include "cupipe/pipeline/stage_list.hpp"

using Model = cupipe::Sequential<cupipe::Linear<4, 4>, cupipe::ReLU, cupipe::Linear<4, 2>>;
constexpr auto stages = cupipe::partition_at<Model, 2, 1>::size;
