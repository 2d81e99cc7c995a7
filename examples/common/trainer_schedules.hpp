// SPDX-License-Identifier: Apache-2.0
// Which schedules a trainer build compiles. Each schedule x stage count instantiates the whole
// training loop, which makes the trainers the slowest files of the project to compile. A build
// configured with -DCUPIPE_TRAINER_SCHEDULES=flush (the sanitizer job in scripts/test.sh, whose
// checks run 1F1B or what --plan auto picks among these) compiles only the one-chunk flush
// schedules: GPipe, 1F1B, ZB-H1 and ZB-H2. It refuses the others with that reason. The default
// build compiles every schedule.
#pragma once

#include <string>
#include <string_view>
#include <vector>

#include "cupipe/core/error.hpp"
#include "cupipe/schedule/registry.hpp"

namespace cupipe::examples {

#if defined(CUPIPE_TRAINER_FLUSH_SCHEDULES_ONLY) && CUPIPE_TRAINER_FLUSH_SCHEDULES_ONLY
inline constexpr bool trainer_has_every_schedule = false;
#else
inline constexpr bool trainer_has_every_schedule = true;
#endif

/// Whether this build of the trainers compiles `Schedule`.
template <class Schedule>
inline constexpr bool trainer_builds =
    trainer_has_every_schedule || (Schedule::update == schedule::UpdateRule::flush && Schedule::chunks == 1);

/// The error for a schedule this build left out.
template <class Schedule>
[[noreturn]] void refuse_unbuilt_schedule() {
  CUPIPE_THROW("--schedule ", Schedule::name, " is not in this build, which was configured with "
               "-DCUPIPE_TRAINER_SCHEDULES=flush and compiles the one-chunk flush schedules only (gpipe, 1f1b, zb-h1, "
               "zb-h2); configure without it for every schedule");
}

/// The schedules --plan auto may choose: every one (empty) or this build's.
inline std::vector<std::string> built_schedule_names() {
  std::vector<std::string> names;
  if constexpr (!trainer_has_every_schedule)
    for (const schedule::PolicyInfo& p : schedule::policy_table())
      schedule::with_policy(p.name, [&]<class Schedule>() {
        if constexpr (trainer_builds<Schedule>) names.emplace_back(p.name);
      });
  return names;
}

/// Whether the trainers compile `Schedule` with bf16 storage: the one-chunk flush schedules (each
/// one is the whole training loop again).
template <class Schedule>
inline constexpr bool bf16_builds = Schedule::update == schedule::UpdateRule::flush && Schedule::chunks == 1;

/// The schedules --plan auto may choose with --precision bf16.
inline std::vector<std::string> bf16_schedule_names() {
  std::vector<std::string> names;
  for (const schedule::PolicyInfo& p : schedule::policy_table())
    schedule::with_policy(p.name, [&]<class Schedule>() {
      if constexpr (bf16_builds<Schedule>) names.emplace_back(p.name);
    });
  return names;
}

/// The error for a schedule the trainers do not compile with bf16 storage.
template <class Schedule>
[[noreturn]] void refuse_bf16_schedule() {
  std::string names;
  for (const std::string& n : bf16_schedule_names()) names += (names.empty() ? "" : ", ") + n;
  CUPIPE_THROW("--precision bf16 trains with the one-chunk flush schedules (", names, ") in this trainer, not ",
               Schedule::name, " (the others are compiled in fp32 only, to keep the build short)");
}

/// Fails, before any data loads, when `schedule` names a policy the trainers do not run in bf16.
inline void require_bf16_schedule(std::string_view name) {
  schedule::with_policy(name, []<class Schedule>() {
    if constexpr (!bf16_builds<Schedule>) refuse_bf16_schedule<Schedule>();
  });
}

/// Fails, before any data loads, when `schedule` names a policy this build left out.
inline void require_built_schedule(std::string_view name) {
  schedule::with_policy(name, []<class Schedule>() {
    if constexpr (!trainer_builds<Schedule>) refuse_unbuilt_schedule<Schedule>();
  });
}

}  // namespace cupipe::examples
