// SPDX-License-Identifier: Apache-2.0
// From run-time choices to compile-time types: a trainer that takes --schedule and --stages from the
// command line calls these once, and everything below runs on the instantiated types.
#pragma once

#include <string>
#include <type_traits>
#include <utility>

#include "cupipe/core/error.hpp"
#include "cupipe/schedule/registry.hpp"

namespace cupipe {

/// Calls f.template operator()<Policy>() for the policy named `name` (schedule/registry.hpp).
using schedule::with_policy;

/// Calls f.template operator()<P>() for the stage count `stages`, one of Counts.
template <int... Counts, class F>
decltype(auto) with_stage_count(int stages, F&& f) {
  static constexpr int counts[] = {Counts...};
  using Result = decltype(std::forward<F>(f).template operator()<counts[0]>());
  if constexpr (std::is_void_v<Result>) {
    bool found = false;
    ((stages == Counts ? (std::forward<F>(f).template operator()<Counts>(), found = true) : false), ...);
    if (!found) {
      std::string supported;
      ((supported += (supported.empty() ? "" : ", ") + std::to_string(Counts)), ...);
      CUPIPE_THROW("--stages ", stages, " is not built into this program; it supports ", supported);
    }
  } else {
    static_assert(std::is_void_v<Result>, "with_stage_count: the callable must return void");
  }
}

}  // namespace cupipe
