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
//   worker's peak bytes from the simulated in-flight microbatches and weight versions.
// A layout a policy refuses, that needs more virtual stages than there are layers, or whose
// estimate exceeds the memory per device, is never proposed; each is listed with its reason.
// Tensor parallelism is not searched yet: cupipe does not run it (issue #14).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <sstream>
#include <string>
#include <string_view>
#include <vector>

#include "cupipe/core/error.hpp"
#include "cupipe/core/shape.hpp"
#include "cupipe/schedule/registry.hpp"
#include "cupipe/schedule/simulate.hpp"

namespace cupipe::planner {

/// One layer: measured (or modelled) times and its sizes.
struct LayerCost {
  std::string name;
  double forward = 0;          ///< seconds for a microbatch of CostModel::profiled_rows rows
  double backward_input = 0;   ///< seconds, same microbatch (0 for the first layer)
  double backward_weight = 0;  ///< seconds, same microbatch
  double params = 0;           ///< parameter elements
  double in = 0;               ///< input width (values per row)
  double out = 0;              ///< output width
  double saved = 0;            ///< values per row kept for the backward besides the output
};

struct CostModel {
  std::vector<LayerCost> layers;
  index_t profiled_rows = 1;    ///< rows of the microbatch the times were measured on
  index_t rows_per_sample = 1;  ///< a sequence's tokens for a transformer
  int value_bytes = 4;          ///< bytes per value (8 for double)
  int optimizer_slots = 2;      ///< AdamW: 2
  double link_latency = 0;      ///< seconds per hand-over between stages
  double link_bytes_per_second = 0;       ///< hand-over bandwidth; 0: free
  double allreduce_bytes_per_second = 0;  ///< data-parallel gradient sum bandwidth; 0: free
};

struct Request {
  CostModel model;
  int devices = 1;
  double memory_bytes = 0;  ///< per device; 0: no limit
  index_t batch = 1;        ///< samples per optimizer step, over all replicas
  std::vector<std::string> schedules{};  ///< policies to consider; empty: every one of the registry
  int max_microbatches = 64;
  std::size_t runners_up = 5;
};

/// One layout and what the cost model predicts for it.
struct Layout {
  std::string schedule;
  int stages = 1;        ///< pipeline workers
  int chunks = 1;        ///< virtual stages per worker
  int microbatches = 1;  ///< per step and replica
  int replicas = 1;      ///< data-parallel degree
  int batches = 1;       ///< batches a step runs (asynchronous schedules: 2)
  std::vector<std::size_t> cuts;    ///< first layer of each virtual stage, then the layer count
  double step_seconds = 0;          ///< predicted, per batch (one optimizer step for flush schedules)
  double bubble = 0;                ///< predicted idle share
  double allreduce_seconds = 0;     ///< predicted gradient sum across replicas, in step_seconds
  std::vector<double> peak_bytes;   ///< predicted per worker
  double samples_per_second() const { return step_seconds > 0 ? 1.0 / step_seconds : 0; }
  std::string describe() const;
};

struct Rejected {
  std::string layout;  ///< "1f1b p=4 m=8 d=2"
  std::string reason;
};

struct Report {
  std::vector<Layout> ranked;     ///< best first: every layout that fits and that its policy accepts
  std::vector<Rejected> rejected;
  std::size_t considered = 0;
  const Layout& best() const {
    CUPIPE_REQUIRE(!ranked.empty(), "planner: no layout fits (", rejected.size(), " refused; see Report::rejected)");
    return ranked.front();
  }
};

inline std::string Layout::describe() const {
  std::ostringstream out;
  out << schedule << " p=" << stages << " v=" << chunks << " m=" << microbatches << " d=" << replicas;
  return out.str();
}

namespace detail {

/// The contiguous split of `cost` (per layer) into `parts` non-empty ranges whose largest sum is
/// smallest; first index of each range, then cost.size(). Dynamic programming, O(parts x n^2).
inline std::vector<std::size_t> balanced_cuts(const std::vector<double>& cost, int parts) {
  const std::size_t n = cost.size(), k = std::size_t(parts);
  CUPIPE_REQUIRE(parts >= 1 && k <= n, "planner: cannot split ", n, " layers into ", parts, " stages");
  std::vector<double> prefix(n + 1, 0);
  for (std::size_t i = 0; i < n; ++i) prefix[i + 1] = prefix[i] + cost[i];
  constexpr double inf = std::numeric_limits<double>::infinity();
  // best[j][i]: smallest largest-part over the first i layers in j parts; from[j][i]: start of part j.
  std::vector<std::vector<double>> best(k + 1, std::vector<double>(n + 1, inf));
  std::vector<std::vector<std::size_t>> from(k + 1, std::vector<std::size_t>(n + 1, 0));
  best[0][0] = 0;
  for (std::size_t j = 1; j <= k; ++j)
    for (std::size_t i = j; i <= n - (k - j); ++i)
      for (std::size_t s = j - 1; s < i; ++s) {
        const double candidate = std::max(best[j - 1][s], prefix[i] - prefix[s]);
        if (candidate < best[j][i]) {
          best[j][i] = candidate;
          from[j][i] = s;
        }
      }
  std::vector<std::size_t> cuts(k + 1);
  cuts[k] = n;
  for (std::size_t j = k, i = n; j >= 1; --j) {
    cuts[j - 1] = from[j][i];
    i = from[j][i];
  }
  return cuts;
}

inline bool wanted(const Request& r, std::string_view name) {
  return r.schedules.empty() || std::find(r.schedules.begin(), r.schedules.end(), name) != r.schedules.end();
}

/// Microbatch counts worth trying: powers of two, and multiples of the stage count (2p for DualPipeV).
inline std::vector<int> microbatch_candidates(int p, index_t samples, int most) {
  std::vector<int> out;
  const int limit = int(std::min<index_t>(samples, most));
  for (int m = 1; m <= limit; m *= 2) out.push_back(m);
  for (int f : {1, 2, 3, 4}) {
    const int m = f * p;
    if (m <= limit) out.push_back(m);
  }
  std::sort(out.begin(), out.end());
  out.erase(std::unique(out.begin(), out.end()), out.end());
  return out;
}

/// Parameter elements each worker holds: its virtual stages' layers under `cuts` on `plan`'s placement.
inline std::vector<double> worker_params(const CostModel& model, const schedule::Plan& plan, const std::vector<std::size_t>& cuts) {
  std::vector<double> params(static_cast<std::size_t>(plan.config.stages), 0.0);
  for (int k = 0; k + 1 < int(cuts.size()); ++k)
    for (std::size_t l = cuts[std::size_t(k)]; l < cuts[std::size_t(k) + 1]; ++l)
      params[std::size_t(plan.placement.worker_of(k))] += model.layers[l].params;
  return params;
}

/// Per-worker peak bytes of `cuts` on `plan` (its placement), from the simulated holdings; `params`
/// is worker_params().
inline std::vector<double> peak_bytes(const CostModel& model, const schedule::Plan& plan, const schedule::SimResult& sim,
                                      const std::vector<std::size_t>& cuts, const std::vector<double>& params, double rows) {
  const int workers = plan.config.stages;
  std::vector<double> per_microbatch(std::size_t(workers), 0), one_backward(std::size_t(workers), 0);
  for (int k = 0; k + 1 < int(cuts.size()); ++k) {
    const int w = plan.placement.worker_of(k);
    double record = 0, grad_record = 0;
    const std::size_t first = cuts[std::size_t(k)], last = cuts[std::size_t(k) + 1];
    for (std::size_t l = first; l < last; ++l) {
      record += model.layers[l].out + model.layers[l].saved;
      if (l + 1 < last) grad_record += model.layers[l].out;
    }
    const double in = k == 0 ? 0.0 : model.layers[first].in, out = model.layers[last - 1].out;
    // In flight: input message and record (and, with B and W split, dy and the grad record until W).
    per_microbatch[std::size_t(w)] = std::max(per_microbatch[std::size_t(w)],
                                              in + record + (plan.split_backward ? out + grad_record : 0.0));
    one_backward[std::size_t(w)] = std::max(one_backward[std::size_t(w)], plan.split_backward ? in : out + grad_record + in);
  }
  std::vector<double> bytes(static_cast<std::size_t>(workers));
  for (int w = 0; w < workers; ++w) {
    const int versions = std::max(1, sim.weight_versions[std::size_t(w)]);
    const double state = params[std::size_t(w)] * double(versions + 1 + model.optimizer_slots);
    bytes[std::size_t(w)] = double(model.value_bytes) *
                            (state + double(sim.peak_activations[std::size_t(w)]) * rows * per_microbatch[std::size_t(w)] +
                             rows * one_backward[std::size_t(w)]);
  }
  return bytes;
}

inline std::string gigabytes(double bytes) {
  std::ostringstream out;
  out.precision(3);
  out << bytes / 1e9 << " GB";
  return out.str();
}

}  // namespace detail

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
  for (const std::string& name : request.schedules) (void)schedule::find_policy<List>(name);  // names every valid one
  std::vector<double> total(layers);
  for (std::size_t l = 0; l < layers; ++l) {
    const LayerCost& c = model.layers[l];
    CUPIPE_REQUIRE(c.forward >= 0 && c.backward_input >= 0 && c.backward_weight >= 0 && c.params >= 0,
                   "planner: layer ", l, " (", c.name, ") has a negative cost or size");
    total[l] = c.forward + c.backward_input + c.backward_weight;
  }
  Report report;
  std::vector<std::vector<std::size_t>> cuts_for(layers + 1);  // by virtual stage count
  for (int p = 1; p <= request.devices; ++p) {
    if (request.devices % p != 0) continue;
    const int d = request.devices / p;
    const index_t samples = request.batch / d;  // per replica (the first batch % d replicas take one more)
    for (const schedule::PolicyInfo& policy : schedule::policy_table<List>()) {
      if (!detail::wanted(request, policy.name)) continue;
      const int v = policy.default_chunks, virtual_stages = p * v;
      const std::string base = std::string(policy.name) + " p=" + std::to_string(p);
      if (std::size_t(virtual_stages) > layers) {
        ++report.considered;
        report.rejected.push_back({base + " d=" + std::to_string(d), std::to_string(virtual_stages) +
                                                                        " virtual stages for " + std::to_string(layers) + " layers"});
        continue;
      }
      if (samples < 1) {
        ++report.considered;
        report.rejected.push_back({base + " d=" + std::to_string(d), "fewer samples than replicas"});
        continue;
      }
      std::vector<std::size_t>& cuts = cuts_for[std::size_t(virtual_stages)];
      if (cuts.empty()) cuts = detail::balanced_cuts(total, virtual_stages);
      for (int m : detail::microbatch_candidates(p, samples, request.max_microbatches)) {
        ++report.considered;
        const schedule::Config config{p, m, v, policy.default_batches};
        const std::string name = base + " m=" + std::to_string(m) + " d=" + std::to_string(d);
        if (const std::string_view why = policy.check(config); !why.empty()) {
          report.rejected.push_back({name, std::string(why)});
          continue;
        }
        const schedule::Plan plan = policy.generate(config);
        // Rows of the largest microbatch; every time scales with it.
        const double rows = double((samples + m - 1) / m) * double(model.rows_per_sample);
        const double scale = rows / double(model.profiled_rows);
        schedule::Costs costs;
        costs.per_stage.assign(std::size_t(p), schedule::StageCosts{0, 0, 0});
        double widest = 0;
        for (int k = 0; k < virtual_stages; ++k) {
          schedule::StageCosts& c = costs.per_stage[std::size_t(plan.placement.worker_of(k))];
          for (std::size_t l = cuts[std::size_t(k)]; l < cuts[std::size_t(k) + 1]; ++l) {
            const LayerCost& layer = model.layers[l];
            c.forward += scale * layer.forward;
            c.backward += scale * (policy.split_backward ? layer.backward_input : layer.backward_input + layer.backward_weight);
            c.weight += policy.split_backward ? scale * layer.backward_weight : 0.0;
          }
          if (k > 0) widest = std::max(widest, model.layers[cuts[std::size_t(k)]].in);
        }
        // simulate gives a chunk 1/V of its worker's costs: the worker's costs are its chunks' sum.
        costs.transfer = virtual_stages > 1 ? model.link_latency + (model.link_bytes_per_second > 0
                                                                        ? rows * widest * model.value_bytes / model.link_bytes_per_second
                                                                        : 0.0)
                                            : 0.0;
        const schedule::SimResult sim = schedule::simulate(plan, costs);
        Layout layout;
        layout.schedule = std::string(policy.name);
        layout.stages = p;
        layout.chunks = v;
        layout.microbatches = m;
        layout.replicas = d;
        layout.batches = config.batches;
        layout.cuts = cuts;
        layout.bubble = sim.bubble_fraction;
        const std::vector<double> params = detail::worker_params(model, plan, cuts);
        layout.peak_bytes = detail::peak_bytes(model, plan, sim, cuts, params, rows);
        const double most_params = *std::max_element(params.begin(), params.end());
        if (d > 1 && model.allreduce_bytes_per_second > 0)
          layout.allreduce_seconds = 2.0 * double(d - 1) / double(d) * most_params * model.value_bytes /
                                     model.allreduce_bytes_per_second;
        layout.step_seconds = sim.makespan / double(config.batches) + layout.allreduce_seconds;
        if (request.memory_bytes > 0) {
          const auto most = std::max_element(layout.peak_bytes.begin(), layout.peak_bytes.end());
          if (*most > request.memory_bytes) {
            report.rejected.push_back({name, "worker " + std::to_string(most - layout.peak_bytes.begin()) + " needs " +
                                                 detail::gigabytes(*most) + ", over the " +
                                                 detail::gigabytes(request.memory_bytes) + " a device has"});
            continue;
          }
        }
        report.ranked.push_back(std::move(layout));
      }
    }
  }
  std::stable_sort(report.ranked.begin(), report.ranked.end(), [](const Layout& a, const Layout& b) {
    if (a.step_seconds != b.step_seconds) return a.step_seconds < b.step_seconds;
    return *std::max_element(a.peak_bytes.begin(), a.peak_bytes.end()) <
           *std::max_element(b.peak_bytes.begin(), b.peak_bytes.end());
  });
  return report;
}

/// Why `layout` lost to `best`, in a few words.
inline std::string why_slower(const Layout& layout, const Layout& best) {
  std::ostringstream out;
  out.precision(3);
  out << (layout.step_seconds / best.step_seconds - 1) * 100 << "% slower";
  if (layout.bubble > best.bubble + 1e-9) out << "; bubble " << layout.bubble << " vs " << best.bubble;
  if (layout.allreduce_seconds > best.allreduce_seconds) out << "; gradient sum " << layout.allreduce_seconds << " s";
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
      << "  step " << best.step_seconds * 1e3 << " ms, bubble " << best.bubble << ", gradient sum " << best.allreduce_seconds * 1e3
      << " ms\n";
  for (std::size_t k = 0; k + 1 < best.cuts.size(); ++k) {
    out << "  virtual stage " << k << ": layers " << best.cuts[k] << ".." << best.cuts[k + 1] - 1;
    if (!model.layers.empty()) out << " (" << model.layers[best.cuts[k]].name << " .. " << model.layers[best.cuts[k + 1] - 1].name << ")";
    out << "\n";
  }
  for (std::size_t w = 0; w < best.peak_bytes.size(); ++w)
    out << "  worker " << w << ": peak " << detail::gigabytes(best.peak_bytes[w]) << " (predicted)\n";
  out << "runners-up:\n";
  for (std::size_t i = 1; i < std::min(report.ranked.size(), runners_up + 1); ++i)
    out << "  " << report.ranked[i].describe() << ": step " << report.ranked[i].step_seconds * 1e3 << " ms, "
        << why_slower(report.ranked[i], best) << "\n";
  out << report.considered << " layouts considered, " << report.ranked.size() << " fit, " << report.rejected.size()
      << " refused\n";
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
