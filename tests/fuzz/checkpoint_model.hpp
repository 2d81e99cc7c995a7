// SPDX-License-Identifier: Apache-2.0
// The checkpoint target's model (fuzz_checkpoint loads into it, fuzz_seed_corpus trains it to write
// the seed), and the split of its input: a 4-byte little-endian length, the model file, then the
// state file.
#pragma once

#include "cupipe/cupipe.hpp"
#include "cupipe/io/io.hpp"

namespace cupipe::fuzz {

using CheckpointModel = Sequential<Linear<4, 6>, ReLU, Linear<6, 3>>;
using CheckpointPipeline = Pipeline<partition<CheckpointModel, 1>, schedule::GPipe, backend::Host<float>>;

}  // namespace cupipe::fuzz
