// SPDX-License-Identifier: Apache-2.0
// ModelValues: the whole model's parameters, gradients and optimizer slots read and written in the
// unsplit model's flat layout (what checkpoints hold), wherever the stages run: across processes a
// sum over the pipeline in which each rank gives its own stages' values; with tensor parallelism each
// split tensor joined over the group (layers::tensor_parallel::unshard) or cut into this rank's part; with
// ZeRO-1 the optimizer slots' shards gathered over the replicas (with ZeRO-2 the gradients' too, with
// ZeRO-3 the weights' too).
// Every reader is a collective where there is a communicator: every rank calls it.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "cupipe/comm/communicator.hpp"
#include "cupipe/core/error.hpp"
#include "cupipe/layers/tensor_parallel.hpp"
#include "cupipe/pipeline/optimizer_step.hpp"

namespace cupipe::pipeline {

template <class States, class Model>
class ModelValues {
 public:
  using G = typename States::G;

  /// `zero_sharded`: whether ZeRO-1 shards the optimizer slots over replicas here;
  /// `gradients_sharded`: whether ZeRO-2 shards the summed gradients too; `parameters_sharded`:
  /// whether ZeRO-3 shards the weights too.
  ModelValues(States& states, comm::Communicator* comm, TensorGroup* tensor_group, bool zero_sharded,
              bool gradients_sharded = false, bool parameters_sharded = false)
      : states_(states), comm_(comm), group_(tensor_group), zero_sharded_(zero_sharded),
        gradients_sharded_(gradients_sharded), parameters_sharded_(parameters_sharded) {}

  /// The whole model's parameter table (split tensors at their whole shape).
  static std::vector<ParamInfo> table() { return layers::tensor_parallel::whole_table(Model::parameter_table()); }

  std::vector<G> parameters() {
    if (!parameters_sharded_) return whole(gather([](auto& st) { return st.master_data(); }));
    return whole(gather_over_replicas([](auto& st) { return st.param_shard.data(); }));
  }
  /// The gradients as they are now (the caller sums them over the replicas first); with ZeRO-2 the
  /// replicas' shards of the sums, gathered.
  std::vector<G> gradients() {
    if (!gradients_sharded_) return whole(gather([](auto& st) { return st.grads.data(); }));
    return whole(gather_over_replicas([](auto& st) { return st.grad_shard.data(); }));
  }
  void set_parameters(std::span<const G> values) {
    const std::vector<G> mine = part(values);
    const std::span<const G> local = group_ ? std::span<const G>(mine) : values;
    if (parameters_sharded_) {
      scatter_shards(values, local, [](auto& st) { return st.param_shard.data(); });
      states_.for_each([](auto, auto& st) { st.drop_weights(); });  // stale: the next action gathers
      return;
    }
    states_.scatter(local, [](auto& st) { return st.master_data(); });
    states_.for_each([](auto, auto& st) { st.publish_master(st.weights.latest_data()); });
  }

  /// Optimizer slot `slot`; empty before the slots exist.
  std::vector<G> optimizer_state(std::size_t slot) {
    bool prepared = true;
    states_.for_each([&](auto, auto& st) { prepared = prepared && st.slots.size() > slot; });
    if (!prepared) return {};
    if (!zero_sharded_) return whole(gather([slot](auto& st) { return st.slots[slot].data(); }));
    return whole(gather_over_replicas([slot](auto& st) { return st.slots[slot].data(); }));
  }
  /// Writes optimizer slot `slot` (prepared by the caller) and the update count.
  void set_optimizer_state(std::size_t slot, std::span<const G> values, std::int64_t updates) {
    const std::vector<G> mine = part(values);
    const std::span<const G> local = group_ ? std::span<const G>(mine) : values;
    if (!zero_sharded_) states_.scatter(local, [slot](auto& st) { return st.slots[slot].data(); });
    else scatter_shards(values, local, [slot](auto& st) { return st.slots[slot].data(); });
    states_.for_each([&](auto, auto& st) { st.updates = updates; });
  }

  /// With tensor parallelism, the whole model's values from this rank's part (a collective over the
  /// group); else `values` as they are.
  std::vector<G> whole(std::vector<G> values) const {
    if (!group_) return values;
    return layers::tensor_parallel::unshard(table(), Model::parameter_table(), std::span<const G>(values), *group_);
  }

 private:
  /// With tensor parallelism, this rank's part of the whole model's `values`; else nothing (the
  /// caller uses `values`).
  std::vector<G> part(std::span<const G> values) const {
    if (!group_) return {};
    return layers::tensor_parallel::shard(table(), Model::parameter_table(), values, group_->rank());
  }
  /// Each local stage's shard of `local` (this rank's part of the whole model's `values`) written to
  /// `shard(state)` (shard.size() values).
  template <class Pointer>
  void scatter_shards(std::span<const G> values, std::span<const G> local, Pointer shard) {
    CUPIPE_REQUIRE(index_t(local.size()) == States::param_count, "Pipeline: got ", values.size(),
                   " values for a model of ", States::param_count, " parameters");
    states_.for_each([&](auto k, auto& st) {
      const std::size_t at = std::size_t(States::template model_offset<decltype(k)::value>() + st.shard.begin);
      if (st.shard.size() > 0) States::upload_as(st, local.subspan(at, std::size_t(st.shard.size())), shard(st));
    });
  }
  /// The whole model's values from each local stage's shard (`shard(state)`: shard.size() values)
  /// gathered over the replicas, then summed over the pipeline as gather() does.
  template <class Pointer>
  std::vector<G> gather_over_replicas(Pointer shard) {
    std::vector<G> out(static_cast<std::size_t>(States::param_count), G(0));
    states_.for_each([&](auto k, auto& st) {
      const auto all = gather_shards(*comm_, st, shard(st));
      std::copy(all.begin(), all.end(), out.begin() + States::template model_offset<decltype(k)::value>());
    });
    comm_->sum_over_stages(out.data(), out.size());
    return out;
  }
  /// Across processes, a sum over the pipeline in which every other rank contributes zeros.
  template <class Pointer>
  std::vector<G> gather(Pointer pointer) {
    std::vector<G> out = states_.gather(pointer);
    if (comm_) comm_->sum_over_stages(out.data(), out.size());
    return out;
  }

  States& states_;
  comm::Communicator* comm_;
  TensorGroup* group_;
  bool zero_sharded_;
  bool gradients_sharded_;
  bool parameters_sharded_;
};

}  // namespace cupipe::pipeline
