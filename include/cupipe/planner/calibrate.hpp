// SPDX-License-Identifier: Apache-2.0
// A planner cost model from a model's compile-time layer list and a measured profile: times from
// cupipe::profile_layers (rebalance.hpp) on the backend at hand, sizes from the LayerSeq.
#pragma once

#include <cstddef>
#include <utility>

#include "cupipe/layers/sequential.hpp"
#include "cupipe/pipeline/rebalance.hpp"
#include "cupipe/planner/planner.hpp"

namespace cupipe::planner {

/// The cost model of `Body` (a model's LayerSeq, Model::body) with `profile`'s times, for values of
/// `value_bytes` bytes and an optimizer with `optimizer_slots` arrays per parameter.
template <class Body>
CostModel cost_model(const LayerProfile& profile, int value_bytes, int optimizer_slots, index_t rows_per_sample = 1) {
  CUPIPE_REQUIRE(profile.forward.size() == Body::size, "planner: the profile has ", profile.forward.size(),
                 " layers but the model has ", Body::size);
  CostModel model;
  model.profiled_rows = profile.rows;
  model.rows_per_sample = rows_per_sample;
  model.value_bytes = value_bytes;
  model.optimizer_slots = optimizer_slots;
  [&]<std::size_t... I>(std::index_sequence<I...>) {
    (model.layers.push_back(LayerCost{profile.names[I], profile.forward[I], profile.backward_input[I],
                                      profile.backward_weight[I],
                                      double(Body::param_offsets[I + 1] - Body::param_offsets[I]),
                                      double(Body::widths[I]), double(Body::widths[I + 1]),
                                      double(Body::template layer<I>::saved_per_row(Body::widths[I]))}),
     ...);
  }(std::make_index_sequence<Body::size>());
  return model;
}

}  // namespace cupipe::planner
