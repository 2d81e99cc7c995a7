// SPDX-License-Identifier: Apache-2.0
// UserPlan: a plan that no policy generates, written by hand or by another tool (read with
// io::load_plan) and run by a Pipeline from PipelineOptions::plan.
#pragma once

#include <string_view>
#include <vector>

#include "cupipe/schedule/policy.hpp"

namespace cupipe::schedule {

/// Where a UserPlan's virtual stages live; the runtime needs it at compile time.
enum class PlacementShape { looped, v_shape };

/// The policy of a plan from a file. Its type fixes what the runtime must know before the plan is
/// read: chunks per worker, whether the backward is split into B and W, and the placement; the
/// Pipeline refuses a plan that disagrees with any of them, or that verify rejects (naming the two
/// actions that conflict). Flush updates only: asynchronous weight versions follow from a policy's
/// rule, not from a list of actions. It generates no plan of its own.
template <int V = 1, bool SplitBackward = false, PlacementShape Shape = PlacementShape::looped>
struct UserPlan {
  static_assert(V >= 1, "UserPlan<V>: V is the chunks per worker, at least 1");
  static_assert(Shape != PlacementShape::v_shape || V == 2, "UserPlan: the V-shaped placement has exactly 2 chunks");
  static constexpr std::string_view name = "user";
  static constexpr std::string_view summary = "a plan read from a CSV or JSON file (io::load_plan), verified before it runs";
  static constexpr bool split_backward = SplitBackward;
  static constexpr UpdateRule update = UpdateRule::flush;
  static constexpr int chunks = V;
  static constexpr int default_batches = 1;
  /// The plan comes from PipelineOptions::plan, not from actions().
  static constexpr bool from_options = true;

  static constexpr std::string_view check(const Config& c) {
    return c.chunks != V ? "a UserPlan's chunks are fixed by its type (UserPlan<V, ...>)" : "";
  }
  static constexpr Placement placement(const Config& c) {
    // Not a conditional expression: GCC 12 frees the chosen Placement's vectors too early when one
    // is evaluated at compile time (the pipeline reads a stage's worker in a template argument).
    if constexpr (Shape == PlacementShape::v_shape) return v_shape_placement(c.stages);
    else return looped_placement(c.stages, c.chunks);
  }
  static constexpr std::vector<std::vector<Action>> actions(const Config&) { return {}; }
};

}  // namespace cupipe::schedule
