// SPDX-License-Identifier: Apache-2.0
// The planner's search over layouts for one stage count, replica count and tensor-parallel degree:
// every policy and microbatch count, the balanced split, the simulated step and the memory estimate
// (search_layouts), with the helpers it prices them by (costs at a row count, contention on shared
// cores, state bytes; the links, sums and all-to-alls in communication.hpp).
#pragma once

#include <algorithm>
#include <array>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <limits>
#include <optional>
#include <sstream>
#include <string>
#include <string_view>
#include <vector>

#include "cupipe/core/error.hpp"
#include "cupipe/core/memory.hpp"
#include "cupipe/core/shape.hpp"
#include "cupipe/schedule/offload.hpp"
#include "cupipe/schedule/registry.hpp"
#include "cupipe/schedule/simulate.hpp"
#include "cupipe/schedule/weight_readers.hpp"

#include "cupipe/planner/activations.hpp"
#include "cupipe/planner/communication.hpp"
#include "cupipe/planner/cost_model.hpp"
#include "cupipe/planner/workers.hpp"

namespace cupipe::planner {

namespace detail {

inline bool named(const Request& r, std::string_view name) {
  return std::find(r.schedules.begin(), r.schedules.end(), name) != r.schedules.end();
}
inline bool wanted(const Request& r, std::string_view name) { return r.schedules.empty() || named(r, name); }

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

/// Seconds of a layer's action (0 forward, 1 input gradient, 2 weight gradient) for `rows` rows:
/// between the layer's measured points, or fixed + (time - fixed) x rows / profiled_rows.
inline double at_rows(const CostModel& model, const LayerCost& layer, int action, double rows) {
  const std::size_t a = std::size_t(action) + 1;
  if (layer.points.size() >= 2) {
    const auto& p = layer.points;
    std::size_t i = 0;
    while (i + 2 < p.size() && rows > p[i + 1][0]) ++i;  // the segment [i, i+1] holding rows, or an end one
    const double slope = (p[i + 1][a] - p[i][a]) / (p[i + 1][0] - p[i][0]);
    return std::max(0.0, p[i][a] + slope * (rows - p[i][0]));
  }
  const double time = action == 0 ? layer.forward : action == 1 ? layer.backward_input : layer.backward_weight;
  const double fixed = action == 0 ? layer.forward_fixed : action == 1 ? layer.backward_input_fixed : layer.backward_weight_fixed;
  return fixed + (time - fixed) * rows / double(model.profiled_rows);
}

/// The factor for `busy` workers computing at once on a machine of `cores` cores (0: unknown), from
/// `contention` (CostModel::contention, not empty): its entry where it has one; beyond it, its last
/// entry, and where `busy` exceeds the cores too, that times busy / max(entries, cores), since each
/// worker then has that share of a core (a last entry measured beyond the cores, processes of a
/// node that take turns, already holds the turns up to its count). 1 for no worker busy.
inline double contention_at(const std::vector<double>& contention, std::size_t busy, int cores) {
  if (busy == 0) return 1.0;
  if (busy <= contention.size()) return contention[busy - 1];
  const std::size_t saturated = std::max(contention.size(), std::size_t(std::max(cores, 0)));
  if (cores <= 0 || busy <= saturated) return contention.back();
  return contention.back() * double(busy) / double(saturated);
}

/// Per worker of `sim`, `contention` (CostModel::contention) averaged over the time the worker's
/// actions ran, each instant weighted by the factor for the workers busy on the machine then
/// (contention_at, on `cores` cores; 0: unknown): `per_busy` of them for each worker busy in `sim`
/// (replicas in one process: the replica count; processes of which only some share a node: fewer),
/// rounded up. All 1 where `contention` is empty. A worker w with `own_device[w]` set computes on a
/// device of its own (WorkerSpeed::own_device): it is never counted busy, and its factor is 1.
inline std::vector<double> contention_factors(const schedule::SimResult& sim, const std::vector<double>& contention,
                                              double per_busy = 1, int cores = 0, const std::vector<char>& own_device = {}) {
  if (contention.empty()) return std::vector<double>(sim.times.size(), 1.0);
  const auto apart = [&](std::size_t w) { return w < own_device.size() && own_device[w] != 0; };
  struct Edge {
    double time;
    int worker, delta;
  };
  std::vector<Edge> edges;
  for (std::size_t w = 0; w < sim.times.size(); ++w)
    for (const schedule::ActionTime& t : sim.times[w])
      if (t.end > t.start && !apart(w)) {
        edges.push_back({t.start, int(w), +1});
        edges.push_back({t.end, int(w), -1});
      }
  // Ends before starts at equal times: an action that ends as the next begins is not two at once.
  std::sort(edges.begin(), edges.end(), [](const Edge& a, const Edge& b) { return a.time != b.time ? a.time < b.time : a.delta < b.delta; });
  const std::size_t workers = sim.times.size();
  std::vector<int> running(workers, 0);
  std::vector<double> weighted(workers, 0), busy(workers, 0);
  int busy_workers = 0;
  for (std::size_t i = 0; i < edges.size(); ++i) {
    const Edge& e = edges[i];
    const int before = running[std::size_t(e.worker)];
    running[std::size_t(e.worker)] += e.delta;
    busy_workers += (running[std::size_t(e.worker)] > 0) - (before > 0);
    if (i + 1 == edges.size()) break;
    const double span = edges[i + 1].time - e.time;
    if (span <= 0 || busy_workers == 0) continue;
    const auto machine_busy = std::size_t(std::max(1.0, std::ceil(double(busy_workers) * per_busy - 1e-9)));
    const double factor = contention_at(contention, machine_busy, cores);
    for (std::size_t w = 0; w < workers; ++w)
      if (running[w] > 0) {
        weighted[w] += span * factor;
        busy[w] += span;
      }
  }
  std::vector<double> out(workers, 1.0);
  for (std::size_t w = 0; w < workers; ++w)
    if (busy[w] > 0) out[w] = weighted[w] / busy[w];
  return out;
}

/// Per worker, the parameter state by tag (cupipe::sharded_state_bytes, in the worker's bytes per
/// value): weights with the versions
/// `sim` says the plan holds, gradients and the optimizer's slots, sharded as `zero` says, the most
/// within a step (`in_step`) or between steps.
inline std::vector<StateBytes> state_bytes(const Request& request, const CostModel& model, const schedule::Plan& plan,
                                           const schedule::SimResult& sim, const std::vector<std::size_t>& cuts, ZeroSetting zero,
                                           bool in_step) {
  const std::size_t workers = std::size_t(plan.config.stages);
  std::vector<double> params(workers, 0.0), largest(workers, 0.0);
  for (int k = 0; k + 1 < int(cuts.size()); ++k) {
    double stage = 0;
    for (std::size_t l = cuts[std::size_t(k)]; l < cuts[std::size_t(k) + 1]; ++l) stage += model.layers[l].params;
    const std::size_t w = std::size_t(plan.placement.worker_of(k));
    params[w] += stage;
    largest[w] = std::max(largest[w], stage);
  }
  std::vector<StateBytes> bytes(workers);
  for (std::size_t w = 0; w < workers; ++w)
    bytes[w] = sharded_state_bytes(params[w], largest[w], value_bytes_of(request, model, w), compute_bytes_of(request, model, w),
                                   model.optimizer_slots,
                                   std::max(1, sim.weight_versions[w]), zero, in_step);
  return bytes;
}

/// The parameters ZeRO-3 gathers on worker w in one step of `plan`, as pipeline::ParameterShards
/// does: a virtual stage's whole parameters (`stage_params[k]`) before a forward or backward that
/// finds them released; with `reshard_after_forward` released after each action (not an
/// overlapped F) whose worker reads another stage's weights next (schedule::weight_readers), else
/// kept through the step.
inline double gathered_params(const schedule::Plan& plan, int w, const std::vector<double>& stage_params,
                              bool reshard_after_forward) {
  const std::vector<schedule::Action>& actions = plan.actions[std::size_t(w)];
  const schedule::WeightReaders readers = schedule::weight_readers(plan, w);
  std::vector<char> held(stage_params.size(), 0);
  double gathered = 0;
  for (std::size_t i = 0; i < actions.size(); ++i) {
    const int v = plan.virtual_stage(w, actions[i]);
    if (actions[i].kind != schedule::ActionKind::W && !held[std::size_t(v)]) {
      held[std::size_t(v)] = 1;
      gathered += stage_params[std::size_t(v)];
    }
    if (reshard_after_forward && !actions[i].overlap && readers.next_reader[i] != v) held[std::size_t(v)] = 0;
  }
  return gathered;
}

/// The values one replica's worker moves over the replicas per step, the most of any worker:
/// ZeRO-0's all-reduce or ZeRO-1 and 2's reduce-scatter and gather, 2 (d - 1) / d of its
/// parameters; ZeRO-3's reduce-scatter, (d - 1) / d of them, and its gathers (gathered_params).
inline double replica_traffic(const CostModel& model, const schedule::Plan& plan, const std::vector<std::size_t>& cuts, int d,
                              ZeroSetting zero) {
  if (d <= 1) return 0;
  std::vector<double> stage(cuts.size() - 1, 0.0);
  for (std::size_t k = 0; k + 1 < cuts.size(); ++k)
    for (std::size_t l = cuts[k]; l < cuts[k + 1]; ++l) stage[k] += model.layers[l].params;
  double most = 0;
  for (int w = 0; w < plan.config.stages; ++w) {
    double params = 0;
    for (std::size_t k = 0; k < stage.size(); ++k)
      if (plan.placement.worker_of(int(k)) == w) params += stage[k];
    const double moved = zero.stage >= 3 ? params + gathered_params(plan, w, stage, zero.reshard_after_forward) : 2.0 * params;
    most = std::max(most, moved);
  }
  return double(d - 1) / double(d) * most;
}

inline std::string gigabytes(double bytes) {
  std::ostringstream out;
  out.precision(3);
  out << bytes / 1e9 << " GB";
  return out.str();
}

}  // namespace detail

namespace detail {

/// One layout the search prices: a policy on p stages (v chunks each), d replicas and t
/// tensor-parallel ranks per stage, m microbatches, and the split of the layers into its virtual
/// stages; each replica a ring of cp context-parallel ranks (the model's rows per sample already
/// divided by cp), whose ranks shard and sum like replicas.
struct Candidate {
  const schedule::PolicyInfo& policy;
  int p, d, t, v, m;
  const std::vector<std::size_t>& cuts;
  const std::vector<ChunkSizes>& sizes;
  int zero = 0;  ///< the ZeRO stage (0 with one replica)
  /// The plan's placement, with unequal workers (Request::workers), whose speeds it prices by.
  const schedule::Placement* placement = nullptr;
  int cp = 1;
  int virtual_stages() const { return p * v; }
  ZeroSetting zero_setting() const { return {zero, d * cp, true}; }
};

/// Why `policy` cannot run on p stages, d replicas, t tensor-parallel ranks and rings of cp for
/// `request` before any split is tried (`samples` per replica); empty where it can.
inline std::string policy_refusal(const Request& request, const CostModel& model, const schedule::PolicyInfo& policy, int p,
                                  int d, int t, int cp, index_t samples) {
  const std::size_t layers = model.layers.size();
  const int virtual_stages = p * policy.default_chunks;
  if (std::size_t(virtual_stages) > layers)
    return std::to_string(virtual_stages) + " virtual stages for " + std::to_string(layers) + " layers";
  if (samples < 1) return "fewer samples than replicas";
  if (policy.update != schedule::UpdateRule::flush && !request.asynchronous && !named(request, policy.name))
    return "asynchronous: stale weights change what training computes; ask for it by name or with Request::asynchronous";
  if (model.tied && policy.update != schedule::UpdateRule::flush)
    return "the model ties weights (as GPT-2's lm_head to wte); only a flush update sums them";
  if (const int ep = model.expert_ranks; ep > 1) {
    if (d % ep != 0)
      return "expert-parallel groups of " + std::to_string(ep) + " form among the replicas: " + std::to_string(d) +
             " replica(s) are not a multiple";
    if (t > 1 || cp > 1) return "expert parallelism beside tensor or context parallelism is not modelled";
  }
  if (request.refuses) return request.refuses(policy.name, p, d, t, cp);
  return {};
}

/// Each microbatch's rows: the batches' samples split into microbatches as the runtime splits them
/// (split_rows: the first n % parts take one more); every time scales with the largest.
inline std::vector<double> microbatch_rows(const CostModel& model, index_t samples, const schedule::Config& config) {
  const index_t n = samples * config.batches;
  const int parts = config.total_microbatches();
  std::vector<double> rows(static_cast<std::size_t>(parts));
  for (int j = 0; j < parts; ++j)
    rows[std::size_t(j)] = double(n / parts + (j < n % parts ? 1 : 0)) * double(model.rows_per_sample);
  return rows;
}

/// Each virtual stage's own costs for microbatches of `r` rows (chunks of one worker may cost
/// differently).
inline std::vector<schedule::StageCosts> stage_costs(const Request& request, const CostModel& model, const Candidate& c,
                                                     double r) {
  const schedule::PolicyInfo& policy = c.policy;
  const int virtual_stages = c.virtual_stages();
  const std::vector<std::size_t>& cuts = c.cuts;
  std::vector<schedule::StageCosts> out(static_cast<std::size_t>(virtual_stages), schedule::StageCosts{0, 0, 0, 0});
  for (int k = 0; k < virtual_stages; ++k) {
    schedule::StageCosts& stage = out[std::size_t(k)];
    double chunk_params = 0;
    // Unequal workers: the times of the worker that runs this virtual stage.
    const WorkerSpeed* speed = speed_of(request, c.placement, k);
    const std::vector<LayerCost>& timed = speed ? speed->layers : model.layers;
    for (std::size_t l = cuts[std::size_t(k)]; l < cuts[std::size_t(k) + 1]; ++l) {
      const LayerCost& layer = model.layers[l];
      const LayerCost& times = timed[l];
      const double f = at_rows(model, times, 0, r), b = at_rows(model, times, 1, r), w = at_rows(model, times, 2, r);
      // The group sums run inside the action: the forward's (a row-parallel output) and the
      // input gradient's (a column-parallel input).
      const double sf = tensor_sum_seconds(model, c.t, layer.sum_forward_calls, r * layer.sum_forward);
      const double sb = tensor_sum_seconds(model, c.t, layer.sum_backward_calls, r * layer.sum_backward);
      // A ring's passes of the layer's keys and values (cp/ring_layer.hpp): cp - 1 forward, each
      // hidden behind the blocks computed meanwhile, cp - 1 backward likewise, and cp passes of their
      // gradients, which wait for the blocks.
      double rf = 0, rb = 0;
      if (c.cp > 1 && layer.ring_values > 0) {
        const double pass = link_seconds(model, r * layer.ring_values);
        rf = std::max(0.0, (c.cp - 1) * pass - f);
        rb = std::max(0.0, (c.cp - 1) * pass - b) + c.cp * pass;
      }
      stage.forward += f + sf + rf;
      stage.backward += policy.split_backward ? b + sb + rb : b + sb + rb + w;
      // A mixture of experts' dispatch and combine, in each F and again in each B (the simulator
      // hides them behind an overlapped partner's compute).
      stage.all_to_all += 2 * all_to_all_seconds(model, r * layer.all_to_all_values);
      stage.weight += policy.split_backward ? w : 0.0;
      chunk_params += layer.params;
    }
    // The runtime's own cost of each action (with the W inside the B where it is not split).
    stage.forward += model.action_overhead_seconds;
    stage.backward += model.action_overhead_seconds;
    if (policy.split_backward) stage.weight += model.action_overhead_seconds;
    // In one process the sender copies a message into the receiver's memory inside its action
    // (LocalTransport): F sends its output, B its input gradient.
    if (request.one_process) {
      if (k + 1 < virtual_stages) stage.forward += link_seconds(model, r * c.sizes[std::size_t(k)].out);
      if (k > 0) stage.backward += link_seconds(model, r * c.sizes[std::size_t(k)].in);
    }
    // Asynchronous schedules update inside the timeline, on the worker, each chunk its own
    // parameters: PipeDream after every microbatch's backward, 2BW once per batch (spread
    // over its microbatches here).
    if (policy.update != schedule::UpdateRule::flush)
      (policy.split_backward ? stage.weight : stage.backward) +=
          chunk_params * (speed ? speed->update_seconds_per_param : model.update_seconds_per_param) /
          (policy.update == schedule::UpdateRule::double_buffered ? double(c.m) : 1.0);
  }
  return out;
}

/// The simulator's costs of a step with microbatches of `rows`: the stages' own costs for each
/// microbatch size (at most two: a batch that does not split evenly), the hand-overs and wake-ups.
inline schedule::Costs step_costs(const Request& request, const CostModel& model, const Candidate& c,
                                  const std::vector<double>& rows) {
  const int virtual_stages = c.virtual_stages();
  const double largest_rows = *std::max_element(rows.begin(), rows.end());
  double widest = 0;
  for (int k = 1; k < virtual_stages; ++k) widest = std::max(widest, model.layers[c.cuts[std::size_t(k)]].in);
  schedule::Costs costs;
  const double smallest_rows = *std::min_element(rows.begin(), rows.end());
  if (smallest_rows == largest_rows) {
    costs.per_virtual_stage = stage_costs(request, model, c, largest_rows);
  } else {
    const std::vector<schedule::StageCosts> large = stage_costs(request, model, c, largest_rows),
                                            small = stage_costs(request, model, c, smallest_rows);
    for (double r : rows) costs.per_microbatch.push_back(r == largest_rows ? large : small);
  }
  // Between processes a hand-over delays its receiver without occupying the sender; in one
  // process the sender's copy is in its action (stage_costs) and a receiver that sat waiting for
  // it wakes wake_seconds later.
  costs.transfer = virtual_stages > 1 && !request.one_process ? model.link_latency + (model.link_bytes_per_second > 0
                                                                  ? largest_rows * widest * model.value_bytes / model.link_bytes_per_second
                                                                  : 0.0)
                                      : 0.0;
  costs.wake = request.one_process ? model.wake_seconds : 0.0;
  return costs;
}

/// `plan` simulated with `costs`, and again with each worker's costs slowed by the workers that
/// compute at the same time: each worker's actions take the contention factor averaged over the
/// time they ran, with as many workers busy as the first simulation says. Workers of one process
/// share its cores; across processes, the ranks one node holds share its cores alike, and
/// replicas and tensor ranks run the timeline the simulation has for one pipeline.
/// With `offload`, its copies are in the actions (schedule::simulate).
inline schedule::SimResult simulate_with_contention(const Request& request, const CostModel& model, const Candidate& c,
                                                    const schedule::Plan& plan, schedule::Costs costs,
                                                    const schedule::OffloadPlan* offload = nullptr) {
  const int p = c.p, d = c.d, t = c.t, virtual_stages = c.virtual_stages();
  schedule::SimResult sim = schedule::simulate(plan, costs, offload);
  // Workers on devices of their own (WorkerSpeed::own_device) take no share of the cores.
  const std::vector<char> own_device = own_devices(request);
  const int on_cores = p - int(std::count(own_device.begin(), own_device.end(), char(1)));
  const int sharing = request.one_process ? on_cores * d * t * c.cp : std::min(on_cores * d * t * c.cp, request.colocated);
  // One entry (an action alone) still charges turns on too few cores.
  if (sharing > 1 && !model.contention.empty() &&
      (model.contention.size() > 1 || (request.cores > 0 && sharing > request.cores))) {
    const std::vector<double> f =
        contention_factors(sim, model.contention, double(sharing) / double(on_cores), request.cores, own_device);
    const auto scale = [&](std::vector<schedule::StageCosts>& list) {
      for (int k = 0; k < virtual_stages; ++k) {
        schedule::StageCosts& stage = list[std::size_t(k)];
        const double x = f[std::size_t(plan.placement.worker_of(k))];
        stage = {stage.forward * x, stage.backward * x, stage.weight * x, stage.all_to_all};  // the links are not the cores
      }
    };
    if (!costs.per_virtual_stage.empty()) scale(costs.per_virtual_stage);
    for (std::vector<schedule::StageCosts>& list : costs.per_microbatch) scale(list);
    sim = schedule::simulate(plan, costs, offload);
  }
  return sim;
}

/// The layout `sim` predicts: its bubble, each worker's state and activation bytes (at the
/// simulated times and bounded over every timing), the replicas' gradient sum, a flush update and
/// the step's time. With `offload`, its stages and cap, and its moves in the activations.
inline Layout priced_layout(const Request& request, const CostModel& model, const Candidate& c, const schedule::Config& config,
                            const schedule::Plan& plan, const schedule::SimResult& sim, const std::vector<double>& rows,
                            const schedule::OffloadPlan* offload = nullptr) {
  const int d = c.d;
  const std::vector<double> params = worker_params(model, plan, c.cuts);
  Layout layout;
  layout.schedule = std::string(c.policy.name);
  layout.stages = c.p;
  layout.chunks = c.v;
  layout.microbatches = c.m;
  layout.replicas = d;
  layout.tensor = c.t;
  layout.context = c.cp;
  layout.batches = config.batches;
  layout.zero = c.zero;
  layout.cuts = c.cuts;
  for (const WorkerSpeed& w : request.workers) layout.worker_names.push_back(w.name);
  layout.bubble = sim.bubble_fraction;
  // Across processes a message takes its receiver's memory when the receiver takes it.
  const Landing landing = request.one_process ? Landing::at_send : Landing::at_receive;
  const std::vector<double> values = activation_peaks(plan, sim, c.sizes, rows, offload, landing);
  const ActivationBounds bounds = activation_bounds(plan, c.sizes, rows, offload, landing);
  layout.state_bytes = state_bytes(request, model, plan, sim, c.cuts, c.zero_setting(), true);
  layout.resting_state_bytes = state_bytes(request, model, plan, sim, c.cuts, c.zero_setting(), false);
  for (const StateBytes& s : layout.state_bytes) layout.peak_bytes.push_back(s.total());
  layout.most_bytes = layout.peak_bytes;
  for (std::size_t w = 0; w < values.size(); ++w) {
    const double value_bytes = double(value_bytes_of(request, model, w));
    layout.peak_activation_bytes.push_back(values[w] * value_bytes);
    layout.peak_activation_low_bytes.push_back(bounds.low[w] * value_bytes);
    layout.peak_activation_high_bytes.push_back(bounds.high[w] * value_bytes);
    layout.peak_bytes[w] += layout.peak_activation_bytes[w];
    layout.most_bytes[w] += layout.peak_activation_high_bytes[w];
  }
  if (d * c.cp > 1 && model.allreduce_bytes_per_second > 0)
    layout.allreduce_seconds = replica_traffic(model, plan, c.cuts, d * c.cp, c.zero_setting()) * model.gradient_bytes() /
                               model.allreduce_bytes_per_second;
  // A flush schedule updates after the step: every worker its own stages at once, or, in one
  // process, the calling thread every stage in turn.
  if (c.policy.update == schedule::UpdateRule::flush) {
    double update = 0;
    for (std::size_t w = 0; w < params.size(); ++w) {
      const double seconds = params[w] * update_rate_of(request, model, w);
      update = request.one_process ? update + seconds : std::max(update, seconds);
    }
    layout.update_seconds = update;
  }
  layout.step_seconds =
      (sim.makespan + layout.update_seconds + model.step_overhead_seconds) / double(config.batches) + layout.allreduce_seconds;
  layout.exposed_all_to_all_seconds = layout.unpaired_all_to_all_seconds =
      sim.total_exposed_communication() / double(config.batches);
  return layout;
}

/// Why `layout` does not fit the request's device memory; empty where it fits.
inline std::string memory_refusal(const Request& request, const Layout& layout) {
  for (std::size_t w = 0; w < layout.most_bytes.size(); ++w) {
    const double cap = memory_of(request, w);
    if (cap > 0 && layout.most_bytes[w] > cap)
      return "worker " + std::to_string(w) + " needs " + gigabytes(layout.most_bytes[w]) + ", over the " + gigabytes(cap) +
             (request.workers.empty() ? " a device has" : " it has");
  }
  return {};
}

/// `over` (a layout over the request's device memory) with activation offload (Request::offload):
/// the virtual stages of every worker over the memory keep the most forward records resident that
/// fit, from one fewer than the plan holds down to 1 (schedule::plan_offload). Each move costs the
/// largest such record's bytes over CostModel::offload_bytes_per_second inside its action, as the
/// runtime's synchronous copies do. Empty where offload is off or unmeasured, or nothing fits.
inline std::optional<Layout> offloaded_layout(const Request& request, const CostModel& model, const Candidate& c,
                                              const schedule::Config& config, const schedule::Plan& plan,
                                              const std::vector<double>& rows, const Layout& over) {
  if (!request.offload || model.offload_bytes_per_second <= 0) return std::nullopt;
  std::vector<int> stages;
  const double largest_rows = *std::max_element(rows.begin(), rows.end());
  double record_bytes = 0;
  for (int k = 0; k < c.virtual_stages(); ++k) {
    const auto w = std::size_t(plan.placement.worker_of(k));
    if (memory_of(request, w) > 0 && over.most_bytes[w] > memory_of(request, w)) {
      stages.push_back(k);
      record_bytes =
          std::max(record_bytes, largest_rows * c.sizes[std::size_t(k)].record * double(value_bytes_of(request, model, w)));
    }
  }
  if (stages.empty()) return std::nullopt;
  schedule::Costs costs = step_costs(request, model, c, rows);
  costs.offload = record_bytes / model.offload_bytes_per_second;
  const std::vector<int> held = schedule::plan_offload(plan, stages, config.total_microbatches()).peak_resident;
  for (int resident = *std::max_element(held.begin(), held.end()) - 1; resident >= 1; --resident) {
    const schedule::OffloadPlan offload = schedule::plan_offload(plan, stages, resident);
    const schedule::SimResult sim = simulate_with_contention(request, model, c, plan, costs, &offload);
    Layout layout = priced_layout(request, model, c, config, plan, sim, rows, &offload);
    if (!memory_refusal(request, layout).empty()) continue;
    layout.offload = stages;
    layout.offload_resident = resident;
    return layout;
  }
  return std::nullopt;
}

/// Every policy and microbatch count for p stages, d replicas and t tensor-parallel ranks per stage,
/// each replica a ring of cp, into `report`; `model` holds the per-rank layers of t (the request's
/// model for t = 1) and a ring rank's rows per sample.
template <class List, class Split>
void search_layouts(const Request& request, const CostModel& model, int p, int d, int t, Split& split_into, Report& report,
                    int cp = 1) {
  const index_t samples = request.batch / d;  // per replica (the first batch % d replicas take one more)
  const std::string tensor_suffix =
      (t > 1 ? " t=" + std::to_string(t) : std::string()) + (cp > 1 ? " cp=" + std::to_string(cp) : std::string());
  for (const schedule::PolicyInfo& policy : schedule::policy_table<List>()) {
    if (!wanted(request, policy.name)) continue;
    const int v = policy.default_chunks, virtual_stages = p * v;
    const std::string base = std::string(policy.name) + " p=" + std::to_string(p);
    const std::string where = base + " d=" + std::to_string(d) + tensor_suffix;
    if (std::string why = policy_refusal(request, model, policy, p, d, t, cp, samples); !why.empty()) {
      ++report.considered;
      report.rejected.push_back({where, std::move(why)});
      continue;
    }
    // The program's split for the count (Request::split; for equal workers, the balanced one by
    // default). Unequal workers without it: the bottleneck partition for the policy's placement
    // and, where the cut points allow few, every other split (detail::planned_splits), once the
    // policy's first plan is known.
    const bool unequal = !request.workers.empty(), partition = unequal && !request.split;
    std::vector<std::vector<std::size_t>> splits;
    if (!partition) {
      splits.push_back(split_into(virtual_stages));
      if (splits.front().empty()) {
        ++report.considered;
        report.rejected.push_back({where, "the program has no split into " + std::to_string(virtual_stages) + " virtual stages"});
        continue;
      }
    }
    std::vector<std::vector<ChunkSizes>> sizes;
    for (const std::vector<std::size_t>& cuts : splits) sizes.push_back(chunk_sizes(model, cuts));
    // Every layout counted as considered is either ranked or refused, one each (a microbatch
    // count priced with several ZeRO stages or splits is as many layouts).
    for (int m : microbatch_candidates(p, samples, request.max_microbatches)) {
      const schedule::Config config{p, m, v, policy.default_batches};
      const std::string name = base + " m=" + std::to_string(m) + " d=" + std::to_string(d) + tensor_suffix;
      if (const std::string_view why = policy.check(config); !why.empty()) {
        ++report.considered;
        report.rejected.push_back({name, std::string(why)});
        continue;
      }
      const schedule::Plan plan = policy.generate(config);
      if (partition && splits.empty()) {
        splits = planned_splits(request, model, plan.placement);
        if (splits.empty()) {
          ++report.considered;
          report.rejected.push_back({where, "no split of the layers at the allowed cut points fits every worker's memory"});
          break;
        }
        for (const std::vector<std::size_t>& cuts : splits) sizes.push_back(chunk_sizes(model, cuts));
      }
      const schedule::Placement* placement = unequal ? &plan.placement : nullptr;
      const std::vector<double> rows = microbatch_rows(model, samples, config);
      // ZeRO shards over replicas, and only a flush update (PipelineOptions::zero), whose tensors
      // are the same on every replica (not an expert group's).
      std::vector<int> zeros{0};
      if (d * cp > 1 && policy.update == schedule::UpdateRule::flush && !request.zero_stages.empty() && model.expert_ranks == 1)
        zeros = request.zero_stages;
      for (std::size_t i = 0; i < splits.size(); ++i) {
        const std::vector<std::size_t>& cuts = splits[i];
        const Candidate unsharded{policy, p, d, t, v, m, cuts, sizes[i], 0, placement, cp};
        const schedule::Costs costs = step_costs(request, model, unsharded, rows);
        const schedule::SimResult sim = simulate_with_contention(request, model, unsharded, plan, costs);
        // The all-to-alls the overlapped pairs hid: the step again with each pair back to back.
        std::optional<double> unpaired;
        if (model.expert_ranks > 1 && schedule::has_pairs(plan))
          unpaired = simulate_with_contention(request, model, unsharded, schedule::without_pairs(plan), costs)
                         .total_exposed_communication() /
                     double(config.batches);
        for (const int zero : zeros) {
          ++report.considered;
          const Candidate candidate{policy, p, d, t, v, m, cuts, sizes[i], zero, placement, cp};
          std::string named = zeros.size() > 1 ? name + " zero=" + std::to_string(zero) : name;
          if (splits.size() > 1) named += " split=" + split_text(cuts);
          Layout layout = priced_layout(request, model, candidate, config, plan, sim, rows);
          if (std::string why = memory_refusal(request, layout); !why.empty()) {
            std::optional<Layout> offloaded = offloaded_layout(request, model, candidate, config, plan, rows, layout);
            if (!offloaded) {
              report.rejected.push_back({named, std::move(why)});
              continue;
            }
            layout = std::move(*offloaded);
          }
          if (unpaired) layout.unpaired_all_to_all_seconds = *unpaired;
          report.ranked.push_back(std::move(layout));
        }
      }
    }
  }
}

}  // namespace detail

}  // namespace cupipe::planner
