// SPDX-License-Identifier: Apache-2.0
// The planner: picks a parallel layout (stages, chunks, microbatches, schedule, data-parallel replicas
// and the layer split) from a cost model, and says what it predicts for each layout it considered.
//
// The cost model is per layer: F, B (input gradient) and W (weight gradient) seconds for a microbatch
// of a profiled size (cupipe::profile_layers measures them on the backend at hand; times scale
// linearly in rows), parameter counts and the per-row values a layer keeps for its backward (the
// allocation pattern of the runtime, as in memory_plan.hpp), and the costs of a hand-over between
// stages and of the data-parallel gradient sum. The search:
//   for every stage count p dividing the device count (replicas d = devices / p),
//   every policy of the registry (its own chunk count V), every microbatch count m it accepts,
//   the contiguous split of the layers into p x V virtual stages that minimises the slowest one,
//   generate the policy's plan, simulate it with the split's per-worker costs, and estimate each
//   worker's peak bytes: parameters, gradients, optimizer slots and the weight versions the plan
//   holds, plus the activations, by replaying the runtime's allocations (StageExecutor's records,
//   messages, dy, grad records and dx) in the simulated time (detail::activation_peaks).
// A layout a policy refuses, that needs more virtual stages than there are layers, or whose
// estimate exceeds the memory per device, is never proposed; each is listed with its reason.
// Tensor parallelism (Request::tensor_degrees): a degree t > 1 takes its per-rank layer costs from
// the model's profile of its t-way split (CostModel::tensor_variants: each layer's part timed alone
// on one rank, the values it sums over the group counted, planner::calibrate_tensor_parts), adds
// the group sums' time (CostModel::tensor_sum_latency, tensor_sum_bytes_per_second) to the
// action that runs them, and needs stages x replicas x t devices.
// The parts: cost_model.hpp (CostModel, Request, Layout, Report), activations.hpp (activation peaks
// and bounds), search.hpp (search_layouts and its pricing); this file holds the entry points.
#pragma once

#include <algorithm>
#include <array>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <limits>
#include <sstream>
#include <string>
#include <string_view>
#include <vector>

#include "cupipe/core/error.hpp"
#include "cupipe/core/memory.hpp"
#include "cupipe/core/shape.hpp"
#include "cupipe/planner/activations.hpp"
#include "cupipe/planner/cost_model.hpp"
#include "cupipe/planner/search.hpp"
#include "cupipe/planner/workers.hpp"
#include "cupipe/schedule/registry.hpp"
#include "cupipe/schedule/simulate.hpp"

namespace cupipe::planner {

/// The microbatch counts the search tries for any of `stage_counts` on `samples` samples (one
/// replica's) and at most `most` microbatches: what planner::calibrate should profile so that no
/// microbatch size of a layout is interpolated.
inline std::vector<int> planned_microbatch_counts(const std::vector<int>& stage_counts, index_t samples, int most) {
  std::vector<int> out;
  for (const int p : stage_counts)
    for (const int m : detail::microbatch_candidates(p, samples, most)) out.push_back(m);
  std::sort(out.begin(), out.end());
  out.erase(std::unique(out.begin(), out.end()), out.end());
  return out;
}

/// Searches every layout of `request` (see the file comment) and ranks those that fit. Also
/// reachable as cupipe::plan(request).
template <class List = schedule::Policies>
Report search(const Request& request) {
  const CostModel& model = request.model;
  const std::size_t layers = model.layers.size();
  CUPIPE_REQUIRE(layers >= 1, "planner: the cost model has no layers");
  CUPIPE_REQUIRE(request.devices >= 1, "planner: devices must be at least 1, got ", request.devices);
  CUPIPE_REQUIRE(request.batch >= 1, "planner: the batch must hold at least one sample, got ", request.batch);
  CUPIPE_REQUIRE(model.profiled_rows >= 1 && model.rows_per_sample >= 1, "planner: profiled_rows and rows_per_sample must be positive");
  CUPIPE_REQUIRE(request.max_microbatches >= 1, "planner: max_microbatches must be at least 1");
  CUPIPE_REQUIRE(model.update_seconds_per_param >= 0 && model.step_overhead_seconds >= 0 && model.action_overhead_seconds >= 0 &&
                     model.wake_seconds >= 0,
                 "planner: update_seconds_per_param, step_overhead_seconds, action_overhead_seconds and wake_seconds must not be "
                 "negative");
  CUPIPE_REQUIRE(request.colocated >= 0, "planner: colocated counts the workers that share a machine; got ", request.colocated);
  CUPIPE_REQUIRE(request.cores >= 0, "planner: cores counts the machine's cores (0: unknown); got ", request.cores);
  for (std::size_t n = 0; n < model.contention.size(); ++n)
    CUPIPE_REQUIRE(model.contention[n] > 0 && std::isfinite(model.contention[n]), "planner: contention[", n,
                   "] (an action's time with ", n + 1, " workers busy over its time alone) must be positive, got ",
                   model.contention[n]);
  CUPIPE_REQUIRE(model.contention.empty() || model.contention[0] == 1.0,
                 "planner: contention[0] is an action alone, the profile itself: it must be 1, got ",
                 model.contention.empty() ? 0.0 : model.contention[0]);
  for (const std::string& name : request.schedules) (void)schedule::find_policy<List>(name);  // names every valid one
  const auto check_layers = [&](const std::vector<LayerCost>& list, const std::string& where) {
    for (std::size_t l = 0; l < list.size(); ++l) {
      const LayerCost& c = list[l];
      CUPIPE_REQUIRE(c.forward >= 0 && c.backward_input >= 0 && c.backward_weight >= 0 && c.params >= 0 &&
                         c.sum_forward >= 0 && c.sum_backward >= 0 && c.sum_forward_calls >= 0 && c.sum_backward_calls >= 0,
                     "planner: ", where, "layer ", l, " (", c.name, ") has a negative cost or size");
      CUPIPE_REQUIRE(c.forward_fixed >= 0 && c.forward_fixed <= c.forward && c.backward_input_fixed >= 0 &&
                         c.backward_input_fixed <= c.backward_input && c.backward_weight_fixed >= 0 &&
                         c.backward_weight_fixed <= c.backward_weight,
                     "planner: ", where, "layer ", l, " (", c.name, ") has a fixed part outside [0, its time]");
      for (std::size_t i = 0; i < c.points.size(); ++i)
        CUPIPE_REQUIRE(c.points[i][0] > 0 && (i == 0 || c.points[i][0] > c.points[i - 1][0]) && c.points[i][1] >= 0 &&
                           c.points[i][2] >= 0 && c.points[i][3] >= 0,
                       "planner: ", where, "layer ", l, " (", c.name,
                       ") has points that are not ascending positive rows with times >= 0");
    }
  };
  check_layers(model.layers, "");
  for (const std::size_t c : request.cut_points)
    CUPIPE_REQUIRE(c >= 1 && c < layers, "planner: cut point ", c, " is not between two of the ", layers, " layers (1 to ",
                   layers - 1, ")");
  for (std::size_t w = 0; w < request.workers.size(); ++w) {
    const WorkerSpeed& speed = request.workers[w];
    const std::string where = "worker " + std::to_string(w) + " (" + speed.name + ")";
    CUPIPE_REQUIRE(speed.layers.size() == layers, "planner: ", where, " has times for ", speed.layers.size(),
                   " layers, the model ", layers);
    check_layers(speed.layers, where + "'s ");
    CUPIPE_REQUIRE(speed.update_seconds_per_param >= 0 && speed.memory_bytes >= 0 && speed.value_bytes >= 0 &&
                       speed.compute_bytes >= 0,
                   "planner: ", where, " has a negative update time, memory or byte count");
    CUPIPE_REQUIRE(speed.profiled_rows == 0 || speed.profiled_rows == model.profiled_rows, "planner: ", where,
                   " was timed on ", speed.profiled_rows, " rows, the model on ", model.profiled_rows,
                   "; calibrate every worker on the same batch");
  }
  if (!request.workers.empty()) {
    const int workers = int(request.workers.size());
    CUPIPE_REQUIRE(request.devices == workers, "planner: ", workers, " unequal workers (Request::workers) are the devices; "
                   "devices is ", request.devices);
    CUPIPE_REQUIRE(request.stage_counts.empty() || std::find(request.stage_counts.begin(), request.stage_counts.end(), workers) !=
                                                       request.stage_counts.end(),
                   "planner: ", workers, " unequal workers are ", workers, " stages, which stage_counts leaves out");
    for (const int t : request.tensor_degrees)
      CUPIPE_REQUIRE(t == 1, "planner: unequal workers are planned without tensor parallelism; tensor degree ", t, " asked for");
  }
  CUPIPE_REQUIRE(request.max_replicas >= 0, "planner: max_replicas must not be negative");
  for (const int zero : request.zero_stages)
    CUPIPE_REQUIRE(zero >= 0 && zero <= 3, "planner: ZeRO stages are 0 to 3 (PipelineOptions::zero), got ", zero);
  for (int p : request.stage_counts)
    CUPIPE_REQUIRE(p >= 1, "planner: stage counts must be positive, got ", p);
  CUPIPE_REQUIRE(model.tensor_sum_latency >= 0 && model.tensor_sum_bytes_per_second >= 0,
                 "planner: tensor_sum_latency and tensor_sum_bytes_per_second must not be negative");
  // Per tensor degree, the per-rank model: the request's own for 1, else its variant.
  std::vector<int> degrees = request.tensor_degrees.empty() ? std::vector<int>{1} : request.tensor_degrees;
  std::sort(degrees.begin(), degrees.end());
  degrees.erase(std::unique(degrees.begin(), degrees.end()), degrees.end());
  std::vector<CostModel> per_degree;
  for (int t : degrees) {
    CUPIPE_REQUIRE(t >= 1, "planner: tensor-parallel degrees must be positive, got ", t);
    CUPIPE_REQUIRE(t == 1 || !request.one_process, "planner: tensor degree ", t,
                   " asked for in one process; tensor-parallel ranks are processes (Request::one_process plans t = 1)");
    CostModel m = model;
    m.tensor_variants.clear();
    if (t > 1) {
      const auto v = std::find_if(model.tensor_variants.begin(), model.tensor_variants.end(),
                                  [&](const TensorVariant& x) { return x.degree == t; });
      CUPIPE_REQUIRE(v != model.tensor_variants.end(), "planner: tensor-parallel degree ", t,
                     " was asked for, but the cost model has no profile of the model split ", t,
                     " ways (CostModel::tensor_variants; planner::calibrate_tensor_parts measures one)");
      CUPIPE_REQUIRE(v->layers.size() == layers, "planner: the ", t, "-way tensor-parallel profile has ", v->layers.size(),
                     " layers, the model ", layers);
      check_layers(v->layers, "the " + std::to_string(t) + "-way tensor-parallel profile's ");
      m.layers = v->layers;
    }
    per_degree.push_back(std::move(m));
  }
  // Per ring size, a ring rank's rows of a sample.
  const std::vector<int> rings = request.context_degrees.empty() ? std::vector<int>{1} : request.context_degrees;
  for (const int cp : rings) {
    CUPIPE_REQUIRE(cp >= 1, "planner: context-parallel degrees must be positive, got ", cp);
    CUPIPE_REQUIRE(cp == 1 || model.rows_per_sample % (2 * cp) == 0, "planner: context-parallel degree ", cp,
                   ": samples of ", model.rows_per_sample, " rows do not cut into ", 2 * cp, " equal chunks");
    CUPIPE_REQUIRE(cp == 1 || !request.one_process, "planner: context-parallel degree ", cp,
                   " asked for in one process; a context-parallel ring's ranks are processes");
    CUPIPE_REQUIRE(cp == 1 || request.workers.empty(), "planner: unequal workers are planned without context parallelism");
  }
  CUPIPE_REQUIRE(model.expert_ranks >= 1, "planner: CostModel::expert_ranks must be at least 1, got ", model.expert_ranks);
  CUPIPE_REQUIRE(model.expert_ranks == 1 || !request.one_process, "planner: expert groups of ", model.expert_ranks,
                 " in one process; an expert group's ranks are processes");
  CUPIPE_REQUIRE(model.expert_ranks == 1 || request.workers.empty(),
                 "planner: unequal workers are planned without expert parallelism");
  Report report;
  for (std::size_t i = 0; i < degrees.size(); ++i) for (const int cp : rings) {
    const int t = degrees[i];
    CostModel m = per_degree[i];
    m.rows_per_sample /= cp;
    const std::vector<double> total = detail::layer_totals(m.layers);
    // Splits by virtual stage count; an empty one: the program has none.
    std::vector<std::vector<std::size_t>> cuts_for(layers + 1);
    std::vector<char> cuts_known(layers + 1, 0);
    const auto split_into = [&](int virtual_stages) -> const std::vector<std::size_t>& {
      const auto n = std::size_t(virtual_stages);
      if (!cuts_known[n]) {
        cuts_known[n] = 1;
        if (request.split) {
          cuts_for[n] = request.split(virtual_stages);
        } else if (request.cut_points.empty()) {
          cuts_for[n] = detail::balanced_cuts(total, virtual_stages);
        } else {  // some splits: the balanced one among them (memory is the layout's to check)
          cuts_for[n] = detail::bottleneck_cuts({total}, std::vector<int>(n, 0), request.cut_points);
        }
        const std::vector<std::size_t>& c = cuts_for[n];
        CUPIPE_REQUIRE(c.empty() || (c.size() == n + 1 && c.front() == 0 && c.back() == layers &&
                                     std::is_sorted(c.begin(), c.end()) &&
                                     std::adjacent_find(c.begin(), c.end()) == c.end()),
                       "planner: the split for ", virtual_stages, " virtual stages is not ", virtual_stages,
                       " non-empty contiguous ranges of the ", layers, " layers");
      }
      return cuts_for[n];
    };
    for (int p = 1; p * t * cp <= request.devices; ++p) {
      if (!request.stage_counts.empty() &&
          std::find(request.stage_counts.begin(), request.stage_counts.end(), p) == request.stage_counts.end())
        continue;
      for (int d = 1; p * d * t * cp <= request.devices; ++d) {
        if (request.all_devices && p * d * t * cp != request.devices) continue;
        if (!request.workers.empty() && (p != request.devices || d != 1)) continue;  // a worker is a stage
        if (request.max_replicas > 0 && d > request.max_replicas) continue;
        detail::search_layouts<List>(request, m, p, d, t, split_into, report, cp);
      }
    }
  }
  std::stable_sort(report.ranked.begin(), report.ranked.end(), [](const Layout& a, const Layout& b) {
    if (a.step_seconds != b.step_seconds) return a.step_seconds < b.step_seconds;
    return *std::max_element(a.peak_bytes.begin(), a.peak_bytes.end()) <
           *std::max_element(b.peak_bytes.begin(), b.peak_bytes.end());
  });
  if (request.cores > 0 && !report.ranked.empty()) {
    const Layout& best = report.ranked.front();
    const int sharing = request.one_process ? best.stages * best.replicas * best.tensor * best.context : request.colocated;
    if (sharing > request.cores)
      report.caveats.push_back(std::to_string(sharing) + (request.one_process ? " workers" : " processes") + " share " +
                               std::to_string(request.cores) +
                               " cores: they take turns on them, and the cost model charges the slowdown measured for "
                               "that many workers (beyond it, each its share of a core), not the waits for a turn "
                               "(4 processes on 2 cores measured 1-41% slower than predicted: docs/planner.md)");
    // Overlapped pairs hide an all-to-all behind their partner's compute; on shared cores each
    // exchange also waits for the other rank's turn, which nothing here prices.
    if (sharing > request.cores && best.unpaired_all_to_all_seconds > best.exposed_all_to_all_seconds)
      report.caveats.push_back("the overlapped pairs' all-to-alls are priced as hidden behind their partners, but with " +
                               std::to_string(sharing) + " processes on " + std::to_string(request.cores) +
                               " cores an exchange also waits for the other rank's turn on a core: DualPipeV with expert "
                               "groups of 2 measured 17 ms of exposed all-to-all a step against 2.7 ms predicted, 1F1B "
                               "1.6 ms against 2.5 (docs/benchmarks.md, 2026-12-06)");
  }
  return report;
}

/// Why `layout` lost to `best`, in a few words.
inline std::string why_slower(const Layout& layout, const Layout& best) {
  std::ostringstream out;
  out.precision(3);
  out << (layout.step_seconds / best.step_seconds - 1) * 100 << "% slower";
  if (layout.bubble > best.bubble + 1e-9) out << "; bubble " << layout.bubble << " vs " << best.bubble;
  if (layout.allreduce_seconds > best.allreduce_seconds) out << "; gradient sum " << layout.allreduce_seconds << " s";
  if (layout.exposed_all_to_all_seconds > best.exposed_all_to_all_seconds)
    out << "; exposed all-to-all " << layout.exposed_all_to_all_seconds << " s";
  const double peak = *std::max_element(layout.peak_bytes.begin(), layout.peak_bytes.end()),
               best_peak = *std::max_element(best.peak_bytes.begin(), best.peak_bytes.end());
  if (layout.step_seconds == best.step_seconds && peak > best_peak)
    out << "; as fast, a peak of " << detail::gigabytes(peak) << " against " << detail::gigabytes(best_peak);
  return out.str();
}

/// The report as text: the best layout, its split and memory, the runners-up and why they lost, and
/// the count of refused layouts with a few reasons.
inline std::string describe(const Report& report, const CostModel& model, std::size_t runners_up = 5) {
  std::ostringstream out;
  out.precision(4);
  if (report.ranked.empty()) {
    out << "no layout fits (" << report.considered << " considered)\n";
    for (std::size_t i = 0; i < std::min<std::size_t>(report.rejected.size(), 10); ++i)
      out << "  " << report.rejected[i].layout << ": " << report.rejected[i].reason << "\n";
    return out.str();
  }
  const Layout& best = report.best();
  out << "best: " << best.describe() << " (predicted, from the cost model)\n"
      << "  step " << best.step_seconds * 1e3 << " ms, bubble " << best.bubble << ", update " << best.update_seconds * 1e3
      << " ms, gradient sum " << best.allreduce_seconds * 1e3 << " ms\n";
  if (model.expert_ranks > 1)
    out << "  all-to-alls over expert groups of " << model.expert_ranks << ": " << best.exposed_all_to_all_seconds * 1e3
        << " ms exposed a step, summed over the workers (" << best.unpaired_all_to_all_seconds * 1e3
        << " ms with the overlapped pairs run back to back)\n";
  if (!best.offload.empty())
    out << "  activation offload: its virtual stages keep at most " << best.offload_resident
        << " forward records on the device (PipelineOptions::offload, offload_resident); the copies are in the step\n";
  // The layer names of the split the best layout runs (a tensor-parallel part's own names).
  const std::vector<LayerCost>* names = &model.layers;
  for (const TensorVariant& v : model.tensor_variants)
    if (v.degree == best.tensor && v.layers.size() == model.layers.size()) names = &v.layers;
  for (std::size_t k = 0; k + 1 < best.cuts.size(); ++k) {
    out << "  virtual stage " << k << ": layers " << best.cuts[k] << ".." << best.cuts[k + 1] - 1;
    if (!names->empty()) out << " (" << (*names)[best.cuts[k]].name << " .. " << (*names)[best.cuts[k + 1] - 1].name << ")";
    out << "\n";
  }
  for (std::size_t w = 0; w < best.peak_bytes.size(); ++w) {
    out << "  worker " << w;
    if (w < best.worker_names.size()) out << " (" << best.worker_names[w] << ")";
    out << ": peak " << detail::gigabytes(best.peak_bytes[w]) << ", of it activations "
        << detail::gigabytes(best.peak_activation_bytes[w]) << " (predicted); whatever the timing, activations "
        << detail::gigabytes(best.peak_activation_low_bytes[w]) << " to " << detail::gigabytes(best.peak_activation_high_bytes[w])
        << ", at most " << detail::gigabytes(best.most_bytes[w]) << " in all\n";
    if (best.zero > 0 && w < best.resting_state_bytes.size()) {
      const StateBytes& s = best.resting_state_bytes[w];
      out << "    ZeRO-" << best.zero << " over " << best.replicas << " replicas, between steps: weights "
          << detail::gigabytes(s.weights) << ", gradients " << detail::gigabytes(s.gradients) << ", optimizer "
          << detail::gigabytes(s.optimizer) << " (predicted)\n";
    }
  }
  out << "runners-up:\n";
  for (std::size_t i = 1; i < std::min(report.ranked.size(), runners_up + 1); ++i)
    out << "  " << report.ranked[i].describe() << ": step " << report.ranked[i].step_seconds * 1e3 << " ms, "
        << why_slower(report.ranked[i], best) << "\n";
  out << report.considered << " layouts considered, " << report.ranked.size() << " fit, " << report.rejected.size()
      << " refused\n";
  if (model.calibration_rounds == 1)
    out << "calibration: one round of each profile (CUPIPE_CALIBRATION=quick), so how far the prediction may be off "
           "was not measured\n";
  else if (model.calibration_rounds > 1)
    out << "calibration: the profiles' repeated rounds (up to " << model.calibration_rounds << " each) spread by at most "
        << 100 * model.calibration_spread << "% (median absolute deviation): read the predicted step as about that sure\n";
  for (const std::string& caveat : report.caveats) out << "caveat: " << caveat << "\n";
  return out.str();
}

}  // namespace cupipe::planner

namespace cupipe {
/// The planner (planner/planner.hpp): the ranked layouts for a request.
template <class List = schedule::Policies>
planner::Report plan(const planner::Request& request) {
  return planner::search<List>(request);
}
}  // namespace cupipe
