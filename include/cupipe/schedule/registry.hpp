// SPDX-License-Identifier: Apache-2.0
// The policies cupipe ships, listed once. Names, parsing, run-time dispatch (with_policy), help
// texts, the explorer, the trainers and the benchmarks all derive from this list; a policy written
// elsewhere joins a list of its own with PolicyList<..., Mine> and every function here takes it.
#pragma once

#include <array>
#include <optional>
#include <type_traits>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "cupipe/core/error.hpp"
#include "cupipe/schedule/policies/controllable_v.hpp"
#include "cupipe/schedule/policies/dualpipe.hpp"
#include "cupipe/schedule/policies/interleaved.hpp"
#include "cupipe/schedule/policies/one_f_one_b.hpp"
#include "cupipe/schedule/policies/pipedream.hpp"
#include "cupipe/schedule/policies/zero_bubble.hpp"
#include "cupipe/schedule/policy.hpp"

namespace cupipe::schedule {

template <SchedulePolicy... Ps>
struct PolicyList {
  static constexpr std::size_t size = sizeof...(Ps);
};

/// Every policy cupipe ships, in the order tools list them. Interleaved, BFS and the V schedules (ZBV,
/// V-Half, V-Min, DualPipeV) run 2 chunks per worker.
using Policies = PolicyList<GPipe, OneFOneB, Interleaved<2>, BreadthFirst<2>, PipeDream, PipeDream2BW, ZeroBubbleH1,
                            ZeroBubbleH2, ZeroBubbleV, VHalf, VMin, DualPipeV>;

/// A list with more policies appended.
template <class List, SchedulePolicy... More>
struct extend_list;
template <SchedulePolicy... Ps, SchedulePolicy... More>
struct extend_list<PolicyList<Ps...>, More...> {
  using type = PolicyList<Ps..., More...>;
};
template <class List, SchedulePolicy... More>
using extend = typename extend_list<List, More...>::type;

/// A policy's facts as run-time values, for tools that pick a policy by name.
struct PolicyInfo {
  std::string_view name;
  std::string_view summary;
  bool split_backward;
  UpdateRule update;
  int default_chunks;
  int default_batches;
  std::string_view (*check)(const Config&);
  Plan (*generate)(const Config&);
};

template <SchedulePolicy P>
constexpr PolicyInfo info_of() {
  return {P::name, P::summary, P::split_backward, P::update, P::chunks, P::default_batches, &schedule::check<P>,
          &schedule::generate<P>};
}

/// Calls f.template operator()<P>() for each policy of the list, in order.
template <class List = Policies, class F>
constexpr void for_each_policy(F&& f) {
  [&]<SchedulePolicy... Ps>(PolicyList<Ps...>*) { (f.template operator()<Ps>(), ...); }(static_cast<List*>(nullptr));
}

/// Every policy of the list as run-time facts.
template <class List = Policies>
constexpr auto policy_table() {
  return [&]<SchedulePolicy... Ps>(PolicyList<Ps...>*) {
    return std::array<PolicyInfo, sizeof...(Ps)>{info_of<Ps>()...};
  }(static_cast<List*>(nullptr));
}

/// "gpipe, 1f1b, ..." for help texts and errors.
template <class List = Policies>
std::string policy_names(std::string_view separator = ", ") {
  std::string out;
  for_each_policy<List>([&]<class P>() {
    if (!out.empty()) out += separator;
    out += P::name;
  });
  return out;
}

/// The facts of the policy called `name`; throws naming every valid name otherwise.
template <class List = Policies>
PolicyInfo find_policy(std::string_view name) {
  for (const PolicyInfo& p : policy_table<List>())
    if (p.name == name) return p;
  CUPIPE_THROW("unknown schedule '", name, "'; expected one of: ", policy_names<List>());
}

/// Calls f.template operator()<P>() for the policy called `name` and returns its result.
template <class List = Policies, class F>
decltype(auto) with_policy(std::string_view name, F&& f) {
  (void)find_policy<List>(name);  // throws for an unknown name
  return [&]<SchedulePolicy P0, SchedulePolicy... Ps>(PolicyList<P0, Ps...>*) -> decltype(auto) {
    using Result = decltype(f.template operator()<P0>());
    if constexpr (std::is_void_v<Result>) {
      bool done = false;
      auto one = [&]<class P>() {
        if (!done && P::name == name) {
          f.template operator()<P>();
          done = true;
        }
      };
      one.template operator()<P0>();
      (one.template operator()<Ps>(), ...);
    } else {
      std::optional<Result> out;
      auto one = [&]<class P>() {
        if (!out && P::name == name) out.emplace(f.template operator()<P>());
      };
      one.template operator()<P0>();
      (one.template operator()<Ps>(), ...);
      return Result(std::move(*out));
    }
  }(static_cast<List*>(nullptr));
}

/// The plan of the policy called `name` (the explorer's path; trainers use the types).
template <class List = Policies>
Plan generate(std::string_view name, const Config& c) {
  return find_policy<List>(name).generate(c);
}

}  // namespace cupipe::schedule
