// SPDX-License-Identifier: Apache-2.0
// What the planner charges for communication inside a step, from the cost model's measured links:
// a hand-over between stages (and a context-parallel ring's pass), a sum over a tensor-parallel
// group, and an all-to-all over an expert group.
#pragma once

#include "cupipe/planner/cost_model.hpp"

namespace cupipe::planner::detail {

/// Seconds of a hand-over of `values` values.
inline double link_seconds(const CostModel& model, double values) {
  return model.link_latency + (model.link_bytes_per_second > 0 ? values * model.value_bytes / model.link_bytes_per_second : 0.0);
}

/// Seconds of one all-to-all over the model's expert group (CostModel::expert_ranks) in which each
/// rank sends `values` values: (ranks - 1) / ranks of them leave the rank. 0 without a group.
inline double all_to_all_seconds(const CostModel& model, double values) {
  if (model.expert_ranks <= 1 || values == 0) return 0.0;
  const double leaving = double(model.expert_ranks - 1) / double(model.expert_ranks) * values * model.value_bytes;
  return model.all_to_all_latency + (model.all_to_all_bytes_per_second > 0 ? leaving / model.all_to_all_bytes_per_second : 0.0);
}

/// Seconds of one rank's share of `calls` sums over a tensor-parallel group of `t` ranks that
/// together sum `values` values per rank (a ring all-reduce moves 2 (t - 1) / t of them).
inline double tensor_sum_seconds(const CostModel& model, int t, double calls, double values) {
  if (t <= 1 || (calls == 0 && values == 0)) return 0.0;
  const double bytes = 2.0 * double(t - 1) / double(t) * values * model.gradient_bytes();  // bf16 sums in fp32
  return calls * model.tensor_sum_latency + (model.tensor_sum_bytes_per_second > 0 ? bytes / model.tensor_sum_bytes_per_second : 0.0);
}

}  // namespace cupipe::planner::detail
