// SPDX-License-Identifier: Apache-2.0
// The expert groups' all-to-all as a step meets it (all_to_all_in_step). all_to_all_cost
// (calibrate_links.hpp) times the exchange alone, between ranks that do nothing else; in training
// each dispatch and combine also waits for the group's slowest rank: one its routing gave more
// tokens, or one whose core another process holds. On the 2-core VM the lone exchange priced
// gpt_train's all-to-alls 25 times under what training measured (docs/benchmarks.md, 2026-12-06).
// Here every rank of the communicator's expert groups runs its share of the expert-parallel model,
// forward and backward, on its own batch; the layers count what each all-to-all left exposed
// (moe::Tally), and the exposed time per all-to-all at two batch sizes gives the line the planner
// prices an all-to-all with (CostModel::all_to_all_latency, all_to_all_bytes_per_second).
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "cupipe/comm/communicator.hpp"
#include "cupipe/core/error.hpp"
#include "cupipe/core/shape.hpp"
#include "cupipe/core/tensor.hpp"
#include "cupipe/layers/network.hpp"
#include "cupipe/moe/tally.hpp"
#include "cupipe/planner/calibrate_links.hpp"

namespace cupipe::planner {

namespace detail {
/// Median over `repeats` forward and backward passes of `net` on `rows` rows of `tokens` (whole
/// samples; the same ids are the labels) of the exposed seconds per all-to-all its layers counted.
template <class Model, class Backend>
double exposed_per_all_to_all(Network<Model, Backend>& net, moe::Tally& tally, ConstView<std::int32_t> tokens, index_t rows,
                              int repeats) {
  const ConstViewOn<Backend, std::int32_t> x{tokens.data(), Shape{rows, tokens.cols()}};
  const ConstViewOn<Backend, std::int32_t> y{tokens.data(), Shape{rows}};
  net.forward_backward(x, y);  // warm-up: the first pass through a fresh communicator is slow
  std::vector<double> per(static_cast<std::size_t>(std::max(repeats, 1)));
  for (double& p : per) {
    tally = {};
    net.zero_grad();
    net.forward_backward(x, y);
    CUPIPE_REQUIRE(tally.all_to_alls > 0, "planner: all_to_all_in_step: the model ran no all-to-all; is it expert-parallel?");
    p = tally.exposed_all_to_all_seconds / double(tally.all_to_alls);
  }
  std::sort(per.begin(), per.end());
  return per[per.size() / 2];
}
}  // namespace detail

/// The all-to-all's cost inside a step of `Model` (an expert-parallel model, each rank its group's
/// share: gpt::ExpertParallelModel) over the communicator's expert group, on `Backend`: latency and
/// bandwidth fitted, as the planner prices them (detail::all_to_all_seconds: (ranks - 1) / ranks of
/// the values sent leave a rank), to the exposed seconds per all-to-all at all of `tokens` (this
/// rank's batch, token ids, `rows_per_sample` rows a sample) and at half of its samples, each the
/// mean over the ranks of their medians of `repeats` passes. The groups take turns. An all-to-all sends
/// `values_per_row` values a row (the layer's top-k x width: LayerCost::all_to_all_values) of
/// `value_bytes` bytes. Collective: every rank calls it, with batches of the same size. Zero cost
/// without a group of 2 or more.
template <class Model, class Backend>
LinkCost all_to_all_in_step(comm::Communicator& comm, ConstView<std::int32_t> tokens, index_t rows_per_sample,
                            double values_per_row, int value_bytes, int repeats = 3) {
  moe::ExpertGroup* group = comm.expert_group();
  if (group == nullptr || group->size() < 2) return {};
  const index_t samples = rows_per_sample > 0 ? tokens.rows() / rows_per_sample : 0;
  CUPIPE_REQUIRE(samples >= 2 && values_per_row > 0, "planner: all_to_all_in_step needs at least 2 samples of ",
                 rows_per_sample, " rows and values to send, got ", tokens.rows(), " rows and ", values_per_row,
                 " values a row");
  Network<Model, Backend> net(5);
  moe::Tally tally;
  net.backend().expert_group = group;
  net.backend().moe_tally = &tally;
  const index_t large = samples * rows_per_sample, small = samples / 2 * rows_per_sample;
  // One group at a time, the other ranks waiting (asleep) in the sum: what a group's exchanges wait
  // for is its own ranks, not other processes on the same cores (CostModel::contention's part).
  const comm::Topology& t = comm.topology();
  const int per_stage = t.replicas / t.experts, turns = t.stages * per_stage;
  const int mine = t.stage() * per_stage + t.expert_group_index();
  double t_small = 0, t_large = 0;
  for (int turn = 0; turn < turns; ++turn) {
    double measured[2] = {0, 0};
    if (turn == mine) {
      measured[0] = detail::exposed_per_all_to_all(net, tally, tokens, small, repeats);
      measured[1] = detail::exposed_per_all_to_all(net, tally, tokens, large, repeats);
    }
    t_small += comm.sum_over_world(measured[0]) / double(group->size() * turns);
    t_large += comm.sum_over_world(measured[1]) / double(group->size() * turns);
  }
  const double leaving = double(group->size() - 1) / double(group->size()) * values_per_row * double(value_bytes);
  return detail::fit_link(t_small, t_large, leaving * double(small), leaving * double(large));
}

}  // namespace cupipe::planner
