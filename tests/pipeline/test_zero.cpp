// SPDX-License-Identifier: Apache-2.0
// ZeRO (PipelineOptions::zero) in one process: how the shards cut a stage's parameters, that
// without replicas it changes nothing (bitwise), its refusals, and ZeRO-3's released weights. The
// sharded runs themselves need replicas, hence processes: tests/comm/mpi_pipeline_check --zero[=2|=3]
// under mpirun.
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

TEST_CASE("ZeRO-2 and ZeRO-3 without replicas change nothing either, and other stages are refused", "[pipeline][zero]") {
  using Pipe = Pipeline<partition<Model, 2>, schedule::ZeroBubbleH1, Host>;
  for (const int stage : {2, 3}) {
    INFO("ZeRO-" << stage);
    Pipe plain({.microbatches = 4, .seed = 7}), zero({.microbatches = 4, .seed = 7, .zero = stage});
    const optim::AdamW adamw({.lr = 1e-2, .weight_decay = 0.1, .clip_norm = 0.5});
    for (int t = 0; t < 3; ++t) {
      const test::Batch b = test::make_batch(16, 6, 4, 700 + std::uint64_t(t));
      plain.train_step(b.inputs(), b.targets(), adamw);
      CHECK(zero.train_step(b.inputs(), b.targets(), adamw).parameter_gathers == 0);
    }
    CHECK(zero.parameters() == plain.parameters());
    CHECK(zero.optimizer_state(1) == plain.optimizer_state(1));
    for (const MemoryTag tag : {MemoryTag::gradients, MemoryTag::weights})
      CHECK(zero.backend(0).memory.in_use(tag) == plain.backend(0).memory.in_use(tag));
  }
  for (const int stage : {-1, 4})
    CHECK_THAT(test::error_message([stage] {
                 Pipeline<partition<Model, 2>, schedule::OneFOneB, Host> pipe({.microbatches = 2, .zero = stage});
               }),
               Catch::Contains("zero is the ZeRO stage, 0 (off), 1 (optimizer state), 2 (and gradients) or 3 (and "
                               "parameters), got " + std::to_string(stage)));
}

TEST_CASE("ZeRO-3's released weights: a clear error on use, and allocated again by hold()", "[pipeline][zero]") {
  backend::Host<double> be;
  VersionedWeights<backend::Host<double>, 1> w(be, 10);
  const std::int64_t whole = be.memory.in_use(MemoryTag::weights);
  CHECK(whole == std::int64_t(10 * sizeof(double)));
  CHECK(w.held());
  w.release();
  CHECK_FALSE(w.held());
  CHECK(be.memory.in_use(MemoryTag::weights) == 0);
  CHECK_THAT(test::error_message([&] { (void)w.latest_data(); }), Catch::Contains("weight version 0 is released") &&
                                                                      Catch::Contains("gather them first"));
  CHECK_THAT(test::error_message([&] { (void)w.data(0); }), Catch::Contains("is released"));
  w.hold();
  CHECK(w.held());
  CHECK(w.latest_data() != nullptr);
  CHECK(be.memory.in_use(MemoryTag::weights) == whole);
  VersionedWeights<backend::Host<double>, 2> two(be, 4);
  (void)two.advance();
  CHECK_THAT(test::error_message([&] { two.release(); }), Catch::Contains("holding 2 weight versions cannot release"));
}

TEST_CASE("ZeRO-3 keeps one replica's shard of a stage's weights, which its update reads", "[pipeline][zero]") {
  using Seq = typename partition<Model, 2>::template stage<0>;
  using St = pipeline::StageState<Seq, backend::Host<double>, 1>;
  backend::Host<double> be;
  St st(be, 1, false);
  std::vector<double> init(std::size_t(St::param_count));
  for (std::size_t i = 0; i < init.size(); ++i) init[i] = double(i) + 0.5;
  be.upload(std::span<const double>(init), st.weights.latest_data());
  st.shard = pipeline::Shard::of(St::param_count, 3, 1);
  st.shard_parameters();
  CHECK_FALSE(st.weights.held());
  CHECK(be.memory.in_use(MemoryTag::weights) == st.shard.size() * std::int64_t(sizeof(double)));
  const std::vector<double> mine(st.param_shard.data(), st.param_shard.data() + st.shard.size());
  CHECK(mine == std::vector<double>(init.begin() + st.shard.begin, init.begin() + st.shard.end));
  CHECK(st.shard_parameter_data(nullptr) == st.param_shard.data());
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
