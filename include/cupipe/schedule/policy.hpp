// SPDX-License-Identifier: Apache-2.0
// What a schedule policy is: a tag type that owns its behaviour (CUTLASS style). It names itself,
// declares its knobs, and provides its checks, its placement and its plan generator, all constexpr:
//
//   struct MyPolicy {
//     static constexpr std::string_view name = "mine", summary = "one line for --help";
//     static constexpr bool split_backward = false;
//     static constexpr UpdateRule update = UpdateRule::flush;
//     static constexpr int chunks = 1, default_batches = 1;
//     static constexpr std::string_view check(const Config&);    // "" or the sentence a user sees
//     static constexpr Placement placement(const Config&);
//     static constexpr std::vector<std::vector<Action>> actions(const Config&);  // per worker
//     static constexpr int channel_depth(const Config&);  // optional: messages a channel holds (1)
//   };
//
// generate<Policy>(config) runs the shared checks, the policy's check and its generator; verify and
// simulate then work on the plan alone. registry.hpp lists the policies the library ships.
#pragma once

#include <concepts>
#include <cstddef>
#include <string>
#include <string_view>
#include <vector>

#include "cupipe/core/error.hpp"
#include "cupipe/schedule/action.hpp"
#include "cupipe/schedule/placement.hpp"

namespace cupipe::schedule {

template <class P>
concept SchedulePolicy = requires(const Config& c) {
  { P::name } -> std::convertible_to<std::string_view>;
  { P::summary } -> std::convertible_to<std::string_view>;
  { P::split_backward } -> std::convertible_to<bool>;
  { P::update } -> std::convertible_to<UpdateRule>;
  { P::chunks } -> std::convertible_to<int>;
  { P::default_batches } -> std::convertible_to<int>;
  { P::check(c) } -> std::convertible_to<std::string_view>;
  { P::placement(c) } -> std::same_as<Placement>;
  { P::actions(c) } -> std::same_as<std::vector<std::vector<Action>>>;
};

/// Shared reasons, for policies to return from check().
inline constexpr std::string_view one_chunk_reason =
    "this policy runs one chunk per stage, so chunks must be 1 (Interleaved<V> runs several)";
inline constexpr std::string_view flush_one_batch_reason =
    "a flush policy schedules one batch per plan, so batches must be 1 (only PipeDream and PipeDream2BW run several "
    "batches without a flush)";

/// Why `Policy` rejects `c`, or an empty view: first the rules every plan obeys, then the policy's own.
template <SchedulePolicy Policy>
constexpr std::string_view check(const Config& c) {
  if (c.stages < 1) return "a pipeline needs at least 1 stage";
  if (c.microbatches < 1) return "a pipeline needs at least 1 microbatch";
  if (c.batches < 1) return "a schedule needs at least 1 batch";
  if (Policy::update == UpdateRule::flush && c.batches != 1) return flush_one_batch_reason;
  return Policy::check(c);
}

namespace detail {

[[noreturn]] inline void throw_rejection(std::string_view policy, const Config& c, std::string_view why) {
  CUPIPE_THROW(why, " (policy ", policy, ", stages ", c.stages, ", microbatches ", c.microbatches, ", chunks ", c.chunks,
               ", batches ", c.batches, ")");
}

}  // namespace detail

/// The plan of a policy: `generate<OneFOneB>({.stages = 4, .microbatches = 8})`. Throws cupipe::error
/// with the policy's reason when it rejects the configuration (a compile error in constant evaluation).
template <SchedulePolicy Policy>
constexpr Plan generate(const Config& c) {
  if (const std::string_view why = check<Policy>(c); !why.empty()) detail::throw_rejection(Policy::name, c, why);
  Plan plan{c, Policy::actions(c), Policy::split_backward, Policy::update, Policy::placement(c)};
  if constexpr (requires { Policy::channel_depth(c); }) plan.channel_depth = Policy::channel_depth(c);
  return plan;
}

/// A policy's reason as a structural value, so that a compile-time rejection can show it.
struct Reason {
  char text[256]{};
  constexpr Reason(std::string_view s) {  // NOLINT: implicit, for schedule_rejected<check(...)>
    for (std::size_t i = 0; i < s.size() && i + 1 < sizeof text; ++i) text[i] = s[i];
  }
  constexpr bool empty() const { return text[0] == '\0'; }
};

/// Instantiated with the policy's reason: the compiler prints it as this template's argument.
template <Reason Why>
struct schedule_rejected {
  static_assert(Why.empty(),
                "the schedule policy rejects this configuration; its reason is the argument of schedule_rejected<...> "
                "named above");
  static constexpr bool value = Why.empty();
};

/// A configuration checked at compile time: an invalid one fails with the policy's sentence.
///   using S = StaticSchedule<Interleaved<2>, 4, 8>;  static_assert(verify(S::plan()));
template <SchedulePolicy Policy, int Stages, int Microbatches, int Chunks = Policy::chunks,
          int Batches = Policy::default_batches>
struct StaticSchedule {
  static constexpr Config config{Stages, Microbatches, Chunks, Batches};
  static constexpr bool accepted = schedule_rejected<Reason(check<Policy>(config))>::value;
  static constexpr Plan plan() {
    if constexpr (accepted) return generate<Policy>(config);
    else return Plan{config, {}, Policy::split_backward, Policy::update, {}};  // schedule_rejected has reported
  }
};

}  // namespace cupipe::schedule
