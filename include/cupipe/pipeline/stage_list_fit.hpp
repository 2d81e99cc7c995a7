// SPDX-License-Identifier: Apache-2.0
// Whether a stage list fits a schedule, checked where Pipeline<Stages, Schedule, Backend> is named:
// - a multi-chunk schedule deals V virtual stages to each worker, so the list needs a multiple of V;
// - partition<Model, N> counts stages, and with such a schedule would silently give N / V workers, so
//   it is refused there in favour of partition_for<Model, Workers, Schedule>.
// Each check fails with its own sentence; the pipeline then goes on with a schedule it can build
// (stage_list_fit::type), so that sentence is the compiler's only error.
#pragma once

#include <type_traits>

#include "cupipe/pipeline/stage_list.hpp"
#include "cupipe/schedule/policies/one_f_one_b.hpp"

namespace cupipe::detail {

/// Instantiated when a stage list cannot be dealt out to the workers of a multi-chunk schedule.
template <int StageListSize, int ChunksPerWorker>
struct stage_count_fits_chunks {
  static_assert(StageListSize % ChunksPerWorker == 0,
                "Pipeline: the schedule gives each worker V chunks, so the StageList needs a multiple of V stages "
                "(stage_count_fits_chunks<stages in the list, V> above names both numbers)");
  static constexpr bool value = StageListSize % ChunksPerWorker == 0;
};

/// Instantiated with partition<Model, N> and a schedule of V chunks per worker.
template <std::size_t PartitionCount, int ChunksPerWorker>
struct partition_counts_stages_not_workers {
  static_assert(ChunksPerWorker == 1,
                "Pipeline: partition<Model, N> makes N virtual stages, and this schedule puts V of them on each "
                "worker (partition_counts_stages_not_workers<N, V> above names both numbers), so it would run "
                "N / V workers; name the workers instead: partition_for<Model, Workers, Schedule>");
  static constexpr bool value = ChunksPerWorker == 1;
};

template <class Stages, int ChunksPerWorker>
struct partition_names_workers : std::true_type {};
template <class Stages, int ChunksPerWorker>
  requires requires { Stages::partition_count; }
struct partition_names_workers<Stages, ChunksPerWorker>
    : std::bool_constant<partition_counts_stages_not_workers<Stages::partition_count, ChunksPerWorker>::value> {};

/// Runs both checks; `type` is the schedule a pipeline is built with: the requested one, or GPipe after
/// a failed check (so that the check's sentence is the only error).
template <class Stages, class Schedule>
struct stage_list_fit {
  static constexpr bool fits = stage_count_fits_chunks<int(Stages::size), Schedule::chunks>::value;
  static constexpr bool names_workers = partition_names_workers<Stages, Schedule::chunks>::value;
  using type = std::conditional_t<fits && names_workers, Schedule, schedule::GPipe>;
};

}  // namespace cupipe::detail
