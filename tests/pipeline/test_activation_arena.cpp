// SPDX-License-Identifier: Apache-2.0
// The planned arena (pipeline/activation_arena.hpp): its layout against the lifetimes it is given,
// the stage's table of microbatches in flight, a pipeline with the arena against the same pipeline
// on the pool (bitwise: the arithmetic is the same, only the addresses differ), and the heap
// allocations of a steady step, counted by this program's operator new (tests/support/heap_count.hpp);
// activation offload (PipelineOptions::offload) against records kept resident.
#include "pipeline_test_support.hpp"

#include <algorithm>
#include <cstring>
#include <limits>
#include <random>

#include "cupipe/pipeline/activation_arena.hpp"
#include "cupipe/pipeline/in_flight_table.hpp"
#include "heap_count.hpp"

namespace {

using namespace cupipe;
using pipeline::ArenaRequest;
using test::Batch;
using test::Entry;
using test::Host;

/// Every pair of requests live at the same time lies apart; offsets aligned; the block holds all.
void check_layout(const std::vector<ArenaRequest>& requests, index_t alignment) {
  const pipeline::ArenaLayout layout = pipeline::lay_out_arena(requests, alignment);
  REQUIRE(layout.offsets.size() == requests.size());
  for (std::size_t i = 0; i < requests.size(); ++i) {
    CHECK(layout.offsets[i] % alignment == 0);
    CHECK(layout.offsets[i] + requests[i].elements <= layout.elements);
    for (std::size_t k = i + 1; k < requests.size(); ++k) {
      if (!requests[i].overlaps(requests[k]) || requests[i].elements == 0 || requests[k].elements == 0) continue;
      const bool apart = layout.offsets[i] + requests[i].elements <= layout.offsets[k] ||
                         layout.offsets[k] + requests[k].elements <= layout.offsets[i];
      CHECK(apart);
    }
  }
  CHECK(layout.elements >= pipeline::peak_live(requests, alignment));
}

}  // namespace

TEST_CASE("the arena's layout keeps buffers live at the same time apart", "[pipeline][arena]") {
  std::mt19937 rng(7);
  for (int trial = 0; trial < 300; ++trial) {
    std::vector<ArenaRequest> requests(std::size_t(1 + rng() % 40));
    for (ArenaRequest& r : requests) {
      r.elements = index_t(rng() % 300);
      r.first = int(rng() % 30);
      r.last = r.first + int(rng() % 10);
    }
    check_layout(requests, index_t(1 + rng() % 64));
  }
}

TEST_CASE("the arena reuses the memory of buffers whose lives do not meet", "[pipeline][arena]") {
  // 1F1B's first stage with two microbatches in flight: records of 100 kept from F to B, a gradient
  // record of 40 during each B. Live at once at most: two records, or one record and one gradient record.
  const std::vector<ArenaRequest> requests{{100, 0, 2}, {100, 1, 4}, {40, 2, 2}, {100, 3, 6}, {40, 4, 4}, {40, 6, 6}};
  const pipeline::ArenaLayout layout = pipeline::lay_out_arena(requests, 1);
  CHECK(layout.elements == 240);  // two records and a gradient record, where six buffers would take 420
  CHECK(pipeline::peak_live(requests, 1) == 240);
  CHECK(layout.offsets[3] == layout.offsets[0]);  // the third record takes the first one's place
  check_layout(requests, 1);
  CHECK(pipeline::lay_out_arena(requests, 64).elements == 2 * 128 + 64);  // rounded: 128 a record, 64 a gradient record
  CHECK_THROWS_WITH(pipeline::lay_out_arena(std::vector<ArenaRequest>{{4, 3, 2}}, 1),
                    Catch::Contains("request 0 of 4 values from action 3 to 2 is not a buffer's lifetime"));
}

TEST_CASE("a stage's arena hands out its regions, and the pool for what it did not lay out", "[pipeline][arena]") {
  Host be;
  pipeline::ActivationArena<Host> arena;
  using pipeline::ArenaRole;
  const std::vector<pipeline::ArenaUse> uses{{0, ArenaRole::record, {10, 0, 3}}, {1, ArenaRole::record, {10, 1, 4}},
                                             {0, ArenaRole::dx, {6, 3, 3}}};
  arena.lay_out(be, 2, uses);
  CHECK(arena.planned_elements() == 3 * pipeline::ActivationArena<Host>::alignment);
  CHECK(arena.block_elements() >= arena.planned_elements());
  CHECK(be.memory.in_use(MemoryTag::activations) == 0);  // the block is reserved; regions count while taken
  be.memory.reset_peaks();  // as a step does after laying out

  std::int64_t in_use = 0;
  {
    auto r1 = arena.take(be, 1, ArenaRole::record, 10);
    auto dx = arena.take(be, 0, ArenaRole::dx, 6);
    CHECK((r1.planned() && dx.planned()));
    CHECK(be.memory.in_use(MemoryTag::activations) == 16 * std::int64_t(sizeof(double)));
    auto moved = std::move(dx);
    CHECK(be.memory.in_use(MemoryTag::activations) == 16 * std::int64_t(sizeof(double)));
  }
  CHECK(be.memory.in_use(MemoryTag::activations) == 0);
  CHECK(be.memory.peak(MemoryTag::activations) == 16 * std::int64_t(sizeof(double)));
  auto r0 = arena.take(be, 0, ArenaRole::record, 10);
  auto r1 = arena.take(be, 1, ArenaRole::record, 10);
  CHECK(r0.data() != r1.data());
  in_use = be.memory.in_use(MemoryTag::activations);

  // Not laid out: another size, another role, another microbatch.
  auto other_size = arena.take(be, 0, ArenaRole::record, 11);
  auto other_role = arena.take(be, 0, ArenaRole::grad_record, 10);
  auto other_microbatch = arena.take(be, 5, ArenaRole::record, 10);
  CHECK((!other_size.planned() && !other_role.planned() && !other_microbatch.planned()));
  CHECK(be.memory.in_use(MemoryTag::activations) == in_use + std::int64_t((11 + 10 + 10) * sizeof(double)));

  // Under the host backend's poison a region is 0xFF bytes again when taken, as a new buffer is.
  const bool poison = backend::host_poison();
  backend::set_host_poison(true);
  r0.data()[3] = 1.0;
  auto again = arena.take(be, 0, ArenaRole::record, 10);
  CHECK(again.data() == r0.data());
  CHECK(std::isnan(again.data()[3]));
  backend::set_host_poison(poison);

  // A larger layout grows the block; a smaller one keeps it.
  arena.lay_out(be, 1, std::vector<pipeline::ArenaUse>{{0, ArenaRole::record, {1000, 0, 0}}});
  CHECK(arena.block_elements() >= 1000);
  const index_t grown = arena.block_elements();
  arena.lay_out(be, 1, std::vector<pipeline::ArenaUse>{{0, ArenaRole::record, {10, 0, 0}}});
  CHECK(arena.block_elements() == grown);
}

TEST_CASE("the in-flight table holds a microbatch once, from forward to done", "[pipeline][arena]") {
  pipeline::InFlightTable<std::vector<int>> table;
  CHECK(table.find(3) == nullptr);
  table.emplace(3, std::vector<int>{1, 2});
  table.emplace(0, std::vector<int>{4});
  REQUIRE(table.find(3) != nullptr);
  CHECK(*table.find(3) == std::vector<int>{1, 2});
  CHECK(table.size() == 2);
  CHECK_THROWS_WITH(table.emplace(3, {}), Catch::Contains("a second forward of microbatch 3 before its backward"));
  table.erase(3);
  CHECK(table.find(3) == nullptr);
  CHECK(table.size() == 1);
  table.clear();
  CHECK(table.empty());
  CHECK(table.find(-1) == nullptr);
  // A new id taken in leaves the others where they are (an overlapped pair's B holds its own while
  // its F takes one in: paired_turns.hpp).
  const std::vector<int>* held = &table.emplace(1, std::vector<int>{7});
  for (int j = 2; j < 200; ++j) table.emplace(j, {});
  CHECK(table.find(1) == held);
}

namespace {

using Head = Stage<Entry<4>, Linear<4, 8>, ReLU>;
using Four = StageList<Head, Stage<Linear<8, 8>, ReLU>, Stage<Linear<8, 8>, ReLU>, Stage<Linear<8, 4>>>;

/// Three AdamW steps of `Schedule` with options `a` and `b` from the same start: equal losses,
/// norms and weights, bitwise.
template <class Schedule>
void check_same_training(const PipelineOptions& a, const PipelineOptions& b, index_t rows) {
  Pipeline<Four, Schedule, Host> first(a), second(b);
  const optim::AdamW adamw({.lr = 1e-2});
  for (int step = 0; step < 3; ++step) {
    const Batch batch = test::make_batch(rows, 4, 4, 60 + std::uint64_t(step));
    const StepStats x = test::bounded(30, [&] { return first.train_step(batch.inputs(), batch.targets(), adamw); });
    const StepStats y = test::bounded(30, [&] { return second.train_step(batch.inputs(), batch.targets(), adamw); });
    CHECK(x.loss == y.loss);
    CHECK(x.grad_norm == y.grad_norm);
    CHECK(std::isfinite(x.loss));
  }
  CHECK(first.parameters() == second.parameters());
}

/// The arena against the pool.
template <class Schedule>
void check_arena_equals_pool(int microbatches, index_t rows, std::vector<int> recompute = {}) {
  INFO(Schedule::name << ", " << microbatches << " microbatches of " << rows << " rows, recompute " << recompute.size());
  PipelineOptions options;
  options.microbatches = microbatches;
  options.seed = 3;
  options.recompute = std::move(recompute);
  PipelineOptions pool_options = options;
  pool_options.planned_arena = false;
  check_same_training<Schedule>(options, pool_options, rows);
}

}  // namespace

TEST_CASE("a pipeline on its arenas equals the same pipeline on the pool, bitwise", "[pipeline][arena]") {
  check_arena_equals_pool<schedule::OneFOneB>(4, 16);
  check_arena_equals_pool<schedule::GPipe>(4, 14);              // ragged: 4, 4, 3, 3 rows
  check_arena_equals_pool<schedule::ZeroBubbleH1>(6, 12);       // split backward: buffers kept until W
  check_arena_equals_pool<schedule::OneFOneB>(4, 16, {1, 2});   // recomputation
  check_arena_equals_pool<schedule::DualPipeV>(4, 16);          // overlapped F&B pairs, two chunks a worker
  check_arena_equals_pool<schedule::Interleaved<2>>(4, 16, {3});
}

namespace {

/// The fewest heap allocations of one of 6 steps after 4 warm-up steps, every thread's together.
/// The fewest: a thread that runs further ahead than ever before may grow a queue once, and that is
/// not a cost every step pays.
std::uint64_t steady_step_allocations(int microbatches, bool arena) {
  PipelineOptions options;
  options.microbatches = microbatches;
  options.planned_arena = arena;
  Pipeline<Four, schedule::OneFOneB, Host> pipe(options);
  const optim::SGD sgd({.lr = 0.01});
  const Batch b = test::make_batch(2 * microbatches, 4, 4, 11);
  for (int step = 0; step < 4; ++step) test::bounded(30, [&] { return pipe.train_step(b.inputs(), b.targets(), sgd); });
  std::uint64_t fewest = std::numeric_limits<std::uint64_t>::max();
  for (int step = 0; step < 6; ++step) {
    const std::uint64_t before = test::heap_allocation_count.load();
    test::bounded(30, [&] { return pipe.train_step(b.inputs(), b.targets(), sgd); });
    fewest = std::min(fewest, test::heap_allocation_count.load() - before);
  }
  // Between steps nothing counts as activations: not the arenas' blocks, not the spare messages.
  for (int w = 0; w < 4; ++w) CHECK(pipe.backend(w).memory.in_use(MemoryTag::activations) == 0);
  return fewest;
}

}  // namespace

TEST_CASE("a steady step allocates nothing per action: as many allocations for 16 microbatches as for 4",
          "[pipeline][arena]") {
  const std::uint64_t four = steady_step_allocations(4, true), sixteen = steady_step_allocations(16, true);
  INFO("with the arena: " << four << " allocations a step at m = 4, " << sixteen << " at m = 16");
  CHECK(sixteen == four);
  // The count sees per-action allocations: on the pool, 4 x the actions allocate more.
  const std::uint64_t four_pool = steady_step_allocations(4, false), sixteen_pool = steady_step_allocations(16, false);
  INFO("on the pool: " << four_pool << " at m = 4, " << sixteen_pool << " at m = 16");
  CHECK(sixteen_pool > four_pool + 2 * 4 * 12);  // at least a record and a gradient record per stage and microbatch
}

namespace {

/// Offloading every stage's records but one per stage, against keeping them. (Their peaks depend on
/// when messages arrive; the GPipe case below bounds them.)
template <class Schedule>
void check_offload_equals_resident(int microbatches, index_t rows, bool arena = true) {
  INFO(Schedule::name << ", " << microbatches << " microbatches of " << rows << " rows, arena " << arena);
  PipelineOptions options;
  options.microbatches = microbatches;
  options.seed = 4;
  options.planned_arena = arena;
  PipelineOptions offload_options = options;
  offload_options.offload = {0, 1, 2, 3};
  offload_options.offload_resident = 1;
  check_same_training<Schedule>(offload_options, options, rows);
}

}  // namespace

TEST_CASE("offloaded records come back bitwise: the same training as records kept resident", "[pipeline][offload]") {
  check_offload_equals_resident<schedule::OneFOneB>(8, 16);
  check_offload_equals_resident<schedule::GPipe>(6, 15);  // ragged
  check_offload_equals_resident<schedule::GPipe>(6, 12, false);  // on the pool
  check_offload_equals_resident<schedule::ZeroBubbleH1>(6, 12);
  check_offload_equals_resident<schedule::DualPipeV>(8, 16);
  check_offload_equals_resident<schedule::Interleaved<2>>(4, 16);
}

TEST_CASE("offload lowers the measured activation peak of GPipe's first stage as planned", "[pipeline][offload]") {
  // GPipe holds all 8 records on every stage; offloading, a stage holds its cap and one more.
  PipelineOptions options;
  options.microbatches = 8;
  PipelineOptions offload_options = options;
  offload_options.offload = {0};
  offload_options.offload_resident = 2;
  Pipeline<Four, schedule::GPipe, Host> offloading(offload_options), resident(options);
  const schedule::OffloadPlan plan = schedule::plan_offload(offloading.plan(), offload_options.offload, 2);
  CHECK(plan.peak_resident[0] == 3);
  CHECK(schedule::peak_activations(offloading.plan())[0] == 8);
  const Batch b = test::make_batch(64, 4, 4, 5);
  const optim::SGD sgd({.lr = 0.01});
  const StepStats o = test::bounded(30, [&] { return offloading.train_step(b.inputs(), b.targets(), sgd); });
  const StepStats r = test::bounded(30, [&] { return resident.train_step(b.inputs(), b.targets(), sgd); });
  // Stage 0 keeps each microbatch's record (8 rows); besides records it holds at most one gradient
  // record and the 8 incoming gradients (8 x 8 values each, however they arrive).
  using S0 = Four::stage<0>;
  const auto bytes = [](index_t values) { return std::int64_t(values) * std::int64_t(sizeof(double)); };
  const std::int64_t record = bytes(S0::record_elements(8));
  const std::int64_t others = bytes(S0::grad_record_elements(8)) + 8 * bytes(8 * S0::out_features);
  INFO("stage 0 peak: offloading " << o.peak_activation_bytes[0] << " bytes, resident " << r.peak_activation_bytes[0]
                                   << ", a record " << record << " bytes");
  CHECK(r.peak_activation_bytes[0] >= 8 * record);
  CHECK(o.peak_activation_bytes[0] <= 3 * record + others);
  CHECK(o.peak_activation_bytes[0] >= 3 * record);
  CHECK(o.loss == r.loss);
}

TEST_CASE("offload options are checked: a stage out of range, with recompute, a cap below 1", "[pipeline][offload]") {
  PipelineOptions options;
  options.microbatches = 4;
  options.offload = {4};
  CHECK_THROWS_WITH((Pipeline<Four, schedule::OneFOneB, Host>(options)),
                    Catch::Contains("offload names stage 4 but there are 4 (virtual) stages"));
  options.offload = {1};
  options.recompute = {1};
  CHECK_THROWS_WITH((Pipeline<Four, schedule::OneFOneB, Host>(options)),
                    Catch::Contains("stage 1 both recomputes and offloads its records"));
  options.recompute = {};
  options.offload_resident = 0;
  CHECK_THROWS_WITH((Pipeline<Four, schedule::OneFOneB, Host>(options)),
                    Catch::Contains("offload_resident must be at least 1 record per stage, got 0"));
}
