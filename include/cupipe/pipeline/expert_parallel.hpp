// SPDX-License-Identifier: Apache-2.0
// The pipeline's side of expert parallelism (moe/expert_group.hpp): the communicator's group,
// checked against the model, and the gradient sums it changes. An expert-parallel group's ranks are
// replicas of their stage (comm/topology.hpp), so the loss normalisers and every tensor but the
// experts' sum over all the stage's replicas as under data parallelism; the experts. tensors
// (TensorSplit::expert_rows) differ between the places of a group, and sum over the replicas that
// hold the same experts instead (ExpertGroup::sum_over_holders). The group also serves as the model's
// split group, as a tensor-parallel group does: each rank's part of the initialisation, the global
// norm's sum of the split tensors' squares, and the whole model's values in checkpoints
// (pipeline/model_values.hpp).
#pragma once

#include <algorithm>
#include <cstddef>
#include <span>
#include <string>
#include <type_traits>
#include <vector>

#include "cupipe/comm/communicator.hpp"
#include "cupipe/core/error.hpp"
#include "cupipe/layers/sequential.hpp"
#include "cupipe/layers/tensor_parallel.hpp"
#include "cupipe/moe/expert_group.hpp"

namespace cupipe::pipeline {

/// The communicator's expert-parallel group for a model whose parameter table is `table`, or null
/// where the model splits no experts and the communicator has no group. Refused, with the reason: a
/// group of another size than the model's parts, a group beside a model that splits no experts,
/// experts split without a group, and tensor parallelism beside it.
inline moe::ExpertGroup* expert_group_for(comm::Communicator* comm, const std::vector<ParamInfo>& table) {
  const int parts = layers::tensor_parallel::parts_of(table, true);
  moe::ExpertGroup* group = comm ? comm->expert_group() : nullptr;
  const int ranks = group ? group->size() : 1;
  if (parts == 1 && ranks == 1) return nullptr;
  if (parts != ranks)
    CUPIPE_THROW("Pipeline: the model's experts are split over ", parts, " expert-parallel rank(s), but ",
                 comm ? "the communicator's groups have " + std::to_string(ranks) +
                            (parts == 1 ? " (a model with experts split over them: gpt::ExpertParallelModel<config, " +
                                              std::to_string(ranks) + ">)"
                                        : std::string())
                      : std::string("there is no communicator (make one with that many: comm::MpiCommunicator(world, "
                                    "stages, timeout, 1, order, 1, experts))"));
  if (layers::tensor_parallel::parts_of(table) > 1)
    CUPIPE_THROW("Pipeline: expert parallelism beside tensor parallelism is not supported; split the experts or the "
                 "tensors, not both");
  return group;
}

/// The flat ranges, relative to a stage's first parameter at `offset` (of `count`), of the tensors
/// split over the expert-parallel group (`experts`) and of the others.
struct ExpertRanges {
  std::vector<std::pair<index_t, index_t>> experts, others;  ///< (first, count) in the stage's buffer

  ExpertRanges(const std::vector<ParamInfo>& table, index_t offset, index_t count) {
    for (const ParamInfo& p : table) {
      if (p.offset < offset || p.offset >= offset + count) continue;
      auto& to = p.split == TensorSplit::expert_rows ? experts : others;
      if (!to.empty() && to.back().first + to.back().second == p.offset - offset) to.back().second += p.numel;
      else to.emplace_back(p.offset - offset, p.numel);
    }
  }
  template <class Each>
  static void pack(const std::vector<std::pair<index_t, index_t>>& ranges, Each&& each) {
    index_t at = 0;
    for (const auto& [first, n] : ranges) {
      each(first, at, n);
      at += n;
    }
  }
  static index_t total(const std::vector<std::pair<index_t, index_t>>& ranges) {
    index_t n = 0;
    for (const auto& r : ranges) n += r.second;
    return n;
  }
};

/// Sums a stage's gradients under expert parallelism, through host memory: the experts' tensors
/// over the replicas that hold the same experts, every other tensor over all the stage's replicas.
template <class St>
void sum_expert_parallel(comm::Communicator& comm, moe::ExpertGroup& group, St& st, const ExpertRanges& ranges) {
  using T = grad_t<std::remove_reference_t<decltype(*st.be)>>;
  std::vector<T> all(static_cast<std::size_t>(st.param_count));
  st.be->synchronize();
  st.be->download(st.grads.data(), std::span<T>(all));
  const auto sum = [&](const std::vector<std::pair<index_t, index_t>>& ranges_of, auto&& over) {
    std::vector<T> packed(static_cast<std::size_t>(ExpertRanges::total(ranges_of)));
    if (packed.empty()) return;
    ExpertRanges::pack(ranges_of, [&](index_t first, index_t at, index_t n) {
      std::copy_n(all.begin() + first, n, packed.begin() + at);
    });
    over(packed.data(), packed.size());
    ExpertRanges::pack(ranges_of, [&](index_t first, index_t at, index_t n) {
      std::copy_n(packed.begin() + at, n, all.begin() + first);
    });
  };
  if (comm.topology().replicas > 1) sum(ranges.others, [&](T* d, std::size_t n) { comm.sum_over_replicas(d, n); });
  if (group.holders() > 1) sum(ranges.experts, [&](T* d, std::size_t n) { group.sum_over_holders(d, n); });
  st.be->upload(std::span<const T>(all), st.grads.data());
}

/// After the summed gradients were read (GradientSync::read_summed): one copy of each sum stays,
/// the others are zeroed, so that the next sum counts it once: the other tensors' on the stage's
/// first replica, the experts' on the first of their holders.
template <class St>
void keep_one_sum(const comm::Topology& topology, St& st, const ExpertRanges& ranges) {
  using T = grad_t<std::remove_reference_t<decltype(*st.be)>>;
  std::vector<T> all(static_cast<std::size_t>(st.param_count));
  st.be->synchronize();
  st.be->download(st.grads.data(), std::span<T>(all));
  const auto zero = [&](const std::vector<std::pair<index_t, index_t>>& ranges_of) {
    for (const auto& [first, n] : ranges_of) std::fill_n(all.begin() + first, n, T(0));
  };
  if (topology.replica() != 0) zero(ranges.others);
  if (topology.expert_group_index() != 0) zero(ranges.experts);
  st.be->upload(std::span<const T>(all), st.grads.data());
}

}  // namespace cupipe::pipeline
