// SPDX-License-Identifier: Apache-2.0
// ZeRO-1 (PipelineOptions::zero) in one process: how the shards cut a stage's parameters, that
// without replicas it changes nothing (bitwise), and its refusals. The sharded runs themselves need
// replicas, hence processes: tests/comm/mpi_pipeline_check --zero under mpirun.
#include "pipeline_test_support.hpp"

#include <string>
#include <vector>

namespace {

using namespace cupipe;
using test::Host;

using Model = Sequential<Linear<6, 8>, ReLU, Linear<8, 8>, ReLU, Linear<8, 8>, ReLU, Linear<8, 4>>;

}  // namespace

TEST_CASE("ZeRO-1 shards lie back to back, cover every parameter once, at most ceil(n / R) each", "[pipeline][zero]") {
  for (const index_t params : {index_t(1), index_t(5), index_t(10), index_t(97), index_t(4096)})
    for (const int replicas : {1, 2, 3, 4, 7}) {
      INFO(params << " parameters over " << replicas << " replicas");
      index_t next = 0;
      for (int r = 0; r < replicas; ++r) {
        const pipeline::Shard s = pipeline::Shard::of(params, replicas, r);
        CHECK(s.begin == next);
        CHECK(s.size() >= 0);
        CHECK(s.size() <= (params + replicas - 1) / replicas);
        CHECK(s.stride * replicas >= params);
        CHECK(s.sharded() == (replicas > 1));
        next = s.end;
      }
      CHECK(next == params);
    }
  // 5 over 4: strides of 2, so the last replica holds nothing (and updates nothing).
  CHECK(pipeline::Shard::of(5, 4, 3).size() == 0);
  CHECK(pipeline::Shard::of(5, 4, 2).begin == 4);
}

TEST_CASE("ZeRO-1 without replicas changes nothing: weights and AdamW state bitwise", "[pipeline][zero]") {
  using Pipe = Pipeline<partition<Model, 2>, schedule::OneFOneB, Host>;
  Pipe plain({.microbatches = 4, .seed = 7}), zero({.microbatches = 4, .seed = 7, .zero = true});
  const optim::AdamW adamw({.lr = 1e-2, .weight_decay = 0.1, .clip_norm = 0.5});
  for (int t = 0; t < 3; ++t) {
    const test::Batch b = test::make_batch(16, 6, 4, 900 + std::uint64_t(t));
    plain.train_step(b.inputs(), b.targets(), adamw);
    zero.train_step(b.inputs(), b.targets(), adamw);
  }
  CHECK(zero.parameters() == plain.parameters());
  CHECK(zero.optimizer_state(0) == plain.optimizer_state(0));
  CHECK(zero.optimizer_state(1) == plain.optimizer_state(1));
}

TEST_CASE("ZeRO-1 is refused with a sentence where it cannot work", "[pipeline][zero]") {
  CHECK_THAT(test::error_message([] {
               Pipeline<partition<Model, 2>, schedule::PipeDream, Host> pipe({.microbatches = 2, .zero = true});
             }),
             Catch::Contains("zero shards the optimizer state of a flush update") &&
                 Catch::Contains("pipedream updates each stage inside the step"));
  CHECK_THAT(test::error_message([] {
               Pipeline<partition<Model, 2>, schedule::OneFOneB, Host> pipe(
                   {.microbatches = 2, .post_validation = true, .zero = true});
             }),
             Catch::Contains("zero and post_validation cannot be combined"));
}

TEST_CASE("ZeRO-2 without replicas changes nothing either, and other stages are refused", "[pipeline][zero]") {
  using Pipe = Pipeline<partition<Model, 2>, schedule::ZeroBubbleH1, Host>;
  Pipe plain({.microbatches = 4, .seed = 7}), zero({.microbatches = 4, .seed = 7, .zero = 2});
  const optim::AdamW adamw({.lr = 1e-2, .weight_decay = 0.1, .clip_norm = 0.5});
  for (int t = 0; t < 3; ++t) {
    const test::Batch b = test::make_batch(16, 6, 4, 700 + std::uint64_t(t));
    plain.train_step(b.inputs(), b.targets(), adamw);
    zero.train_step(b.inputs(), b.targets(), adamw);
  }
  CHECK(zero.parameters() == plain.parameters());
  CHECK(zero.optimizer_state(1) == plain.optimizer_state(1));
  CHECK(zero.backend(0).memory.in_use(MemoryTag::gradients) == plain.backend(0).memory.in_use(MemoryTag::gradients));
  for (const int stage : {-1, 3, 4})
    CHECK_THAT(test::error_message([stage] {
                 Pipeline<partition<Model, 2>, schedule::OneFOneB, Host> pipe({.microbatches = 2, .zero = stage});
               }),
               Catch::Contains("zero is the ZeRO stage, 0 (off), 1 (optimizer state) or 2 (and gradients), got " +
                               std::to_string(stage)));
  CHECK_THAT(test::error_message([] { Pipeline<partition<Model, 2>, schedule::OneFOneB, Host> pipe({.microbatches = 2, .zero = 3}); }),
             Catch::Contains("ZeRO-3, parameters sharded too, is not built yet"));
}

TEST_CASE("ZeRO-2 finds the stages that hold a copy of a tied tensor", "[pipeline][zero]") {
  const TiedCopies tied{.first = 10, .second = 90, .count = 5};
  CHECK(pipeline::holds_tied_copy(tied, 0, 11));
  CHECK_FALSE(pipeline::holds_tied_copy(tied, 0, 10));
  CHECK(pipeline::holds_tied_copy(tied, 14, 20));
  CHECK_FALSE(pipeline::holds_tied_copy(tied, 15, 75));
  CHECK(pipeline::holds_tied_copy(tied, 94, 6));
  CHECK_FALSE(pipeline::holds_tied_copy(tied, 95, 6));
  CHECK_FALSE(pipeline::holds_tied_copy(TiedCopies{}, 0, 100));
}
