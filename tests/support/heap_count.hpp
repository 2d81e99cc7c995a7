// SPDX-License-Identifier: Apache-2.0
// Counts the program's heap allocations: the global operator new, replaced. Included by one host
// source of a program (a program has one operator new; a host file, since nvcc would compile a
// replacement in a .cu file for the device as well): bench/harness/heap_count.cpp for the benchmarks,
// tests/pipeline/test_activation_arena.cpp for test_pipeline_runtime. heap_allocation_count is the count
// so far; the difference over a step is the step's allocations, every thread's together. The
// deletes are not inlined: GCC would otherwise pair an inlined free() with a `new` expression and warn.
#pragma once

#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <new>

namespace cupipe::test {
inline std::atomic<std::uint64_t> heap_allocation_count{0};
}  // namespace cupipe::test

void* operator new(std::size_t bytes) {
  cupipe::test::heap_allocation_count.fetch_add(1, std::memory_order_relaxed);
  if (void* p = std::malloc(bytes == 0 ? 1 : bytes)) return p;
  throw std::bad_alloc();
}
void* operator new[](std::size_t bytes) { return operator new(bytes); }
void* operator new(std::size_t bytes, std::align_val_t align) {
  cupipe::test::heap_allocation_count.fetch_add(1, std::memory_order_relaxed);
  const std::size_t a = static_cast<std::size_t>(align);
  if (void* p = std::aligned_alloc(a, (bytes + a - 1) / a * a)) return p;
  throw std::bad_alloc();
}
void* operator new[](std::size_t bytes, std::align_val_t align) { return operator new(bytes, align); }
[[gnu::noinline]] void operator delete(void* p) noexcept { std::free(p); }
void operator delete[](void* p) noexcept { std::free(p); }
[[gnu::noinline]] void operator delete(void* p, std::size_t) noexcept { std::free(p); }
void operator delete[](void* p, std::size_t) noexcept { std::free(p); }
[[gnu::noinline]] void operator delete(void* p, std::align_val_t) noexcept { std::free(p); }
void operator delete[](void* p, std::align_val_t) noexcept { std::free(p); }
[[gnu::noinline]] void operator delete(void* p, std::size_t, std::align_val_t) noexcept { std::free(p); }
void operator delete[](void* p, std::size_t, std::align_val_t) noexcept { std::free(p); }
