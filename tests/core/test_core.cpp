// SPDX-License-Identifier: Apache-2.0
// core/: errors, shapes, views and buffers, memory accounting, dtypes, the RNG and the CPUs a thread runs on.
#include <catch2/catch.hpp>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <limits>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "cupipe/backend/staging.hpp"
#include "cupipe/comm/topology.hpp"
#include "cupipe/core/core.hpp"
#include "cupipe/core/cpus.hpp"

using namespace cupipe;
using Catch::Contains;
using Catch::EndsWith;

// ---------------------------------------------------------------------------------------------
// error

TEST_CASE("cupipe::error carries message, call, file and line", "[cpu][core][error]") {
  SECTION("CUPIPE_REQUIRE names the failed condition") {
    int line = 0;
    try {
      line = __LINE__ + 1;
      CUPIPE_REQUIRE(2 + 2 == 5, "arithmetic is off by ", 1, " at stage ", Shape{8, 50});
      FAIL("CUPIPE_REQUIRE did not throw");
    } catch (const cupipe::error& e) {
      CHECK(e.message() == "arithmetic is off by 1 at stage (8, 50)");
      CHECK(e.call() == "2 + 2 == 5");
      CHECK_THAT(e.file(), EndsWith("test_core.cpp"));
      CHECK(e.line() == line);
      CHECK(std::string(e.what()) ==
            "arithmetic is off by 1 at stage (8, 50) [2 + 2 == 5] (at " + e.file() + ":" + std::to_string(line) + ")");
    }
  }
  SECTION("CUPIPE_REQUIRE does nothing when the condition holds, and evaluates it once") {
    int evaluations = 0;
    CHECK_NOTHROW([&] { CUPIPE_REQUIRE(++evaluations == 1, "never"); }());
    CHECK(evaluations == 1);
  }
  SECTION("CUPIPE_THROW has no call") {
    int line = 0;
    try {
      line = __LINE__ + 1;
      CUPIPE_THROW("stage ", 2, " expected input ", Shape{8, 50}, " but got ", Shape{8, 20});
    } catch (const std::runtime_error& base) {
      const auto* e = dynamic_cast<const cupipe::error*>(&base);
      REQUIRE(e != nullptr);
      CHECK(e->message() == "stage 2 expected input (8, 50) but got (8, 20)");
      CHECK(e->call().empty());
      CHECK(e->line() == line);
      CHECK(std::string(e->what()) == e->message() + " (at " + e->file() + ":" + std::to_string(line) + ")");
    }
  }
  SECTION("what() names a library header from its include root, other files as given") {
    const cupipe::error e("bad file", "", "/opt/x/include/cupipe/io/checkpoint.hpp", 7);
    CHECK(std::string(e.what()) == "bad file (at cupipe/io/checkpoint.hpp:7)");
    CHECK(e.file() == "/opt/x/include/cupipe/io/checkpoint.hpp");
    const cupipe::error user("bad flag", "", "/home/me/trainer/main.cpp", 9);
    CHECK(std::string(user.what()) == "bad flag (at /home/me/trainer/main.cpp:9)");
  }
  SECTION("constructed directly, e.g. to rethrow with more context") {
    const cupipe::error e("cudaMalloc failed: out of memory", "cudaMalloc(&p, 1 << 30)", "alloc.cuh", 42);
    CHECK(std::string(e.what()) == "cudaMalloc failed: out of memory [cudaMalloc(&p, 1 << 30)] (at alloc.cuh:42)");
    CHECK(e.message() == "cudaMalloc failed: out of memory");
  }
}

// ---------------------------------------------------------------------------------------------
// Shape

TEST_CASE("Shape prints as a tuple and folds to 2-D", "[cpu][core][shape]") {
  CHECK(Shape{8, 50}.to_string() == "(8, 50)");
  std::ostringstream out;
  out << Shape{2, 3, 4};
  CHECK(out.str() == "(2, 3, 4)");
  CHECK(Shape{5}.to_string() == "(5,)");  // as Python writes a 1-tuple
  CHECK(Shape{}.to_string() == "()");

  CHECK(Shape{8, 50}.rank() == 2);
  CHECK(Shape{8, 50}.numel() == 400);
  CHECK(Shape{8, 50}.rows() == 8);
  CHECK(Shape{8, 50}.cols() == 50);
  CHECK(Shape{2, 3, 4}.rows() == 6);
  CHECK(Shape{2, 3, 4}.cols() == 4);
  CHECK(Shape{2, 3, 4, 5}.numel() == 120);
  CHECK(Shape{7}.rows() == 1);
  CHECK(Shape{7}.cols() == 7);
  CHECK(Shape{}.numel() == 1);  // a scalar
  CHECK(Shape{}.rows() == 1);
  CHECK(Shape{}.cols() == 1);
  CHECK(Shape{0, 5}.numel() == 0);
  CHECK(Shape{0, 5}.rows() == 0);
  CHECK(Shape{2, 3, 4}[1] == 3);

  CHECK(Shape{8, 50} == Shape{8, 50});
  CHECK_FALSE(Shape{8, 50} == Shape{50, 8});
  CHECK_FALSE(Shape{5} == Shape{5, 1});  // rank matters
  CHECK_FALSE(Shape{8, 50} == Shape{8, 50, 1});
  CHECK(Shape{} == Shape{});

  static_assert(Shape{3, 4}.numel() == 12, "Shape is usable in constant expressions");
  CHECK_THROWS_AS((Shape{1, 2, 3, 4, 5}), std::length_error);
  CHECK_THROWS_AS((Shape{3, -1}), std::invalid_argument);
}

// ---------------------------------------------------------------------------------------------
// TensorView and HostBuffer

TEST_CASE("TensorView reshapes and slices rows, and says why it cannot", "[cpu][core][tensor]") {
  std::vector<float> data(20);
  for (std::size_t i = 0; i < data.size(); ++i) data[i] = float(i);
  const TensorView<float> v{data.data(), Shape{4, 5}};
  CHECK(v.rows() == 4);
  CHECK(v.cols() == 5);
  CHECK(v.at(2, 3) == 13.0f);
  CHECK_FALSE(v.empty());
  CHECK(TensorView<float>{}.empty());
  CHECK(TensorView<float>(data.data(), Shape{0, 5}).empty());

  const auto r = v.reshaped(Shape{2, 10});
  CHECK(r.data() == v.data());
  CHECK(r.shape() == Shape{2, 10});
  CHECK_THROWS_AS(v.reshaped(Shape{3, 7}), cupipe::error);
  CHECK_THROWS_WITH(v.reshaped(Shape{3, 7}), Contains("cannot reshape (4, 5) to (3, 7)"));

  const auto s = v.row_slice(1, 2);
  CHECK(s.data() == data.data() + 5);
  CHECK(s.shape() == Shape{2, 5});
  CHECK(v.row_slice(4, 0).shape() == Shape{0, 5});
  CHECK_THROWS_WITH(v.row_slice(3, 2), Contains("rows [3, 5) out of range for (4, 5)"));
  CHECK_THROWS_WITH(v.row_slice(-1, 1), Contains("rows [-1, 0) out of range for (4, 5)"));
  CHECK_THROWS_AS(v.row_slice(0, -1), cupipe::error);

  // A 3-D view slices along its folded rows.
  const TensorView<float> cube{data.data(), Shape{2, 2, 5}};
  CHECK(cube.row_slice(3, 1).data() == data.data() + 15);

  const TensorView<const float> read_only = v;  // mutable converts to read-only
  CHECK(read_only.data() == v.data());
  CHECK(read_only.shape() == v.shape());
}

// The memory space is part of a view's type: views convert (mutable to read-only) only within their
// space, so a device pointer cannot be handed to a host op by accident (compile_fail tests show the
// diagnostics), and backends name the views of their memory.
static_assert(std::is_convertible_v<TensorView<float>, ConstView<float>>);
static_assert(std::is_convertible_v<DeviceView<float>, DeviceConstView<float>>);
static_assert(!std::is_convertible_v<DeviceView<float>, ConstView<float>>);
static_assert(!std::is_convertible_v<DeviceConstView<float>, ConstView<float>>);
static_assert(!std::is_convertible_v<TensorView<float>, DeviceConstView<float>>);
static_assert(!std::is_convertible_v<TensorView<float>, DeviceView<float>>);
static_assert(host_accessible<HostSpace> && !host_accessible<DeviceSpace>);

namespace {
/// A backend whose memory the host may not read (its own space), kept in host arrays so the test can
/// look; it counts allocations and uploads.
struct OtherSpace {};
struct CountingBackend {
  using value_type = float;
  using space = OtherSpace;
  template <class U>
  using buffer = HostBuffer<U>;
  MemoryTracker memory;
  int allocations = 0;
  int uploads = 0;
  template <class U>
  buffer<U> allocate(index_t n, MemoryTag tag) {
    ++allocations;
    return buffer<U>(n, &memory, tag);
  }
  template <class U>
  void upload(std::span<const U> from, U* to) {
    ++uploads;
    std::copy(from.begin(), from.end(), to);
  }
};
struct HostLike {
  using value_type = float;
  using space = HostSpace;
  template <class U>
  using buffer = HostBuffer<U>;
};
}  // namespace

TEST_CASE("Staging hands host arrays to a backend: the same memory where the host reads it, else a reused copy",
          "[cpu][core][tensor][staging]") {
  std::vector<float> a{1, 2, 3, 4, 5, 6};
  SECTION("host memory: the view is the host array itself") {
    HostLike be;
    backend::Staging<HostLike, float> staging;
    const TensorView<const float> v = staging(be, ConstView<float>{a.data(), Shape{3, 2}});
    CHECK(v.data() == a.data());
    CHECK(v.shape() == Shape{3, 2});
  }
  SECTION("other memory: a copy, in a buffer reused until a larger array comes") {
    CountingBackend be;
    backend::Staging<CountingBackend, float> staging;
    const TensorView<const float, OtherSpace> v = staging(be, ConstView<float>{a.data(), Shape{3, 2}});
    CHECK(v.data() != a.data());
    CHECK(v.shape() == Shape{3, 2});
    CHECK(std::vector<float>(v.data(), v.data() + 6) == a);
    CHECK(be.memory.in_use(MemoryTag::workspace) == 6 * sizeof(float));
    const float* first = v.data();
    a[0] = 7;
    const auto w = staging(be, ConstView<float>{a.data(), Shape{2, 2}});
    CHECK(w.data() == first);  // reused
    CHECK(w.shape() == Shape{2, 2});
    CHECK(w.data()[0] == 7);
    CHECK(be.allocations == 1);
    std::vector<float> big(10, 1.5f);
    const auto z = staging(be, ConstView<float>{big.data(), Shape{5, 2}});
    CHECK(be.allocations == 2);
    CHECK(be.memory.in_use(MemoryTag::workspace) == 10 * sizeof(float));  // the old buffer was freed
    CHECK(z.data()[9] == 1.5f);
    CHECK(be.uploads == 3);
    const auto empty = staging(be, ConstView<float>{nullptr, Shape{0, 2}});
    CHECK(empty.data() == nullptr);
    CHECK(empty.shape() == Shape{0, 2});
    CHECK(be.uploads == 3);
    CHECK_THROWS_WITH(staging(be, ConstView<float>{nullptr, Shape{2, 2}}), Contains("null pointer"));
  }
}

TEST_CASE("check_view names who, what, and both shapes", "[cpu][core][tensor]") {
  std::vector<double> data(12);
  const TensorView<double> v{data.data(), Shape{3, 4}};
  CHECK_NOTHROW(check_view(v, Shape{3, 4}, "stage 2", "input"));
  CHECK_THROWS_WITH(check_view(v, Shape{8, 50}, "stage 2", "input"),
                    Contains("stage 2: input expected shape (8, 50) but got (3, 4)"));
  CHECK_THROWS_WITH(check_view(TensorView<double>{nullptr, Shape{3, 4}}, Shape{3, 4}, "Linear<4, 2>", "weights"),
                    Contains("Linear<4, 2>: weights of shape (3, 4) is a null pointer"));
  CHECK_NOTHROW(check_view(TensorView<double>{nullptr, Shape{0, 4}}, Shape{0, 4}, "empty", "input"));
}

TEST_CASE("HostBuffer: a large array freed and allocated again reuses its block, zeroed", "[cpu][core][tensor][memory]") {
  HostBlockCache& cache = HostBlockCache::instance();
  cache.trim();  // no block of this size left by another case in this process
  struct RestoreCapacity {
    ~RestoreCapacity() { HostBlockCache::instance().set_capacity(std::size_t(1) << 30); }
  } restore;
  const index_t count = index_t(HostBlockCache::smallest / sizeof(float)) * 3 + 5;  // large, not whole pages
  const std::size_t reused_before = cache.reused();
  const void* first = nullptr;
  {
    HostBuffer<float> a(count);
    first = a.data();
    for (float& x : a.span()) x = 3.5f;  // dirty it
  }
  HostBuffer<float> b(count);
  for (const float x : b.span()) REQUIRE(x == 0.0f);  // zeroed as a fresh array is
  if constexpr (!cupipe::detail::address_sanitizer && !cupipe::detail::thread_sanitizer) {
    // The same block served the second array (one more reuse), not a fresh mmap.
    CHECK(static_cast<const void*>(b.data()) == first);
    CHECK(cache.reused() == reused_before + 1);
  } else {
    CHECK(cache.reused() == reused_before);  // under the sanitizers nothing is cached
  }
  // A small array never waits in the cache; with no capacity nothing does.
  const std::size_t held = cache.held_bytes();
  { HostBuffer<float> small(16); }
  CHECK(cache.held_bytes() == held);
  cache.set_capacity(0);
  CHECK(cache.held_bytes() == 0);
  { HostBuffer<float> c(count); }
  CHECK(cache.held_bytes() == 0);
  // A count no address space holds is refused, as new[] refused it.
  CHECK_THROWS_WITH(HostBuffer<double>(index_t(1) << 61), Contains("larger than any address space"));
}

TEST_CASE("HostBlockCache: a full cache makes room by freeing the blocks freed longest ago", "[cpu][core][tensor][memory]") {
  HostBlockCache& cache = HostBlockCache::instance();
  cache.trim();
  struct RestoreCapacity {
    ~RestoreCapacity() { HostBlockCache::instance().set_capacity(std::size_t(1) << 30); }
  } restore;
  constexpr std::size_t block = HostBlockCache::smallest;  // whole pages
  const index_t one = index_t(block / sizeof(float)), two = 2 * one;
  cache.set_capacity(3 * block);
  const void* second = nullptr;
  {
    HostBuffer<float> a(one), b(one), c(two);
    second = b.data();
    // Freed in reverse order of declaration: c, b, then a (the oldest is c).
  }
  if constexpr (cupipe::detail::address_sanitizer || cupipe::detail::thread_sanitizer) {
    CHECK(cache.held_bytes() == 0);
    return;
  }
  // c (2 blocks) and b fill the cache; a made room by freeing c, the block freed longest ago.
  CHECK(cache.held_bytes() == 2 * block);
  const std::size_t reused = cache.reused();
  HostBuffer<float> big(two);  // c is gone: a fresh block
  CHECK(cache.reused() == reused);
  HostBuffer<float> x(one), y(one);  // b and a, the last freed first
  CHECK(cache.reused() == reused + 2);
  CHECK(static_cast<const void*>(y.data()) == second);
  CHECK(cache.held_bytes() == 0);
}

TEST_CASE("HostBuffer: zeroed, views of the right size, accounted", "[cpu][core][tensor][memory]") {
  MemoryTracker tracker;
  {
    HostBuffer<double> buffer(10, &tracker, MemoryTag::activations);
    CHECK(buffer.size() == 10);
    CHECK(buffer.bytes() == 80);
    for (double x : buffer.span()) CHECK(x == 0.0);
    CHECK(tracker.in_use(MemoryTag::activations) == 80);

    CHECK(buffer.view(Shape{2, 5}).data() == buffer.data());
    CHECK(buffer.view(Shape{3, 3}).shape() == Shape{3, 3});  // a prefix is fine
    CHECK_THROWS_AS(buffer.view(Shape{4, 5}), cupipe::error);
    CHECK_THROWS_WITH(buffer.view(Shape{4, 5}), Contains("buffer of 10 elements is too small for shape (4, 5)"));
    const HostBuffer<double>& read_only = buffer;
    CHECK_THROWS_WITH(read_only.view(Shape{11}), Contains("buffer of 10 elements is too small for shape (11,)"));

    // Moving transfers the accounting: released once, by the last owner.
    HostBuffer<double> moved = std::move(buffer);
    CHECK(moved.size() == 10);
    CHECK(buffer.size() == 0);
    CHECK(tracker.in_use(MemoryTag::activations) == 80);
    HostBuffer<double> assigned(4, &tracker, MemoryTag::weights);
    assigned = std::move(moved);
    CHECK(tracker.in_use(MemoryTag::weights) == 0);  // the old buffer of `assigned` was released
    CHECK(tracker.in_use(MemoryTag::activations) == 80);
  }
  CHECK(tracker.in_use() == 0);
  CHECK(tracker.peak(MemoryTag::activations) == 80);
  CHECK(tracker.peak(MemoryTag::weights) == 32);
  CHECK_THROWS_WITH(HostBuffer<float>(-1), Contains("negative buffer size -1"));
  CHECK(HostBuffer<float>(0).data() == nullptr);
}

TEST_CASE("all_finite", "[cpu][core][tensor]") {
  std::vector<float> v{1.0f, -2.0f, 0.0f};
  CHECK(all_finite<float>(v));
  v[1] = std::numeric_limits<float>::infinity();
  CHECK_FALSE(all_finite<float>(v));
  v[1] = std::numeric_limits<float>::quiet_NaN();
  CHECK_FALSE(all_finite<float>(v));
  CHECK(all_finite<float>({}));
}

// ---------------------------------------------------------------------------------------------
// MemoryTracker

TEST_CASE("MemoryTracker: in use and peak per tag and in total, exactly", "[cpu][core][memory]") {
  MemoryTracker t;
  t.allocate(MemoryTag::weights, 1000);     // weights 1000/1000             total 1000/1000
  t.allocate(MemoryTag::activations, 300);  // activations 300/300           total 1300/1300
  t.allocate(MemoryTag::activations, 500);  // activations 800/800           total 1800/1800
  t.release(MemoryTag::activations, 300);   // activations 500/800           total 1500/1800
  t.allocate(MemoryTag::workspace, 200);    // workspace 200/200             total 1700/1800
  t.allocate(MemoryTag::activations, 100);  // activations 600/800           total 1800/1800
  t.allocate(MemoryTag::gradients, 1000);   // gradients 1000/1000           total 2800/2800
  t.release(MemoryTag::workspace, 200);     // workspace 0/200               total 2600/2800

  CHECK(t.in_use(MemoryTag::weights) == 1000);
  CHECK(t.peak(MemoryTag::weights) == 1000);
  CHECK(t.in_use(MemoryTag::activations) == 600);
  CHECK(t.peak(MemoryTag::activations) == 800);
  CHECK(t.in_use(MemoryTag::workspace) == 0);
  CHECK(t.peak(MemoryTag::workspace) == 200);
  CHECK(t.in_use(MemoryTag::gradients) == 1000);
  CHECK(t.peak(MemoryTag::gradients) == 1000);
  CHECK(t.in_use(MemoryTag::optimizer) == 0);
  CHECK(t.peak(MemoryTag::optimizer) == 0);
  CHECK(t.in_use() == 2600);
  CHECK(t.peak() == 2800);

  t.reset_peaks();  // a new step: peaks restart from what is in use
  for (MemoryTag tag : {MemoryTag::weights, MemoryTag::gradients, MemoryTag::optimizer, MemoryTag::activations,
                        MemoryTag::workspace})
    CHECK(t.peak(tag) == t.in_use(tag));
  CHECK(t.peak() == 2600);
  t.allocate(MemoryTag::activations, 50);
  t.release(MemoryTag::activations, 650);
  CHECK(t.peak(MemoryTag::activations) == 650);
  CHECK(t.in_use(MemoryTag::activations) == 0);
  CHECK(t.peak() == 2650);
  CHECK(t.in_use() == 2000);

  CHECK(name(MemoryTag::weights) == "weights");
  CHECK(name(MemoryTag::activations) == "activations");
  CHECK(name(MemoryTag::workspace) == "workspace");
}

TEST_CASE("MemoryTracker is exact under concurrent use", "[cpu][core][memory]") {
  MemoryTracker t;
  constexpr int threads = 4, rounds = 20000;
  std::vector<std::thread> workers;
  for (int w = 0; w < threads; ++w)
    workers.emplace_back([&] {
      for (int i = 0; i < rounds; ++i) {
        t.allocate(MemoryTag::activations, 8);
        t.release(MemoryTag::activations, 8);
      }
    });
  for (auto& w : workers) w.join();
  CHECK(t.in_use(MemoryTag::activations) == 0);
  CHECK(t.in_use() == 0);
  CHECK(t.peak(MemoryTag::activations) >= 8);
  CHECK(t.peak(MemoryTag::activations) <= 8 * threads);
}

// ---------------------------------------------------------------------------------------------
// dtype

TEST_CASE("dtypes: sizes, safetensors names, bfloat16 rounding", "[cpu][core][dtype]") {
  CHECK(size_of(DType::f32) == 4);
  CHECK(size_of(DType::bf16) == 2);
  CHECK(size_of(DType::i64) == 8);
  CHECK(size_of(DType::u8) == 1);
  CHECK(name(DType::bf16) == "BF16");
  DType parsed{};
  CHECK(parse_dtype("F64", parsed));
  CHECK(parsed == DType::f64);
  CHECK_FALSE(parse_dtype("F8_E4M3", parsed));
  CHECK(dtype_v<float> == DType::f32);

  CHECK(bfloat16(1.0f).bits == 0x3f80);
  CHECK(bfloat16(-2.0f).bits == 0xc000);
  CHECK(bfloat16(1.0f + 0x1p-8f).bits == 0x3f80);      // tie: rounds to even (down)
  CHECK(bfloat16(1.0f + 3 * 0x1p-8f).bits == 0x3f82);  // tie: rounds to even (up)
  CHECK(bfloat16(1.0f + 0x1p-8f + 0x1p-12f).bits == 0x3f81);  // above the tie: up
  CHECK(float(bfloat16(3.140625f)) == 3.140625f);              // representable: exact
  CHECK(std::isnan(float(bfloat16(std::numeric_limits<float>::quiet_NaN()))));
  CHECK(std::isinf(float(bfloat16(std::numeric_limits<float>::infinity()))));
  CHECK(std::string(version_string) == std::to_string(CUPIPE_VERSION_MAJOR) + "." +
                                           std::to_string(CUPIPE_VERSION_MINOR) + "." +
                                           std::to_string(CUPIPE_VERSION_PATCH));
}

// ---------------------------------------------------------------------------------------------
// Rng

namespace {

// An independent transcription of the reference generators (Vigna, prng.di.unimi.it):
// splitmix64 for seeding, xoshiro256** for the stream.
struct ReferenceXoshiro {
  std::uint64_t s[4];

  static std::uint64_t splitmix64(std::uint64_t& x) {
    std::uint64_t z = (x += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  }
  static std::uint64_t rotl(std::uint64_t x, int k) { return (x << k) | (x >> (64 - k)); }

  explicit ReferenceXoshiro(std::uint64_t seed) {
    std::uint64_t x = seed;
    for (auto& w : s) w = splitmix64(x);
  }
  std::uint64_t next() {
    const std::uint64_t result = rotl(s[1] * 5, 7) * 9;
    const std::uint64_t t = s[1] << 17;
    s[2] ^= s[0];
    s[3] ^= s[1];
    s[1] ^= s[2];
    s[0] ^= s[3];
    s[2] ^= t;
    s[3] = rotl(s[3], 45);
    return result;
  }
};

}  // namespace

TEST_CASE("Rng is xoshiro256** seeded by splitmix64, bit for bit", "[cpu][core][rng]") {
  // splitmix64 from 0: the first outputs published with the reference code.
  const Rng zero(0);
  CHECK(zero.state() == Rng::state_type{0xe220a8397b1dcdafull, 0x6e789e6aa1b965f4ull, 0x06c45d188009454full,
                                        0xf88bb8a8724c81ecull});
  for (std::uint64_t seed : {0ull, 1ull, 42ull, 0xdeadbeefull, ~0ull}) {
    CAPTURE(seed);
    Rng rng(seed);
    ReferenceXoshiro ref(seed);
    bool all_equal = true;
    for (int i = 0; i < 1000; ++i) all_equal &= rng.next_u64() == ref.next();
    CHECK(all_equal);
  }
}

TEST_CASE("Rng is reproducible and restartable", "[cpu][core][rng]") {
  Rng a(1234), b(1234), c(1235);
  std::vector<std::uint64_t> first, second, other;
  for (int i = 0; i < 100; ++i) {
    first.push_back(a.next_u64());
    second.push_back(b.next_u64());
    other.push_back(c.next_u64());
  }
  CHECK(first == second);
  CHECK(first != other);

  // Save, draw, restore: the stream continues identically, through every kind of draw.
  for (int i = 0; i < 17; ++i) a.normal();
  const Rng::state_type saved = a.state();
  std::vector<double> draws;
  for (int i = 0; i < 50; ++i) draws.push_back(a.uniform() + a.normal() + double(a.below(1000)));
  Rng restored(999);
  restored.set_state(saved);
  std::vector<double> again;
  for (int i = 0; i < 50; ++i) again.push_back(restored.uniform() + restored.normal() + double(restored.below(1000)));
  CHECK(draws == again);

  Rng reseeded(5);
  reseeded.next_u64();
  reseeded.reseed(1234);
  CHECK(reseeded.next_u64() == first[0]);
}

TEST_CASE("Rng::derive gives distinct, reproducible streams", "[cpu][core][rng]") {
  std::set<std::uint64_t> firsts;
  for (std::uint64_t stream = 0; stream < 64; ++stream) {
    Rng d = Rng::derive(7, stream);
    Rng again = Rng::derive(7, stream);
    CHECK(d.state() == again.state());
    firsts.insert(d.next_u64());
  }
  CHECK(firsts.size() == 64);
  CHECK(Rng::derive(7, 0).state() != Rng(7).state());
  CHECK(Rng::derive(7, 3).state() != Rng::derive(8, 3).state());
  // Independent of the parent's position: derive is a function of (seed, stream) alone.
  Rng parent(7);
  for (int i = 0; i < 10; ++i) parent.next_u64();
  CHECK(Rng::derive(7, 5).state() == Rng::derive(7, 5).state());
}

TEST_CASE("Rng distributions: ranges, unbiased below(), normal moments", "[cpu][core][rng]") {
  Rng rng(2024);
  constexpr int n = 200000;

  SECTION("uniform") {
    double lo = 1, hi = 0, sum = 0;
    for (int i = 0; i < n; ++i) {
      const double u = rng.uniform();
      lo = std::min(lo, u);
      hi = std::max(hi, u);
      sum += u;
    }
    CHECK(lo >= 0.0);
    CHECK(hi < 1.0);
    CHECK(lo < 1e-4);
    CHECK(hi > 1 - 1e-4);
    CHECK(std::abs(sum / n - 0.5) < 5 * std::sqrt(1.0 / 12 / n));
    for (int i = 0; i < 10000; ++i) {
      const double u = rng.uniform(-3.0, -2.5);
      REQUIRE(u >= -3.0);
      REQUIRE(u < -2.5);
    }
  }
  SECTION("below: in range, flat (chi-square), and without modulo bias for huge n") {
    constexpr std::uint64_t buckets = 7;
    std::array<int, buckets> counts{};
    for (int i = 0; i < 70000; ++i) {
      const auto k = rng.below(buckets);
      REQUIRE(k < buckets);
      ++counts[k];
    }
    double chi2 = 0;
    for (int c : counts) chi2 += (c - 10000.0) * (c - 10000.0) / 10000.0;
    CHECK(chi2 < 27.9);  // chi-square, 6 degrees of freedom, p = 1e-4

    // n = 3 * 2^62: a plain `r % n` would put half the draws below 2^62 instead of a third.
    const std::uint64_t huge = 3ull << 62;
    int low = 0;
    for (int i = 0; i < 20000; ++i) {
      const auto k = rng.below(huge);
      REQUIRE(k < huge);
      low += k < (1ull << 62);
    }
    CHECK(std::abs(low / 20000.0 - 1.0 / 3) < 0.02);
    CHECK(rng.below(1) == 0);
    CHECK(rng.below(0) == 0);
  }
  SECTION("normal: mean 0, variance 1, 68% within one sigma, finite") {
    double sum = 0, sum_sq = 0;
    int within = 0;
    for (int i = 0; i < n; ++i) {
      const double x = rng.normal();
      REQUIRE(std::isfinite(x));
      sum += x;
      sum_sq += x * x;
      within += std::abs(x) < 1;
    }
    const double mean = sum / n, var = sum_sq / n - mean * mean;
    CHECK(std::abs(mean) < 5 / std::sqrt(double(n)));
    CHECK(std::abs(var - 1) < 5 * std::sqrt(2.0 / n));
    CHECK(std::abs(within / double(n) - 0.682689) < 0.005);
  }
}

TEST_CASE("Topology maps every rank to one (stage, replica, t) in either order, t innermost", "[cpu][core][topology]") {
  const int stages = 2, replicas = 3, tensor = 2, world = stages * replicas * tensor;
  for (const comm::RankOrder order : {comm::RankOrder::stages_outermost, comm::RankOrder::replicas_outermost}) {
    CAPTURE(comm::rank_order_name(order));
    std::set<std::array<int, 3>> seen;
    for (int r = 0; r < world; ++r) {
      const comm::Topology t = comm::Topology::make(world, r, stages, tensor, order);
      CHECK(t.replicas == replicas);
      CHECK(t.tensor_rank() == r % tensor);  // a tensor-parallel group is consecutive ranks
      CHECK(t.rank_of(t.stage(), t.replica(), t.tensor_rank()) == r);
      seen.insert({t.stage(), t.replica(), t.tensor_rank()});
      if (order == comm::RankOrder::stages_outermost) {
        CHECK(t.stage() == r / (tensor * replicas));  // stage 0 holds the first replicas x tensor ranks
      } else {
        CHECK(t.replica() == r / (tensor * stages));  // replica 0's pipeline is the first ranks
      }
    }
    CHECK(seen.size() == std::size_t(world));
  }
  const comm::Topology t = comm::Topology::make(4, 1, 2, 1);
  CHECK(t.describe().find("rank = stage * 2 + replica: rank 0 -> (stage 0, replica 0), rank 1 -> (stage 0, replica 1)") !=
        std::string::npos);
  CHECK(comm::parse_rank_order("replicas-outermost") == comm::RankOrder::replicas_outermost);
  CHECK_THROWS_WITH(comm::parse_rank_order("pp-first"), Contains("rank order 'pp-first'") && Contains("stages-outermost"));
  CHECK_THROWS_WITH(comm::Topology::make(6, 0, 4), Contains("cannot hold 4 pipeline stages"));
}

TEST_CASE("Topology: a context-parallel ring is consecutive replicas of one stage", "[cpu][core][topology][cp]") {
  // 2 stages x 2 data-parallel replicas x rings of 3: a stage's 6 replicas are 2 rings.
  for (int r = 0; r < 12; ++r) {
    const comm::Topology t = comm::Topology::make(12, r, 2, 1, comm::RankOrder::stages_outermost, 3);
    CHECK(t.replicas == 6);
    CHECK(t.context_rank() == t.replica() % 3);
    CHECK(t.data_replica() == t.replica() / 3);
    CHECK(t.stage() == r / 6);
  }
  const comm::Topology t = comm::Topology::make(8, 0, 2, 1, comm::RankOrder::stages_outermost, 2);
  CHECK(t.describe().find("world 8 = 2 stage(s) x 2 data-parallel replica(s) x 2 context-parallel rank(s)") != std::string::npos);
  CHECK_THROWS_WITH(comm::Topology::make(6, 0, 2, 1, comm::RankOrder::stages_outermost, 2),
                    Contains("a stage's 3 replica(s) cannot form rings of 2 context-parallel ranks"));
}

TEST_CASE("cpus: shares deal the CPUs in order, sizes differing by at most one", "[core][cpus]") {
  using V = std::vector<std::vector<int>>;
  CHECK(core::cpus::shares({0, 1, 2, 3, 4}, 2) == V{{0, 1}, {2, 3, 4}});
  CHECK(core::cpus::shares({4, 7}, 2) == V{{4}, {7}});
  CHECK(core::cpus::shares({0, 1, 2}, 1) == V{{0, 1, 2}});
  CHECK(core::cpus::shares({0}, 2).empty());  // fewer CPUs than shares
  CHECK(core::cpus::shares({0, 1}, 0).empty());
}

TEST_CASE("cpus: a thread bound to one CPU widens to the machine, then takes its share", "[core][cpus]") {
  const std::vector<int> cpus = core::cpus::allowed();
  REQUIRE(!cpus.empty());  // Linux says
  std::vector<int> bound, widened, second;
  std::thread([&] {
    if (!core::cpus::pin(pthread_self(), {cpus.back()})) return;
    bound = core::cpus::allowed();
    widened = core::cpus::widen_to_machine();
    (void)core::cpus::pin(pthread_self(), {cpus.back()});
    second = core::cpus::spread_over_machine(1, 2);
    if (second != core::cpus::allowed()) second = {-1};  // what it says is what the OS has
  }).join();
  if (bound.empty()) {
    WARN("the OS refused to bind a thread: nothing to check");
    return;
  }
  CHECK(bound == std::vector<int>{cpus.back()});
  CHECK(widened.size() >= cpus.size());  // this process's CPUs, at least: none were lost
  for (const int c : cpus) CHECK(std::find(widened.begin(), widened.end(), c) != widened.end());
  if (widened.size() >= 2) CHECK(second == core::cpus::shares(widened, 2)[1]);
  else CHECK(second == widened);  // one CPU: the thread runs on it
}
