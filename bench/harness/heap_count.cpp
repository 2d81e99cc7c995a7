// SPDX-License-Identifier: Apache-2.0
// The replaced operator new (heap_count.hpp) and the count a benchmark reads.
#include "../../tests/support/heap_count.hpp"

namespace cupipe::bench {
std::uint64_t heap_allocations() noexcept { return test::heap_allocation_count.load(std::memory_order_relaxed); }
}  // namespace cupipe::bench
