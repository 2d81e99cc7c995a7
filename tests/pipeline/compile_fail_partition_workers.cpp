// SPDX-License-Identifier: Apache-2.0
// Must not compile: partition<Model, 2> counts stages, and ZeroBubbleV puts 2 of them on each worker,
// so the pipeline would silently run 1 worker where the user asked for 2 (issue #61).
// partition_for<Model, 2, schedule::ZeroBubbleV> is the spelling that names the workers.
#include "cupipe/cupipe.hpp"

using Model = cupipe::Sequential<cupipe::Linear<8, 8>, cupipe::ReLU, cupipe::Linear<8, 8>, cupipe::ReLU,
                                 cupipe::Linear<8, 4>>;
constexpr int workers =
    cupipe::Pipeline<cupipe::partition<Model, 2>, cupipe::schedule::ZeroBubbleV, cupipe::backend::Host<double>>::stages;
