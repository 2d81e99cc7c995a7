// SPDX-License-Identifier: Apache-2.0
// What a pipeline stage holds in memory, estimated before anything runs, and a partition that keeps
// every worker under a budget.
//
// A worker running stage k of a one-chunk schedule holds, in values:
//   parameters x (weight versions + 1 gradient + optimizer slots [+ 1 master copy])
//   + in_flight x rows x (input message + record)      microbatches between F and B (W if split)
//   + rows x (dy + grad_record + dx)                    one backward's buffers
//   (split backward: dy and grad_record stay until W, so they count per microbatch in flight)
// Values of parameter state (gradient, optimizer slots, master copy) are of the compute type, the
// rest of the storage type (MemoryModel::compute_bytes, value_bytes); they are the same type but
// with bf16 storage.
// where in_flight and weight versions come from the schedule's plan (schedule::peak_activations,
// schedule::weight_versions), and a stage's record and grad_record are its Sequential's. This is the
// allocation pattern of StageExecutor, so the estimate follows the allocator's measured peak (the
// tests hold it to it); it leaves out the staged batch and ops' transient workspace.
//
// Why it matters: a FLOP-balanced split gives the first stage the most blocks (the embedding costs
// almost nothing to run), and the first stage of 1F1B also holds the most microbatches, so it runs
// out of memory first. partition_within<> minimises the slowest stage subject to every worker's
// estimate fitting a budget.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <utility>

#include "cupipe/core/memory.hpp"
#include "cupipe/core/tensor.hpp"
#include "cupipe/pipeline/stage_list.hpp"
#include "cupipe/schedule/policy.hpp"
#include "cupipe/schedule/simulate.hpp"
#include "cupipe/schedule/weights.hpp"

namespace cupipe {

/// What the memory estimate needs to know of a run besides the model and the schedule.
/// Two precisions (a backend's storage and compute types, e.g. Host<bfloat16, float>): weights in use,
/// activations and messages take `value_bytes` each; gradients, optimizer slots and the master
/// weights (kept only when the two differ) take `compute_bytes`. memory_model_for<Backend> fills both.
struct MemoryModel {
  index_t rows_per_microbatch = 1;  ///< rows of one microbatch (sequences x context for a GPT)
  int value_bytes = 4;              ///< bytes per stored value: 4 for float, 8 for double, 2 for bf16
  int optimizer_slots = 2;          ///< arrays per parameter the optimizer keeps: AdamW 2, SGD with momentum 1
  int compute_bytes = 0;            ///< bytes per gradient, master weight and optimizer value; 0: value_bytes
  ZeroSetting zero{};               ///< the ZeRO stage and its replicas (PipelineOptions::zero)

  /// Bytes of one parameter's state: `versions` stored copies, its gradient, the optimizer's slots,
  /// and an fp32 master copy where the stored type is narrower.
  constexpr double state_bytes_per_param(int versions) const {
    return parameter_state_bytes(value_bytes, compute_bytes, optimizer_slots, versions);
  }
};

/// The memory model of a run on `Backend`: its storage and compute types' sizes.
template <class Backend>
constexpr MemoryModel memory_model_for(index_t rows_per_microbatch, int optimizer_slots = 2) {
  return MemoryModel{.rows_per_microbatch = rows_per_microbatch,
                     .value_bytes = int(sizeof(typename Backend::value_type)),
                     .optimizer_slots = optimizer_slots,
                     .compute_bytes = int(sizeof(grad_t<Backend>))};
}

/// Per-row sizes of one stage, in values (see the file comment).
struct StageFootprint {
  double params = 0;       ///< parameter elements
  double in = 0;           ///< input width (0 for the first stage: it reads the staged batch)
  double out = 0;          ///< output width (the gradient it receives, or the loss's dy)
  double record = 0;       ///< what the forward keeps per row: every layer's output and saved values
  double grad_record = 0;  ///< per-layer output gradients the backward keeps per row
};

/// Estimated bytes of one worker holding `f`, with `in_flight` microbatches held at once and
/// `versions` weight versions.
constexpr double footprint_bytes(const StageFootprint& f, int in_flight, int versions, bool split_backward,
                                 const MemoryModel& m) {
  const double rows = double(m.rows_per_microbatch);
  const double per_microbatch = f.in + f.record + (split_backward ? f.out + f.grad_record : 0.0);
  const double one_backward = split_backward ? f.in : f.out + f.grad_record + f.in;
  const StateBytes state =
      sharded_state_bytes(f.params, f.params, m.value_bytes, m.compute_bytes, m.optimizer_slots, versions, m.zero, true);
  return state.total() + double(m.value_bytes) * (double(in_flight) * rows * per_microbatch + rows * one_backward);
}

namespace detail {

/// In-flight microbatches and weight versions per worker of a one-chunk schedule.
template <std::size_t P>
struct Holdings {
  std::array<int, P> in_flight{};
  std::array<int, P> versions{};
};

template <class Schedule, std::size_t P>
constexpr Holdings<P> holdings(int microbatches) {
  static_assert(Schedule::chunks == 1,
                "memory estimates and partition_within<> cover one-chunk schedules (GPipe, 1F1B, ZB-H1/H2, PipeDream, "
                "2BW); with Interleaved<V>, write the StageList by hand");
  const schedule::Plan plan =
      schedule::generate<Schedule>(schedule::Config{int(P), microbatches, 1, Schedule::default_batches});
  const std::vector<int> peak = schedule::peak_activations(plan);
  const std::vector<int> versions = schedule::weight_versions(plan);
  Holdings<P> h;
  for (std::size_t k = 0; k < P; ++k) {
    h.in_flight[k] = k < peak.size() ? peak[k] : 0;
    h.versions[k] = k < versions.size() && versions[k] > 0 ? versions[k] : 1;
  }
  return h;
}

/// Per-layer sizes of a model's body, for footprints of any contiguous range of layers.
template <class Body>
struct layer_sizes {
  static constexpr std::size_t L = Body::size;
  static constexpr std::array<double, L> params = []<std::size_t... I>(std::index_sequence<I...>) {
    return std::array<double, L>{double(param_elements<typename Body::template layer<I>>(Body::widths[I]))...};
  }(std::make_index_sequence<L>());
  static constexpr std::array<double, L> saved = []<std::size_t... I>(std::index_sequence<I...>) {
    return std::array<double, L>{double(Body::template layer<I>::saved_per_row(Body::widths[I]))...};
  }(std::make_index_sequence<L>());

  /// Footprint of layers [first, last) as stage `k`.
  static constexpr StageFootprint range(std::size_t first, std::size_t last, std::size_t k) {
    StageFootprint f;
    f.in = k == 0 ? 0.0 : double(Body::widths[first]);
    f.out = double(Body::widths[last]);
    // As Sequential lays a record out: the activations, then the saved areas, each a whole number
    // of stat_slots from a start rounded up to one.
    index_t activations = 0, saved_total = 0;
    for (std::size_t l = first; l < last; ++l) {
      f.params += params[l];
      activations += Body::widths[l + 1];
      saved_total += round_up_to_stat_slots(index_t(saved[l]));
      if (l + 1 < last) f.grad_record += double(Body::widths[l + 1]);
    }
    f.record = double((saved_total > 0 ? round_up_to_stat_slots(activations) : activations) + saved_total);
    return f;
  }
};

}  // namespace detail

/// Footprint of a stage (a LayerSeq: StageList::stage<k>) as stage `k` of its list.
template <class Seq>
constexpr StageFootprint stage_footprint(std::size_t k) {
  return StageFootprint{double(Seq::param_count), k == 0 ? 0.0 : double(Seq::in_features), double(Seq::out_features),
                        double(Seq::record_per_row), double(Seq::grad_record_per_row)};
}

/// Estimated bytes per worker of `Stages` run by `Schedule` with `microbatches` microbatches (a
/// constant expression when its arguments are; throws cupipe::error when the schedule rejects them).
template <class Stages, class Schedule>
constexpr std::array<double, Stages::size> estimated_stage_bytes(int microbatches, const MemoryModel& m) {
  const detail::Holdings<Stages::size> h = detail::holdings<Schedule, Stages::size>(microbatches);
  return [&]<std::size_t... K>(std::index_sequence<K...>) {
    return std::array<double, Stages::size>{footprint_bytes(stage_footprint<typename Stages::template stage<K>>(K), h.in_flight[K],
                                                            h.versions[K], Schedule::split_backward, m)...};
  }(std::make_index_sequence<Stages::size>());
}

namespace detail {

template <class Model, class Schedule, std::size_t P, int Microbatches, MemoryModel M, std::uint64_t Budget>
struct partition_within_impl {
  using body = typename Model::body;
  using sizes = layer_sizes<body>;
  static constexpr Holdings<P> held = holdings<Schedule, P>(Microbatches);
  static constexpr std::size_t L = body::size;
  static_assert(P >= 1 && P <= L, "partition_within<>: between 1 stage and one stage per layer");

  using costs = layer_cost_model<body>;
  static constexpr const auto& layer_costs = costs::costs;
  static constexpr const auto& starts_unit = costs::starts_unit;
  // Cuts fall as partition<>'s do: between units, unless there are fewer units than stages.
  static constexpr bool use_units = costs::units >= P;

  static constexpr double bytes(std::size_t first, std::size_t last, std::size_t k) {
    return footprint_bytes(sizes::range(first, last, k), held.in_flight[k], held.versions[k],
                           Schedule::split_backward, M);
  }

  struct Solution {
    std::array<std::size_t, P + 1> cuts{};
    bool fits = false;
  };
  // best[k][i]: the smallest possible slowest stage over splits of the first i layers into k stages
  // that each fit the budget (exact dynamic programme over contiguous splits).
  static constexpr Solution solution = [] {
    std::array<double, L + 1> prefix{};
    for (std::size_t i = 0; i < L; ++i) prefix[i + 1] = prefix[i] + layer_costs[i];
    constexpr double inf = 1e300;
    std::array<std::array<double, L + 1>, P + 1> best{};
    std::array<std::array<std::size_t, L + 1>, P + 1> cut{};
    for (auto& row : best) row.fill(inf);
    best[0][0] = 0;
    for (std::size_t k = 1; k <= P; ++k)
      for (std::size_t i = k; i <= L; ++i)
        for (std::size_t j = k - 1; j < i; ++j) {
          if (best[k - 1][j] >= inf || bytes(j, i, k - 1) > double(Budget)) continue;
          if (j > 0 && use_units && !starts_unit[j]) continue;
          const double stage_cost = prefix[i] - prefix[j];
          const double value = best[k - 1][j] > stage_cost ? best[k - 1][j] : stage_cost;
          if (value < best[k][i]) {
            best[k][i] = value;
            cut[k][i] = j;
          }
        }
    Solution s;
    s.fits = best[P][L] < inf;
    s.cuts[P] = L;
    if (s.fits)
      for (std::size_t k = P; k > 0; --k) s.cuts[k - 1] = cut[k][s.cuts[k]];
    else
      for (std::size_t k = 0; k < P; ++k) s.cuts[k] = k;  // any valid split, after the error below
    return s;
  }();
  static_assert(solution.fits,
                "partition_within<>: no split of this model into this many stages keeps every worker's estimated memory "
                "under the budget (estimated_stage_bytes<> shows what each stage of a split needs)");

  template <std::size_t K, std::size_t... J>
  static auto stage_type(std::index_sequence<J...>) {
    if constexpr (K + 1 == P && Model::has_loss)
      return Stage<typename body::template layer<solution.cuts[K] + J>..., typename Model::loss>{};
    else
      return Stage<typename body::template layer<solution.cuts[K] + J>...>{};
  }
  template <std::size_t... K>
  static auto list(std::index_sequence<K...>) {
    return StageList<decltype(stage_type<K>(std::make_index_sequence<solution.cuts[K + 1] - solution.cuts[K]>()))...>{};
  }
  using type = decltype(list(std::make_index_sequence<P>()));
};

}  // namespace detail

/// Model split into P stages for `Schedule` with `Microbatches` microbatches: the slowest stage (forward
/// FLOPs per sample, as partition<>) is as fast as it can be while every worker's estimated bytes
/// (estimated_stage_bytes<>) stay at most `BudgetBytes`. Cuts fall as partition<>'s do. An
/// impossible budget fails to compile with one sentence.
///   using Stages = partition_within<gpt::Model<cfg>, schedule::OneFOneB, 4, 8,
///                                   MemoryModel{.rows_per_microbatch = 8 * 1024}, 60'000'000'000>;
template <class Model, class Schedule, std::size_t P, int Microbatches, MemoryModel M, std::uint64_t BudgetBytes>
using partition_within = typename detail::partition_within_impl<Model, Schedule, P, Microbatches, M, BudgetBytes>::type;

}  // namespace cupipe
