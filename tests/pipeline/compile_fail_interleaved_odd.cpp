// SPDX-License-Identifier: Apache-2.0
// Must not compile: Interleaved<2> gives each worker 2 chunks, so 3 stages cannot be dealt out.
#include "cupipe/cupipe.hpp"
#include "cupipe/pipeline/pipeline.hpp"

using Three = cupipe::StageList<cupipe::Stage<cupipe::Linear<4, 4>>, cupipe::Stage<cupipe::Linear<4, 4>>,
                                cupipe::Stage<cupipe::Linear<4, 2>>>;
constexpr int workers = cupipe::Pipeline<Three, cupipe::schedule::Interleaved<2>, cupipe::backend::Host<double>>::stages;
