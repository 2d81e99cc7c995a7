// SPDX-License-Identifier: Apache-2.0
// Must not compile: 2BW across batches with m < p - 1 has no weight version for the next batch.
#include "cupipe/schedule/registry.hpp"

using Bad = cupipe::schedule::StaticSchedule<cupipe::schedule::PipeDream2BW, 8, 2, 1, 2>;
static_assert(Bad::plan().actions.size() == 8);

int main() {}
