// SPDX-License-Identifier: Apache-2.0
// Must not compile: 2 workers of ZeroBubbleV need 4 virtual stages, and the model has 3 layers. One
// sentence, and no second error about the multiple of V that a clamped count would otherwise break.
#include "cupipe/cupipe.hpp"

using Model = cupipe::Sequential<cupipe::Linear<4, 4>, cupipe::ReLU, cupipe::Linear<4, 2>>;
using Schedule = cupipe::schedule::ZeroBubbleV;
constexpr int workers = cupipe::Pipeline<cupipe::partition_for<Model, 2, Schedule>, Schedule, cupipe::backend::Host<double>>::stages;
