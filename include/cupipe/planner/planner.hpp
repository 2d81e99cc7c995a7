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
#include "cupipe/schedule/registry.hpp"
#include "cupipe/schedule/simulate.hpp"

namespace cupipe::planner {

/// One layer: measured (or modelled) times and its sizes.
struct LayerCost {
  std::string name;
  double forward = 0;          ///< seconds for a microbatch of CostModel::profiled_rows rows
  double backward_input = 0;   ///< seconds, same microbatch (0 for the first layer, unless its W needs it)
  double backward_weight = 0;  ///< seconds, same microbatch
  double params = 0;           ///< parameter elements
  double in = 0;               ///< input width (values per row)
  double out = 0;              ///< output width
  double saved = 0;            ///< values per row kept for the backward besides the output
  /// The part of each time that does not scale with the rows (a launch, a sleep's overshoot, a
  /// loop's setup): a microbatch of r rows takes fixed + (time - fixed) x r / profiled_rows.
  double forward_fixed = 0, backward_input_fixed = 0, backward_weight_fixed = 0;
  /// Measured (rows, F, B, W) at several sizes, ascending rows; when set, a microbatch's times
  /// follow them piecewise linearly (beyond the ends, the nearest segment's line) instead of the
  /// fixed-plus-linear model above. planner::calibrate measures three sizes.
  std::vector<std::array<double, 4>> points{};
  /// Tensor-parallel parts (CostModel::tensor_variants): values per row this layer sums over its
  /// tensor-parallel group in the forward and in the input gradient, and the sums (calls) per action.
  double sum_forward = 0, sum_backward = 0;
  double sum_forward_calls = 0, sum_backward_calls = 0;
};

/// One tensor-parallel degree's per-rank layers: the same layer list split `degree` ways (times,
/// parameters, widths and saved values of one rank's part; the sums it runs). Its times are for the
/// whole model's CostModel::profiled_rows, as calibrate_tensor_parts measures them (or its own
/// LayerCost::points, which carry their rows).
struct TensorVariant {
  int degree = 1;
  std::vector<LayerCost> layers;
};

struct CostModel {
  std::vector<LayerCost> layers;
  index_t profiled_rows = 1;    ///< rows of the microbatch the times were measured on
  index_t rows_per_sample = 1;  ///< a sequence's tokens for a transformer
  int value_bytes = 4;          ///< bytes per stored value: weights in use, activations, messages (8 for double, 2 for bf16)
  int optimizer_slots = 2;      ///< AdamW: 2
  int compute_bytes = 0;        ///< bytes per gradient, optimizer and master value (fp32 for bf16 storage); 0: value_bytes
  double link_latency = 0;      ///< seconds per hand-over between stages
  double link_bytes_per_second = 0;       ///< hand-over bandwidth; 0: free
  double allreduce_bytes_per_second = 0;  ///< data-parallel gradient sum bandwidth; 0: free
  double update_seconds_per_param = 0;    ///< the optimizer step with its norm, per parameter
  /// What a training step takes beyond its actions and update (staging the batch, allocations,
  /// reading the loss, waking the workers), once per step; planner::calibrate measures it.
  double step_overhead_seconds = 0;
  /// What the runtime adds to each F, B and W action beyond its layers' profiled times (dispatch,
  /// the record's allocation, clocks, the mailbox); planner::action_overhead_seconds measures it.
  /// Layouts of many small microbatches or many chunks pay it more often.
  double action_overhead_seconds = 0;
  /// In one process: how long after a message is posted a worker blocked in its mailbox waiting for
  /// it starts to run (the operating system's wake-up). It delays the receiver, not the sender, and
  /// only where the receiver already waits; planner::wake_seconds measures it. Between processes
  /// the link's latency holds it.
  double wake_seconds = 0;
  /// Workers that share a machine's cores (threads of one process, or the processes of one node,
  /// Request::colocated): entry n - 1 is how much longer an action takes while n workers compute
  /// at once than alone (they share caches and memory bandwidth, and beyond the cores they
  /// time-slice); entry 0 is 1, and more workers than entries take the last, times
  /// n / max(entries, Request::cores) where they also outnumber the cores (detail::contention_at;
  /// planner::calibrate measures as many as the machine has cores, or as the launcher put
  /// processes on this node, 2 to 8). Empty: none (a device backend, whose workers each have a
  /// device).
  /// planner::contention measures it.
  std::vector<double> contention{};
  /// The model split over tensor-parallel groups, per degree (empty: no tensor parallelism).
  std::vector<TensorVariant> tensor_variants{};
  /// A sum over a tensor-parallel group: seconds per call and bandwidth (bytes of one rank's values
  /// per second, as a ring all-reduce moves 2 (t - 1) / t of them); 0: free.
  double tensor_sum_latency = 0;
  double tensor_sum_bytes_per_second = 0;
  /// The model ties a layer to another (GPT-2's lm_head to wte): only a flush update sums the copies,
  /// so the asynchronous schedules cannot train it.
  bool tied = false;

  /// Bytes of one gradient value (what the replicas sum).
  int gradient_bytes() const { return compute_bytes > 0 ? compute_bytes : value_bytes; }
};

struct Request {
  CostModel model;
  int devices = 1;
  double memory_bytes = 0;  ///< per device; 0: no limit
  index_t batch = 1;        ///< samples per optimizer step, over all replicas
  std::vector<std::string> schedules{};  ///< policies to consider; empty: every one of the registry
  int max_microbatches = 64;
  std::size_t runners_up = 5;
  /// Stage counts to consider; empty: every count that fits the devices.
  std::vector<int> stage_counts{};
  /// Tensor-parallel degrees to consider; empty: {1}. Each degree above 1 needs its variant in the
  /// cost model (CostModel::tensor_variants).
  std::vector<int> tensor_degrees{};
  int max_replicas = 0;     ///< most data-parallel replicas; 0: no limit (1 for an in-process host run)
  bool all_devices = true;  ///< stages x replicas = devices; false: at most devices (the rest idle)
  /// The split a program can run, for a virtual stage count: first layer of each virtual stage,
  /// then the layer count (a compiled StageList's, cupipe::stage_cuts). Empty function: the balanced
  /// split. An empty result: the program has no split into that many stages (the layout is refused).
  std::function<std::vector<std::size_t>(int virtual_stages)> split{};
  /// Consider the asynchronous schedules (PipeDream, 2BW) too. They change the arithmetic of
  /// training (stale weights), so they are never proposed unless asked for, here or by name.
  bool asynchronous = false;
  /// The workers are threads of one process (an in-process host or multi-GPU run): a flush update
  /// runs every stage's optimizer step in turn on the calling thread, and every worker shares the
  /// machine's cores (CostModel::contention).
  bool one_process = false;
  /// Across processes: how many of the layout's workers share one machine's cores, as a launcher
  /// puts ranks on a node (planner::processes_on_this_node()); their actions slow each other as
  /// CostModel::contention says. 0 or 1: each worker has a machine (or a device) to itself.
  /// Ignored with one_process. Ranks that plan together must all pass the same count (e.g. the
  /// first rank's), or their plans may differ.
  int colocated = 0;
  /// The cores of the machine the workers share (std::thread::hardware_concurrency()); 0: unknown.
  /// Known, more workers computing at once than the cores and than CostModel::contention's entries
  /// each take their share of a core (detail::contention_at). Where the best layout puts more
  /// workers on the machine than there are cores (one_process: its workers; across processes:
  /// `colocated`), the report says its prediction is weaker there (Report::caveats): the workers
  /// take turns on the cores, and the cost model charges their shares, not the waits for a turn.
  /// std::thread::hardware_concurrency() counts the machine's cores, not a container's CPU quota:
  /// under a quota, pass the quota.
  int cores = 0;
  /// What the program cannot run, beyond what the policies and `split` refuse: given a schedule's
  /// name, the stages, the replicas and the tensor-parallel ranks, the reason it cannot (the layout
  /// is then refused with it), or an empty string. Empty function: it runs every layout.
  std::function<std::string(std::string_view schedule, int stages, int replicas, int tensor)> refuses{};
};

/// One layout and what the cost model predicts for it.
struct Layout {
  std::string schedule;
  int stages = 1;        ///< pipeline workers
  int chunks = 1;        ///< virtual stages per worker
  int microbatches = 1;  ///< per step and replica
  int replicas = 1;      ///< data-parallel degree
  int tensor = 1;        ///< tensor-parallel ranks per stage
  int batches = 1;       ///< batches a step runs (asynchronous schedules: 2)
  std::vector<std::size_t> cuts;    ///< first layer of each virtual stage, then the layer count
  double step_seconds = 0;          ///< predicted, per batch (one optimizer step for flush schedules)
  double bubble = 0;                ///< predicted idle share
  double allreduce_seconds = 0;     ///< predicted gradient sum across replicas, in step_seconds
  double update_seconds = 0;        ///< predicted flush update after the step, in step_seconds
  std::vector<double> peak_bytes;   ///< predicted per worker: state and peak_activation_bytes
  /// Per worker: state and peak_activation_high_bytes, the most any timing can need; what the memory
  /// cap is checked against, so a race between workers cannot take a layout over it.
  std::vector<double> most_bytes;
  std::vector<double> peak_activation_bytes;  ///< predicted per worker at the simulated times: the allocator's activations tag
  /// Per worker, the least and most activation peak over every timing the plan allows
  /// (detail::activation_bounds): a measured peak lies between them whatever the machine does.
  std::vector<double> peak_activation_low_bytes, peak_activation_high_bytes;
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
  /// Where a prediction is known to be weaker than the cost model's usual accuracy, one sentence
  /// each (Request::cores).
  std::vector<std::string> caveats;
  const Layout& best() const {
    CUPIPE_REQUIRE(!ranked.empty(), "planner: no layout fits (", rejected.size(), " refused; see Report::rejected)");
    return ranked.front();
  }
};

inline std::string Layout::describe() const {
  std::ostringstream out;
  out << schedule << " p=" << stages << " v=" << chunks << " m=" << microbatches << " d=" << replicas;
  if (tensor > 1) out << " t=" << tensor;
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

/// Seconds of a hand-over of `values` values.
inline double link_seconds(const CostModel& model, double values) {
  return model.link_latency + (model.link_bytes_per_second > 0 ? values * model.value_bytes / model.link_bytes_per_second : 0.0);
}

/// Seconds of one rank's share of `calls` sums over a tensor-parallel group of `t` ranks that
/// together sum `values` values per rank (a ring all-reduce moves 2 (t - 1) / t of them).
inline double tensor_sum_seconds(const CostModel& model, int t, double calls, double values) {
  if (t <= 1 || (calls == 0 && values == 0)) return 0.0;
  const double bytes = 2.0 * double(t - 1) / double(t) * values * model.gradient_bytes();  // bf16 sums in fp32
  return calls * model.tensor_sum_latency + (model.tensor_sum_bytes_per_second > 0 ? bytes / model.tensor_sum_bytes_per_second : 0.0);
}

/// Values per row of one virtual stage: what its forward receives (0 for the first: the staged
/// batch), sends, keeps (every layer's output and saved values) and the backward's per-layer output
/// gradients.
struct ChunkSizes {
  double in = 0, out = 0, record = 0, grad_record = 0;
};

inline std::vector<ChunkSizes> chunk_sizes(const CostModel& model, const std::vector<std::size_t>& cuts) {
  std::vector<ChunkSizes> sizes(cuts.size() - 1);
  for (std::size_t k = 0; k + 1 < cuts.size(); ++k) {
    const std::size_t first = cuts[k], last = cuts[k + 1];
    ChunkSizes& c = sizes[k];
    c.in = k == 0 ? 0.0 : model.layers[first].in;
    c.out = model.layers[last - 1].out;
    for (std::size_t l = first; l < last; ++l) {
      c.record += model.layers[l].out + model.layers[l].saved;
      if (l + 1 < last) c.grad_record += model.layers[l].out;
    }
  }
  return sizes;
}

/// What one action of worker `w` does to the activation values (times rows) StageExecutor and the
/// in-process transport allocate (see activation_peaks): allocated at its start, freed at its end,
/// and the message it sends, placed on worker `to` (-1: none).
struct ActionValues {
  double allocate = 0, free = 0, message = 0;
  int to = -1;
};

inline ActionValues action_values(const schedule::Plan& plan, const std::vector<ChunkSizes>& sizes,
                                  const std::vector<double>& rows, int w, const schedule::Action& a) {
  const int last = plan.config.virtual_stages() - 1;
  const int k = plan.virtual_stage(w, a);
  const ChunkSizes& c = sizes[std::size_t(k)];
  const double r = rows[std::size_t(a.microbatch)];
  ActionValues v;
  switch (a.kind) {
    case schedule::ActionKind::F:
      v.allocate = r * c.record;
      if (k < last) v = {v.allocate, 0, r * c.out, plan.placement.worker_of(k + 1)};
      break;
    case schedule::ActionKind::B:
      v.allocate = r * (c.grad_record + c.in + (k == last ? c.out : 0.0));
      v.free = r * c.in;  // dx
      if (k > 0) {
        v.message = r * sizes[std::size_t(k - 1)].out;
        v.to = plan.placement.worker_of(k - 1);
      }
      break;
    case schedule::ActionKind::W: break;
  }
  // What the microbatch holds on this stage from its F to its finish: input message, record, dy
  // and grad record.
  if (a.kind == schedule::ActionKind::W || (a.kind == schedule::ActionKind::B && !plan.split_backward))
    v.free += r * (c.in + c.record + c.out + c.grad_record);
  return v;
}

/// Each worker's peak activation values (times rows) when `plan` runs with `sim`'s timing: the
/// allocations of StageExecutor and the in-process transport replayed in simulated time.
///   F of virtual stage k: at its start the record (rows x record); at its end the output message
///     on the worker of k+1 (rows x out), unless k is the last.
///   B: at its start dy (the last stage's loss gradient, rows x out; others received it as a
///     message), the grad record and dx (rows x in, k > 0); at its end dx is sent (a message on the
///     worker of k-1) and freed; without a split backward the microbatch finishes: its input message,
///     record, dy and grad record are freed.
///   W: at its end the microbatch finishes as above.
/// At equal times messages come first (a message that lands as the receiver finishes an action may
/// land before its frees: the estimate takes the larger peak), then frees, then allocations at an
/// action's start.
/// `rows[j]` is microbatch j's rows.
inline std::vector<double> activation_peaks(const schedule::Plan& plan, const schedule::SimResult& sim,
                                            const std::vector<ChunkSizes>& sizes, const std::vector<double>& rows) {
  struct Event {
    double time;
    int order;  // 0 message, 1 free, 2 allocation at a start
    int worker;
    double values;
  };
  std::vector<Event> events;
  for (int w = 0; w < plan.config.stages; ++w) {
    const auto& actions = plan.actions[std::size_t(w)];
    for (std::size_t i = 0; i < actions.size(); ++i) {
      const ActionValues v = action_values(plan, sizes, rows, w, actions[i]);
      const schedule::ActionTime t = sim.times[std::size_t(w)][i];
      events.push_back({t.start, 2, w, v.allocate});
      if (v.to >= 0) events.push_back({t.end, 0, v.to, v.message});
      if (v.free > 0) events.push_back({t.end, 1, w, -v.free});
    }
  }
  std::sort(events.begin(), events.end(), [](const Event& a, const Event& b) {
    return a.time != b.time ? a.time < b.time : a.order < b.order;
  });
  std::vector<double> now(std::size_t(plan.config.stages), 0), peak(std::size_t(plan.config.stages), 0);
  for (const Event& e : events) {
    double& v = now[std::size_t(e.worker)];
    v += e.values;
    peak[std::size_t(e.worker)] = std::max(peak[std::size_t(e.worker)], v);
  }
  return peak;
}

/// Each worker's least and most activation peak (values times rows) over every timing the plan
/// allows: what activation_peaks replays at the simulated times, bounded without any times at all.
/// A worker's own allocations and frees happen in its program order; only where its neighbours'
/// messages land among them depends on timing. A message can land no earlier than just after the
/// last action of the receiver that happens before its send (vector clocks over the plan's program
/// order and its messages: that action's send is on the chain, its frees need not be), and no later
/// than just before the first receiver action that its send happens before (at the latest the one
/// that takes it). An earlier landing only adds to the receiver's values at every later point, so
/// landing every message at its earliest gives the most (`high`) and at its latest the least
/// (`low`); a measured peak outside [low, high] means the replay's accounting, not the timing, is
/// wrong. A message to the sender's own worker (one worker, several chunks) lands as the send ends.
/// The model is one step in one process (LocalTransport allocates a message in its receiver as
/// it is sent) without PipelineOptions::recompute (which frees a forward's record and allocates
/// it again in the backward); overlapped steps (post-validation) and transports that allocate at
/// the receive are outside it. Mailbox capacity only removes timings, so it is left out.
struct ActivationBounds {
  std::vector<double> low, high;  ///< per worker
};

inline ActivationBounds activation_bounds(const schedule::Plan& plan, const std::vector<ChunkSizes>& sizes,
                                          const std::vector<double>& rows) {
  const int workers = plan.config.stages, last = plan.config.virtual_stages() - 1;
  const std::size_t W = std::size_t(workers);
  // Node n: action i of worker w, numbered worker by worker.
  std::vector<std::size_t> first(W + 1, 0);
  for (std::size_t w = 0; w < W; ++w) first[w + 1] = first[w] + plan.actions[w].size();
  const std::size_t nodes = first[W];
  int microbatches = 0;
  for (const auto& actions : plan.actions)
    for (const schedule::Action& a : actions) microbatches = std::max(microbatches, a.microbatch + 1);
  // Which node runs F and B of (virtual stage, microbatch); -1 where the plan has none.
  const std::size_t per_kind = std::size_t(last + 1) * std::size_t(microbatches);
  std::vector<std::ptrdiff_t> node_of(2 * per_kind, -1);
  const auto slot = [&](schedule::ActionKind kind, int k, int j) {
    return (kind == schedule::ActionKind::F ? 0 : per_kind) + std::size_t(k) * std::size_t(microbatches) + std::size_t(j);
  };
  for (std::size_t w = 0; w < W; ++w)
    for (std::size_t i = 0; i < plan.actions[w].size(); ++i) {
      const schedule::Action& a = plan.actions[w][i];
      if (a.kind != schedule::ActionKind::W) node_of[slot(a.kind, plan.virtual_stage(int(w), a), a.microbatch)] = std::ptrdiff_t(first[w] + i);
    }
  // The node whose message `n` takes at its start (-1: none): F of k takes F of k-1's output, B of k
  // takes B of k+1's input gradient. An overlapped F takes its partner B's gradient as well
  // (StageExecutor::take_partner_input), so the pair's second input counts at the F.
  const auto sender = [&](std::size_t w, std::size_t i) -> std::ptrdiff_t {
    const schedule::Action& a = plan.actions[w][i];
    const int k = plan.virtual_stage(int(w), a);
    if (a.kind == schedule::ActionKind::F && k > 0) return node_of[slot(a.kind, k - 1, a.microbatch)];
    if (a.kind == schedule::ActionKind::B && k < last) return node_of[slot(a.kind, k + 1, a.microbatch)];
    return -1;
  };
  std::vector<std::array<std::ptrdiff_t, 2>> takes(nodes, {-1, -1});
  for (std::size_t w = 0; w < W; ++w)
    for (std::size_t i = 0; i < plan.actions[w].size(); ++i) {
      takes[first[w] + i][0] = sender(w, i);
      const auto& list = plan.actions[w];
      if (list[i].overlap && list[i].kind == schedule::ActionKind::F && i + 1 < list.size() &&
          list[i + 1].kind == schedule::ActionKind::B)
        takes[first[w] + i][1] = sender(w, i + 1);
    }
  // clock[n * W + v]: the last action of worker v whose send happens before node n ends (its own
  // worker: n itself); -1 for none. Filled in an order the plan's dependencies allow.
  std::vector<int> clock(nodes * W, -1);
  std::vector<char> done(nodes, 0);
  std::vector<std::size_t> next(W, 0);
  for (std::size_t filled = 0; filled < nodes;) {
    const std::size_t before = filled;
    for (std::size_t w = 0; w < W; ++w)
      for (; next[w] < plan.actions[w].size(); ++next[w]) {
        const std::size_t n = first[w] + next[w];
        const auto& in = takes[n];
        if ((in[0] >= 0 && !done[std::size_t(in[0])]) || (in[1] >= 0 && !done[std::size_t(in[1])])) break;
        int* c = &clock[n * W];
        if (next[w] > 0) std::copy_n(&clock[(n - 1) * W], W, c);
        for (const std::ptrdiff_t s : in)
          if (s >= 0)
            for (std::size_t v = 0; v < W; ++v) c[v] = std::max(c[v], clock[std::size_t(s) * W + v]);
        c[w] = int(next[w]);
        done[n] = 1;
        ++filled;
      }
    CUPIPE_REQUIRE(filled > before, "planner: the plan's messages wait on each other (no action can start)");
  }
  // Per worker and action: values allocated at the start, freed at the end, and messages landing
  // just before the start (latest) or between the start's allocations and the end's frees (earliest;
  // before the first action: index 0's "before").
  struct Slot {
    double allocate = 0, free = 0, early_before = 0, early_after = 0, late_before = 0;
    double own = 0;  // messages to this worker from its own action, landing as it ends
  };
  std::vector<std::vector<Slot>> slots(W);
  for (std::size_t w = 0; w < W; ++w) slots[w].resize(plan.actions[w].size());
  for (std::size_t w = 0; w < W; ++w) {
    const auto& actions = plan.actions[w];
    for (std::size_t i = 0; i < actions.size(); ++i) {
      const ActionValues v = action_values(plan, sizes, rows, int(w), actions[i]);
      Slot& s = slots[w][i];
      s.allocate = v.allocate;
      s.free = v.free;
      // The message this action sends, placed on its receiver.
      if (v.to < 0) continue;
      const double values = v.message;
      const std::size_t receiver = std::size_t(v.to);
      if (receiver == w) {
        s.own += values;
        continue;
      }
      // Latest: before the receiver's first action this send happens before (clocks only grow
      // along a worker's actions).
      std::size_t j = 0, count = plan.actions[receiver].size();
      while (count > 0) {
        const std::size_t half = count / 2;
        if (clock[(first[receiver] + j + half) * W + w] < int(i)) {
          j += half + 1;
          count -= half + 1;
        } else {
          count = half;
        }
      }
      CUPIPE_REQUIRE(j < plan.actions[receiver].size(), "planner: no action of worker ", receiver,
                     " takes the message of worker ", w, "'s action ", i);
      slots[receiver][j].late_before += values;
      // Earliest: after the receiver's last action that happens before this send.
      const int after = clock[(first[w] + i) * W + receiver];
      if (after < 0) slots[receiver][0].early_before += values;
      else slots[receiver][std::size_t(after)].early_after += values;
    }
  }
  ActivationBounds out{std::vector<double>(W, 0), std::vector<double>(W, 0)};
  for (std::size_t w = 0; w < W; ++w) {
    double low = 0, high = 0;
    for (const Slot& s : slots[w]) {
      high += s.early_before + s.allocate;
      out.high[w] = std::max(out.high[w], high);
      high += s.early_after + s.own;
      out.high[w] = std::max(out.high[w], high);
      high -= s.free;
      low += s.late_before + s.allocate;
      out.low[w] = std::max(out.low[w], low);
      low += s.own;
      out.low[w] = std::max(out.low[w], low);
      low -= s.free;
    }
  }
  return out;
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
/// rounded up. All 1 where `contention` is empty.
inline std::vector<double> contention_factors(const schedule::SimResult& sim, const std::vector<double>& contention,
                                              double per_busy = 1, int cores = 0) {
  if (contention.empty()) return std::vector<double>(sim.times.size(), 1.0);
  struct Edge {
    double time;
    int worker, delta;
  };
  std::vector<Edge> edges;
  for (std::size_t w = 0; w < sim.times.size(); ++w)
    for (const schedule::ActionTime& t : sim.times[w])
      if (t.end > t.start) {
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

/// Per-worker bytes of parameters, their gradients, the optimizer's slots and the weight versions
/// `sim` says the plan holds; `params` is worker_params().
inline std::vector<double> state_bytes(const CostModel& model, const schedule::SimResult& sim, const std::vector<double>& params) {
  std::vector<double> bytes(params.size());
  for (std::size_t w = 0; w < params.size(); ++w) {
    const int versions = std::max(1, sim.weight_versions[w]);
    bytes[w] = params[w] * parameter_state_bytes(model.value_bytes, model.compute_bytes, model.optimizer_slots, versions);
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

namespace detail {

/// Every policy and microbatch count for p stages, d replicas and t tensor-parallel ranks per stage,
/// into `report`; `model` holds the per-rank layers of t (the request's model for t = 1).
template <class List, class Split>
void search_layouts(const Request& request, const CostModel& model, int p, int d, int t, Split& split_into, Report& report) {
  const std::size_t layers = model.layers.size();
  const index_t samples = request.batch / d;  // per replica (the first batch % d replicas take one more)
  const std::string tensor_suffix = t > 1 ? " t=" + std::to_string(t) : std::string();
  for (const schedule::PolicyInfo& policy : schedule::policy_table<List>()) {
    if (!wanted(request, policy.name)) continue;
    const int v = policy.default_chunks, virtual_stages = p * v;
    const std::string base = std::string(policy.name) + " p=" + std::to_string(p);
    const std::string where = base + " d=" + std::to_string(d) + tensor_suffix;
    if (std::size_t(virtual_stages) > layers) {
      ++report.considered;
      report.rejected.push_back({where, std::to_string(virtual_stages) + " virtual stages for " + std::to_string(layers) + " layers"});
      continue;
    }
    if (samples < 1) {
      ++report.considered;
      report.rejected.push_back({where, "fewer samples than replicas"});
      continue;
    }
    if (policy.update != schedule::UpdateRule::flush && !request.asynchronous && !named(request, policy.name)) {
      ++report.considered;
      report.rejected.push_back({where, "asynchronous: stale weights change what training computes; ask for it by name "
                                        "or with Request::asynchronous"});
      continue;
    }
    if (model.tied && policy.update != schedule::UpdateRule::flush) {
      ++report.considered;
      report.rejected.push_back({where, "the model ties weights (as GPT-2's lm_head to wte); only a flush update sums them"});
      continue;
    }
    if (request.refuses) {
      if (std::string why = request.refuses(policy.name, p, d, t); !why.empty()) {
        ++report.considered;
        report.rejected.push_back({where, std::move(why)});
        continue;
      }
    }
    const std::vector<std::size_t>& cuts = split_into(virtual_stages);
    if (cuts.empty()) {
      ++report.considered;
      report.rejected.push_back({where, "the program has no split into " + std::to_string(virtual_stages) + " virtual stages"});
      continue;
    }
    const std::vector<ChunkSizes> sizes = chunk_sizes(model, cuts);
    for (int m : microbatch_candidates(p, samples, request.max_microbatches)) {
      ++report.considered;
      const schedule::Config config{p, m, v, policy.default_batches};
      const std::string name = base + " m=" + std::to_string(m) + " d=" + std::to_string(d) + tensor_suffix;
      if (const std::string_view why = policy.check(config); !why.empty()) {
        report.rejected.push_back({name, std::string(why)});
        continue;
      }
      const schedule::Plan plan = policy.generate(config);
      // Microbatch rows as the runtime splits a replica's samples (the first samples % m take one
      // more); the step time scales with the largest.
      // The batches' samples split into microbatches as the runtime splits them (split_rows: the
      // first n % parts take one more); every time scales with the largest.
      const index_t n = samples * config.batches;
      const int parts = config.total_microbatches();
      std::vector<double> rows(static_cast<std::size_t>(parts));
      for (int j = 0; j < parts; ++j)
        rows[std::size_t(j)] = double(n / parts + (j < n % parts ? 1 : 0)) * double(model.rows_per_sample);
      const double largest_rows = *std::max_element(rows.begin(), rows.end());
      const std::vector<double> params = worker_params(model, plan, cuts);
      // Each virtual stage's own costs (chunks of one worker may cost differently), for each
      // microbatch size (at most two: a batch that does not split evenly).
      double widest = 0;
      for (int k = 1; k < virtual_stages; ++k) widest = std::max(widest, model.layers[cuts[std::size_t(k)]].in);
      const auto stage_costs = [&](double r) {
        std::vector<schedule::StageCosts> out(static_cast<std::size_t>(virtual_stages), schedule::StageCosts{0, 0, 0});
        for (int k = 0; k < virtual_stages; ++k) {
          schedule::StageCosts& c = out[std::size_t(k)];
          double chunk_params = 0;
          for (std::size_t l = cuts[std::size_t(k)]; l < cuts[std::size_t(k) + 1]; ++l) {
            const LayerCost& layer = model.layers[l];
            const double f = at_rows(model, layer, 0, r), b = at_rows(model, layer, 1, r), w = at_rows(model, layer, 2, r);
            // The group sums run inside the action: the forward's (a row-parallel output) and the
            // input gradient's (a column-parallel input).
            const double sf = tensor_sum_seconds(model, t, layer.sum_forward_calls, r * layer.sum_forward);
            const double sb = tensor_sum_seconds(model, t, layer.sum_backward_calls, r * layer.sum_backward);
            c.forward += f + sf;
            c.backward += policy.split_backward ? b + sb : b + sb + w;
            c.weight += policy.split_backward ? w : 0.0;
            chunk_params += layer.params;
          }
          // The runtime's own cost of each action (with the W inside the B where it is not split).
          c.forward += model.action_overhead_seconds;
          c.backward += model.action_overhead_seconds;
          if (policy.split_backward) c.weight += model.action_overhead_seconds;
          // In one process the sender copies a message into the receiver's memory inside its action
          // (LocalTransport): F sends its output, B its input gradient.
          if (request.one_process) {
            if (k + 1 < virtual_stages) c.forward += link_seconds(model, r * sizes[std::size_t(k)].out);
            if (k > 0) c.backward += link_seconds(model, r * sizes[std::size_t(k)].in);
          }
          // Asynchronous schedules update inside the timeline, on the worker, each chunk its own
          // parameters: PipeDream after every microbatch's backward, 2BW once per batch (spread
          // over its microbatches here).
          if (policy.update != schedule::UpdateRule::flush)
            (policy.split_backward ? c.weight : c.backward) +=
                chunk_params * model.update_seconds_per_param /
                (policy.update == schedule::UpdateRule::double_buffered ? double(m) : 1.0);
        }
        return out;
      };
      schedule::Costs costs;
      const double smallest_rows = *std::min_element(rows.begin(), rows.end());
      if (smallest_rows == largest_rows) {
        costs.per_virtual_stage = stage_costs(largest_rows);
      } else {
        const std::vector<schedule::StageCosts> large = stage_costs(largest_rows), small = stage_costs(smallest_rows);
        for (double r : rows) costs.per_microbatch.push_back(r == largest_rows ? large : small);
      }
      // Between processes a hand-over delays its receiver without occupying the sender; in one
      // process the sender's copy is in its action (above) and a receiver that sat waiting for it
      // wakes wake_seconds later.
      costs.transfer = virtual_stages > 1 && !request.one_process ? model.link_latency + (model.link_bytes_per_second > 0
                                                                      ? largest_rows * widest * model.value_bytes / model.link_bytes_per_second
                                                                      : 0.0)
                                          : 0.0;
      costs.wake = request.one_process ? model.wake_seconds : 0.0;
      schedule::SimResult sim = schedule::simulate(plan, costs);
      // Workers of one process that compute at once slow each other down: each worker's actions
      // take the contention factor averaged over the time they ran, with as many workers busy as
      // the first simulation says, and the plan runs again with those costs.
      // Across processes, the ranks one node holds share its cores alike; replicas and tensor ranks
      // run the timeline `sim` has for one pipeline.
      const int sharing = request.one_process ? p * d * t : std::min(p * d * t, request.colocated);
      // One entry (an action alone) still charges turns on too few cores.
      if (sharing > 1 && !model.contention.empty() &&
          (model.contention.size() > 1 || (request.cores > 0 && sharing > request.cores))) {
        const std::vector<double> f = contention_factors(sim, model.contention, double(sharing) / double(p), request.cores);
        const auto scale = [&](std::vector<schedule::StageCosts>& list) {
          for (int k = 0; k < virtual_stages; ++k) {
            schedule::StageCosts& c = list[std::size_t(k)];
            const double x = f[std::size_t(plan.placement.worker_of(k))];
            c = {c.forward * x, c.backward * x, c.weight * x};
          }
        };
        if (!costs.per_virtual_stage.empty()) scale(costs.per_virtual_stage);
        for (std::vector<schedule::StageCosts>& list : costs.per_microbatch) scale(list);
        sim = schedule::simulate(plan, costs);
      }
      Layout layout;
      layout.schedule = std::string(policy.name);
      layout.stages = p;
      layout.chunks = v;
      layout.microbatches = m;
      layout.replicas = d;
      layout.tensor = t;
      layout.batches = config.batches;
      layout.cuts = cuts;
      layout.bubble = sim.bubble_fraction;
      const std::vector<double> values = activation_peaks(plan, sim, sizes, rows);
      const ActivationBounds bounds = activation_bounds(plan, sizes, rows);
      layout.peak_bytes = state_bytes(model, sim, params);
      layout.most_bytes = layout.peak_bytes;
      const double value_bytes = double(model.value_bytes);
      for (std::size_t w = 0; w < values.size(); ++w) {
        layout.peak_activation_bytes.push_back(values[w] * value_bytes);
        layout.peak_activation_low_bytes.push_back(bounds.low[w] * value_bytes);
        layout.peak_activation_high_bytes.push_back(bounds.high[w] * value_bytes);
        layout.peak_bytes[w] += layout.peak_activation_bytes[w];
        layout.most_bytes[w] += layout.peak_activation_high_bytes[w];
      }
      const double most_params = *std::max_element(params.begin(), params.end());
      if (d > 1 && model.allreduce_bytes_per_second > 0)
        layout.allreduce_seconds =
            2.0 * double(d - 1) / double(d) * most_params * model.gradient_bytes() / model.allreduce_bytes_per_second;
      // A flush schedule updates after the step: every worker its own stages at once, or, in one
      // process, the calling thread every stage in turn.
      if (policy.update == schedule::UpdateRule::flush) {
        double update = 0;
        for (double w : params) update = request.one_process ? update + w : std::max(update, w);
        layout.update_seconds = update * model.update_seconds_per_param;
      }
      layout.step_seconds =
          (sim.makespan + layout.update_seconds + model.step_overhead_seconds) / double(config.batches) + layout.allreduce_seconds;
      if (request.memory_bytes > 0) {
        const auto most = std::max_element(layout.most_bytes.begin(), layout.most_bytes.end());
        if (*most > request.memory_bytes) {
          report.rejected.push_back({name, "worker " + std::to_string(most - layout.most_bytes.begin()) + " needs " +
                                               gigabytes(*most) + ", over the " + gigabytes(request.memory_bytes) +
                                               " a device has"});
          continue;
        }
      }
      report.ranked.push_back(std::move(layout));
    }
  }
}

}  // namespace detail

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
  CUPIPE_REQUIRE(request.max_replicas >= 0, "planner: max_replicas must not be negative");
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
  Report report;
  for (std::size_t i = 0; i < degrees.size(); ++i) {
    const int t = degrees[i];
    const CostModel& m = per_degree[i];
    std::vector<double> total(layers);
    for (std::size_t l = 0; l < layers; ++l) total[l] = m.layers[l].forward + m.layers[l].backward_input + m.layers[l].backward_weight;
    // Splits by virtual stage count; an empty one: the program has none.
    std::vector<std::vector<std::size_t>> cuts_for(layers + 1);
    std::vector<char> cuts_known(layers + 1, 0);
    const auto split_into = [&](int virtual_stages) -> const std::vector<std::size_t>& {
      const auto n = std::size_t(virtual_stages);
      if (!cuts_known[n]) {
        cuts_known[n] = 1;
        cuts_for[n] = request.split ? request.split(virtual_stages) : detail::balanced_cuts(total, virtual_stages);
        const std::vector<std::size_t>& c = cuts_for[n];
        CUPIPE_REQUIRE(c.empty() || (c.size() == n + 1 && c.front() == 0 && c.back() == layers &&
                                     std::is_sorted(c.begin(), c.end()) &&
                                     std::adjacent_find(c.begin(), c.end()) == c.end()),
                       "planner: the split for ", virtual_stages, " virtual stages is not ", virtual_stages,
                       " non-empty contiguous ranges of the ", layers, " layers");
      }
      return cuts_for[n];
    };
    for (int p = 1; p * t <= request.devices; ++p) {
      if (!request.stage_counts.empty() &&
          std::find(request.stage_counts.begin(), request.stage_counts.end(), p) == request.stage_counts.end())
        continue;
      for (int d = 1; p * d * t <= request.devices; ++d) {
        if (request.all_devices && p * d * t != request.devices) continue;
        if (request.max_replicas > 0 && d > request.max_replicas) continue;
        detail::search_layouts<List>(request, m, p, d, t, split_into, report);
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
    const int sharing = request.one_process ? best.stages * best.replicas * best.tensor : request.colocated;
    if (sharing > request.cores)
      report.caveats.push_back(std::to_string(sharing) + (request.one_process ? " workers" : " processes") + " share " +
                               std::to_string(request.cores) +
                               " cores: they take turns on them, and the cost model charges the slowdown measured for "
                               "that many workers (beyond it, each its share of a core), not the waits for a turn "
                               "(4 processes on 2 cores measured 1-41% slower than predicted: docs/planner.md)");
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
  // The layer names of the split the best layout runs (a tensor-parallel part's own names).
  const std::vector<LayerCost>* names = &model.layers;
  for (const TensorVariant& v : model.tensor_variants)
    if (v.degree == best.tensor && v.layers.size() == model.layers.size()) names = &v.layers;
  for (std::size_t k = 0; k + 1 < best.cuts.size(); ++k) {
    out << "  virtual stage " << k << ": layers " << best.cuts[k] << ".." << best.cuts[k + 1] - 1;
    if (!names->empty()) out << " (" << (*names)[best.cuts[k]].name << " .. " << (*names)[best.cuts[k + 1] - 1].name << ")";
    out << "\n";
  }
  for (std::size_t w = 0; w < best.peak_bytes.size(); ++w)
    out << "  worker " << w << ": peak " << detail::gigabytes(best.peak_bytes[w]) << ", of it activations "
        << detail::gigabytes(best.peak_activation_bytes[w]) << " (predicted); whatever the timing, activations "
        << detail::gigabytes(best.peak_activation_low_bytes[w]) << " to " << detail::gigabytes(best.peak_activation_high_bytes[w])
        << ", at most " << detail::gigabytes(best.most_bytes[w]) << " in all\n";
  out << "runners-up:\n";
  for (std::size_t i = 1; i < std::min(report.ranked.size(), runners_up + 1); ++i)
    out << "  " << report.ranked[i].describe() << ": step " << report.ranked[i].step_seconds * 1e3 << " ms, "
        << why_slower(report.ranked[i], best) << "\n";
  out << report.considered << " layouts considered, " << report.ranked.size() << " fit, " << report.rejected.size()
      << " refused\n";
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
