// SPDX-License-Identifier: Apache-2.0
// From run-time choices to compile-time types: a trainer that takes --schedule and --stages from the
// command line calls these once, and everything below runs on the instantiated types.
#pragma once

#include <string>
#include <utility>

#include "cupipe/core/error.hpp"
#include "cupipe/schedule/policies.hpp"

namespace cupipe {

/// Calls f.template operator()<Policy>() for the policy `id`; Interleaved runs with 2 chunks.
template <class F>
decltype(auto) with_policy(schedule::PolicyId id, F&& f) {
  using schedule::PolicyId;
  switch (id) {
    case PolicyId::gpipe: return std::forward<F>(f).template operator()<schedule::GPipe>();
    case PolicyId::one_f_one_b: return std::forward<F>(f).template operator()<schedule::OneFOneB>();
    case PolicyId::interleaved: return std::forward<F>(f).template operator()<schedule::Interleaved<2>>();
    case PolicyId::pipedream: return std::forward<F>(f).template operator()<schedule::PipeDream>();
    case PolicyId::pipedream_2bw: return std::forward<F>(f).template operator()<schedule::PipeDream2BW>();
    case PolicyId::zb_h1: return std::forward<F>(f).template operator()<schedule::ZeroBubbleH1>();
    case PolicyId::zb_h2: return std::forward<F>(f).template operator()<schedule::ZeroBubbleH2>();
  }
  CUPIPE_THROW("unknown schedule policy id ", int(id));
}

/// Calls f.template operator()<P>() for the stage count `stages`, one of Counts.
template <int... Counts, class F>
decltype(auto) with_stage_count(int stages, F&& f) {
  using Result = decltype(std::forward<F>(f).template operator()<(Counts, ...)>());
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
