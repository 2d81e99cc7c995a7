// SPDX-License-Identifier: Apache-2.0
// Which schedules a trainer build compiles. Each schedule x stage count instantiates the whole
// training loop, which makes the trainers the slowest files of the project to compile. A build
// configured with -DCUPIPE_TRAINER_SCHEDULES=flush (the sanitizer job in scripts/test.sh, whose
// checks run 1F1B or what --plan auto picks among these) compiles only the one-chunk flush
// schedules: GPipe, 1F1B, ZB-H1 and ZB-H2; one configured with 1f1b (CI's CUDA stage, where no
// trainer runs: it checks that the flush family's CUDA loops compile) only 1F1B. Either refuses the others with
// that reason, and leaves bf16 host training out. The default build compiles every schedule.
#pragma once

#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

#include "cupipe/core/error.hpp"
#include "cupipe/schedule/registry.hpp"

namespace cupipe::examples {

#if defined(CUPIPE_TRAINER_FLUSH_SCHEDULES_ONLY) && CUPIPE_TRAINER_FLUSH_SCHEDULES_ONLY
inline constexpr bool trainer_has_every_schedule = false;
#else
inline constexpr bool trainer_has_every_schedule = true;
#endif
#if defined(CUPIPE_TRAINER_1F1B_ONLY) && CUPIPE_TRAINER_1F1B_ONLY
inline constexpr bool trainer_has_1f1b_only = true;
/// The -DCUPIPE_TRAINER_SCHEDULES value of a build that left schedules out, and what it compiles.
inline constexpr const char* trainer_setting = "1f1b";
inline constexpr const char* trainer_setting_compiles = "1F1B only";
#else
inline constexpr bool trainer_has_1f1b_only = false;
inline constexpr const char* trainer_setting = "flush";
inline constexpr const char* trainer_setting_compiles = "the one-chunk flush schedules only (gpipe, 1f1b, zb-h1, zb-h2)";
#endif

/// Whether this build of the trainers compiles `Schedule`.
template <class Schedule>
inline constexpr bool trainer_builds =
    trainer_has_every_schedule ||
    (Schedule::update == schedule::UpdateRule::flush && Schedule::chunks == 1 &&
     (!trainer_has_1f1b_only || std::is_same_v<Schedule, schedule::OneFOneB>));

/// The trainers' host training loops are compiled outside main.cpp, the flush family in
/// train_flush.cpp and the other two in train_other.cpp, which build side by side: in one file they
/// took 6.3 minutes at -O3 (mlp_fashion_mnist, 2026-12-02).
enum class ScheduleFamily {
  flush,        ///< one chunk per worker, flush update: GPipe, 1F1B, ZB-H1, ZB-H2
  chunked,      ///< two chunks per worker: interleaved, BFS, ZBV, V-Half, V-Min, DualPipeV
  asynchronous  ///< updates inside the step: PipeDream, 2BW
};
template <class Schedule>
inline constexpr ScheduleFamily family_of = Schedule::update != schedule::UpdateRule::flush ? ScheduleFamily::asynchronous
                                            : Schedule::chunks > 1                            ? ScheduleFamily::chunked
                                                                                              : ScheduleFamily::flush;
/// The family of the schedule named `name` (schedule::with_policy refuses an unknown name).
inline ScheduleFamily family_of_name(std::string_view name) {
  ScheduleFamily family = ScheduleFamily::flush;
  schedule::with_policy(name, [&]<class Schedule>() { family = family_of<Schedule>; });
  return family;
}

/// Returns run.template operator()<F>() for the family F of the schedule named `name`: each family's
/// training loops are their own translation units (the flush family alone in a build configured with
/// -DCUPIPE_TRAINER_SCHEDULES=flush or 1f1b, which refused the others before any data loaded).
template <class Run>
int with_family(std::string_view name, Run&& run) {
  switch (family_of_name(name)) {
#if !(defined(CUPIPE_TRAINER_FLUSH_SCHEDULES_ONLY) && CUPIPE_TRAINER_FLUSH_SCHEDULES_ONLY)
    case ScheduleFamily::chunked: return run.template operator()<ScheduleFamily::chunked>();
    case ScheduleFamily::asynchronous: return run.template operator()<ScheduleFamily::asynchronous>();
#endif
    default: return run.template operator()<ScheduleFamily::flush>();
  }
}

/// The error for a schedule this build left out.
template <class Schedule>
[[noreturn]] void refuse_unbuilt_schedule() {
  CUPIPE_THROW("--schedule ", Schedule::name, " is not in this build, which was configured with "
               "-DCUPIPE_TRAINER_SCHEDULES=", trainer_setting, " and compiles ", trainer_setting_compiles,
               "; configure without it for every schedule");
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

/// Fails, before any data loads, when `schedule` names a policy this build left out.
inline void require_built_schedule(std::string_view name) {
  schedule::with_policy(name, []<class Schedule>() {
    if constexpr (!trainer_builds<Schedule>) refuse_unbuilt_schedule<Schedule>();
  });
}

}  // namespace cupipe::examples
