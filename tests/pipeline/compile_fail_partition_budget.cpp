// SPDX-License-Identifier: Apache-2.0
// Must not compile: no split of this model keeps a worker under 1 KiB.
#include "cupipe/cupipe.hpp"
#include "cupipe/pipeline/memory_plan.hpp"

using Model = cupipe::Sequential<cupipe::Linear<64, 64>, cupipe::ReLU, cupipe::Linear<64, 10>>;
constexpr auto stages =
    cupipe::partition_within<Model, cupipe::schedule::OneFOneB, 2, 4, cupipe::MemoryModel{.rows_per_microbatch = 8}, 1024>::size;
