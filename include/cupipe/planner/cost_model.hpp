// SPDX-License-Identifier: Apache-2.0
// The planner's inputs and outputs: the cost model (per-layer F, B and W times, sizes, links,
// tensor-parallel variants, contention), a Request (devices, memory, schedules, microbatches) and
// the Report of every layout considered (planner.hpp says how the search uses them).
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
  /// Context parallelism: values per row this layer passes round a ring per step (the attention's
  /// keys and values, 2C; layer.hpp's ring_values_of); 0: a token-wise layer, which never does.
  double ring_values = 0;
  /// Expert parallelism: values per row one of this layer's all-to-alls moves (a mixture of
  /// experts' dispatch, top_k x C; its combine moves as many back; layer.hpp's
  /// all_to_all_values_of). Each F runs the two, and each B two more. 0: a layer without experts.
  double all_to_all_values = 0;
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
  /// A forward record's copy between a worker's memory and host memory, one way (activation
  /// offload: the backend's download and upload); 0: not measured, and the planner does not offload.
  double offload_bytes_per_second = 0;
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
  /// Expert parallelism: the ranks of an expert group (each holds experts / expert_ranks of every
  /// mixture-of-experts layer; the layers' sizes are one rank's), among a layout's replicas. Above
  /// 1, each layer with LayerCost::all_to_all_values exchanges its tokens over the group:
  /// all_to_all_latency per all-to-all plus (expert_ranks - 1) / expert_ranks of its bytes at
  /// all_to_all_bytes_per_second (0: free). 1: no expert parallelism.
  int expert_ranks = 1;
  double all_to_all_latency = 0;
  double all_to_all_bytes_per_second = 0;
  /// The model ties a layer to another (GPT-2's lm_head to wte): only a flush update sums the copies,
  /// so the asynchronous schedules cannot train it.
  bool tied = false;
  /// How well the calibration's repeated measurements agreed (planner::calibrate): the largest
  /// relative spread (median absolute deviation over the median) of the rounds of any profiled
  /// size's total time or of the update's runs, and the most rounds one took (more where they
  /// disagreed). 0: not measured. The report prints it as the prediction's confidence.
  double calibration_spread = 0;
  int calibration_rounds = 0;

  /// Bytes of one gradient value (what the replicas sum).
  int gradient_bytes() const { return compute_bytes > 0 ? compute_bytes : value_bytes; }
};

/// One pipeline worker's own speed and memory, for a planner of unequal workers (Request::workers):
/// a CPU stage beside a GPU stage, a bf16-emulating stage beside an fp32 one, or a GPU that two
/// stages share. planner::worker_speed builds one from a cost model calibrated on the worker's
/// backend.
struct WorkerSpeed {
  std::string name;               ///< what the report calls it: "host", "host:bf16", "cuda:0"
  /// Each layer of the model timed on this worker, for CostModel::profiled_rows rows (or its own
  /// points); the sizes (params, widths, saved values) are the model's, not these.
  std::vector<LayerCost> layers;
  double update_seconds_per_param = 0;  ///< this worker's optimizer step, per parameter (0: free)
  int value_bytes = 0;                  ///< bytes per stored value on this worker; 0: the model's
  /// Bytes per gradient, optimizer and master value; 0: this worker's value_bytes where set, else
  /// the model's.
  int compute_bytes = 0;
  double memory_bytes = 0;              ///< this worker's memory; 0: Request::memory_bytes
  /// The rows `layers` were timed on; 0: the model's profiled_rows. Any other count than the
  /// model's is refused, since a microbatch's times scale from the model's.
  index_t profiled_rows = 0;
  /// The worker computes on a device of its own (a GPU stage beside CPU stages): its actions
  /// neither take the machine's cores nor slow the workers that do (CostModel::contention), and
  /// they are not slowed by them.
  bool own_device = false;
};

/// What a program cannot run (Request::refuses): given a schedule's name, the stages, the replicas,
/// the tensor-parallel ranks and the context-parallel ring's ranks, the reason it cannot, or an
/// empty string.
using Refusal = std::function<std::string(std::string_view schedule, int stages, int replicas, int tensor, int context)>;

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
  /// Context-parallel ring sizes to consider (cp/: each sample's rows split over a ring of cp
  /// ranks that count among the replicas); empty: {1}. A degree needs samples that cut into 2 cp
  /// equal chunks, and processes (not Request::one_process).
  std::vector<int> context_degrees{};
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
  /// name, the stages, the replicas, the tensor-parallel ranks and the context-parallel ring's
  /// ranks, the reason it cannot (the layout is then refused with it), or an empty string. Empty
  /// function: it runs every layout.
  Refusal refuses{};
  /// A layout over `memory_bytes` may offload activations (PipelineOptions::offload): the virtual
  /// stages of each worker over it keep the most forward records resident that fit, and the copies
  /// cost what CostModel::offload_bytes_per_second says. Needs that figure; off: such a layout is
  /// refused.
  bool offload = true;
  /// The ZeRO stages (PipelineOptions::zero) to consider for layouts with replicas; empty: {0}. A
  /// layout with one replica runs without. Each shards the parameter state as
  /// cupipe::sharded_state_bytes says (ZeRO-3 with reshard_after_forward) and moves what
  /// detail::replica_traffic counts: among layouts as fast, the one that needs the least memory
  /// ranks first.
  std::vector<int> zero_stages{};
  /// Unequal workers: one speed profile per pipeline worker, in stage order (empty: every worker is
  /// as fast as `model` says). Set, every layout has workers.size() stages (`devices` must be that
  /// count), one replica and no tensor parallelism; each virtual stage's actions take its worker's
  /// times, its state and activations that worker's bytes, and its memory that worker's cap; and
  /// the split is the bottleneck partition over the workers (detail::bottleneck_cuts: the slowest
  /// virtual stage on its own worker as fast as can be, each worker's parameter state within its
  /// memory), at `cut_points`, unless `split` gives the program's one.
  std::vector<WorkerSpeed> workers{};
  /// The layers where a virtual stage may start besides the first, for a program that compiles
  /// only some splits (the MLP trainer's after each Linear and ReLU); empty: anywhere. Used where
  /// `split` is not set.
  std::vector<std::size_t> cut_points{};
};

/// One layout and what the cost model predicts for it.
struct Layout {
  std::string schedule;
  int stages = 1;        ///< pipeline workers
  int chunks = 1;        ///< virtual stages per worker
  int microbatches = 1;  ///< per step and replica
  int replicas = 1;      ///< data-parallel degree
  int tensor = 1;        ///< tensor-parallel ranks per stage
  int context = 1;       ///< context-parallel ranks per ring (each sample's rows split over them)
  int batches = 1;       ///< batches a step runs (asynchronous schedules: 2)
  int zero = 0;          ///< the ZeRO stage (PipelineOptions::zero; reshard_after_forward with 3)
  std::vector<std::size_t> cuts;    ///< first layer of each virtual stage, then the layer count
  double step_seconds = 0;          ///< predicted, per batch (one optimizer step for flush schedules)
  double bubble = 0;                ///< predicted idle share
  double allreduce_seconds = 0;     ///< predicted gradient sum across replicas, in step_seconds
  double update_seconds = 0;        ///< predicted flush update after the step, in step_seconds
  /// Expert parallelism (CostModel::expert_ranks): the all-to-all time of a step that no compute
  /// hid, summed over the workers (in step_seconds), and the same with the schedule's overlapped
  /// F&B pairs run back to back (schedule::without_pairs; equal where it has none).
  double exposed_all_to_all_seconds = 0, unpaired_all_to_all_seconds = 0;
  std::vector<double> peak_bytes;   ///< predicted per worker: state and peak_activation_bytes
  /// Predicted per worker: the parameter state by the allocator's tags, the most within a step
  /// (in peak_bytes) and between steps.
  std::vector<StateBytes> state_bytes, resting_state_bytes;
  /// Per worker: state and peak_activation_high_bytes, the most any timing can need; what the memory
  /// cap is checked against, so a race between workers cannot take a layout over it.
  std::vector<double> most_bytes;
  std::vector<double> peak_activation_bytes;  ///< predicted per worker at the simulated times: the allocator's activations tag
  /// Per worker, the least and most activation peak over every timing the plan allows
  /// (detail::activation_bounds): a measured peak lies between them whatever the machine does.
  std::vector<double> peak_activation_low_bytes, peak_activation_high_bytes;
  /// Activation offload (PipelineOptions::offload, offload_resident): the virtual stages that keep
  /// at most `offload_resident` forward records on the device; empty: none. Its copies are in
  /// step_seconds.
  std::vector<int> offload{};
  int offload_resident = 0;
  std::vector<std::string> worker_names{};  ///< unequal workers (Request::workers): each one's name; empty otherwise
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

/// A split as text: "0,2,7" (the first layer of each virtual stage, then the layer count).
inline std::string split_text(const std::vector<std::size_t>& cuts) {
  std::string out;
  for (std::size_t i = 0; i < cuts.size(); ++i) out += (i ? "," : "") + std::to_string(cuts[i]);
  return out;
}

inline std::string Layout::describe() const {
  std::ostringstream out;
  out << schedule << " p=" << stages << " v=" << chunks << " m=" << microbatches << " d=" << replicas;
  if (tensor > 1) out << " t=" << tensor;
  if (context > 1) out << " cp=" << context;
  if (zero > 0) out << " zero=" << zero;
  if (!worker_names.empty()) out << " split=" << split_text(cuts);  // unequal workers: the planner chose it
  if (!offload.empty()) {
    out << " offload=";
    for (std::size_t i = 0; i < offload.size(); ++i) out << (i ? "," : "") << offload[i];
    out << " resident=" << offload_resident;
  }
  return out.str();
}

}  // namespace cupipe::planner
