// SPDX-License-Identifier: Apache-2.0
// Pipeline<Stages, Schedule, Backend>: the front a trainer uses. It checks the options, asks the
// schedule policy for its plan and placement, builds the stage states and the transport, and runs
// each step through the parts that do the work:
//   step_plan.hpp       how the batch splits, loss normalizers and weight versions (pure data)
//   stage_executor.hpp  F, B, W and completion on one virtual stage; inference
//   worker_runtime.hpp  one thread per worker, failure propagation, action timing
//   transport.hpp       hand-over to a neighbour: LocalTransport (in process) or CommTransport (MPI, NCCL)
//   optimizer_step.hpp  optimizer slots, updates, replica sums, the flush update
//   measure.hpp         StepStats from what was recorded
// docs/architecture.md draws a training step's data flow.
#pragma once

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <exception>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "cupipe/backend/capabilities.hpp"
#include "cupipe/backend/staging.hpp"
#include "cupipe/comm/agreement.hpp"
#include "cupipe/comm/communicator.hpp"
#include "cupipe/core/dtype.hpp"
#include "cupipe/core/error.hpp"
#include "cupipe/core/tensor.hpp"
#include "cupipe/layers/tensor_parallel.hpp"
#include "cupipe/optim/optimizers.hpp"
#include "cupipe/pipeline/comm_transport.hpp"
#include "cupipe/pipeline/local_transport.hpp"
#include "cupipe/pipeline/measure.hpp"
#include "cupipe/pipeline/optimizer_step.hpp"
#include "cupipe/pipeline/post_validation.hpp"
#include "cupipe/pipeline/stage_executor.hpp"
#include "cupipe/pipeline/stage_list.hpp"
#include "cupipe/pipeline/stage_states.hpp"
#include "cupipe/pipeline/stats.hpp"
#include "cupipe/pipeline/step_plan.hpp"
#include "cupipe/pipeline/worker_runtime.hpp"
#include "cupipe/schedule/fingerprint.hpp"
#include "cupipe/schedule/policy.hpp"
#include "cupipe/schedule/steps.hpp"
#include "cupipe/schedule/verify.hpp"
#include "cupipe/schedule/weights.hpp"

namespace cupipe {

struct PipelineOptions {
  /// Microbatches per batch (flush schedules) or per update period (2BW).
  int microbatches = 1;
  /// Asynchronous schedules only: batches that one train_step runs without a flush (0: 1).
  int batches = 0;
  /// Seeds the parameter initialisation (identical to Network<Model>(seed)).
  std::uint64_t seed = 0;
  /// Throw when a microbatch's loss, or a flush update's global gradient norm, is not finite (the
  /// update is then not applied).
  bool check_finite = true;
  /// Virtual stages that keep only their input after forward and recompute it in backward.
  std::vector<int> recompute{};
  /// Device of each worker, for device backends (several workers may share one). Empty: device 0.
  std::vector<int> devices{};
  /// Messages a worker's mailbox holds before senders wait; 0: enough for the schedule.
  std::size_t channel_capacity = 0;
  /// A receive (or a step's sends) waiting longer than this is an error naming the stage, action
  /// and peer; 0: no deadline. The default is the collective timeout's: a stage slower than 5
  /// minutes per action needs a longer one.
  double transfer_timeout_seconds = comm::Communicator::default_collective_timeout_seconds;
  /// Across processes: this process runs the stage the communicator's topology gives it, sends to
  /// and receives from the other stages through it, and sums gradients over its replicas. Null: all
  /// stages run in this process.
  std::shared_ptr<comm::Communicator> communicator{};
  /// The plan a schedule::UserPlan pipeline runs (io::load_plan reads one from a CSV or JSON file); its
  /// stages, chunks, microbatches, backward split and placement must match the pipeline's. Only
  /// UserPlan reads it.
  std::shared_ptr<const schedule::Plan> plan{};
  /// Flush schedules: optimizer post-validation in train_steps (Qi et al., zero bubble, section 4).
  /// Each worker applies its update as soon as its own part of a step is done, as if the global
  /// gradient norm did not clip, and goes on to the next step: no flush separates the steps. The norm
  /// is checked one step later; an update that should have clipped, or saw a non-finite gradient, is
  /// rolled back, redone as the flush does it, and the next step is run again. The weights and
  /// optimizer state are bitwise those of train_step after every step. Costs one copy of each
  /// stage's weights, gradients and optimizer state. All stages in this process; tied copies (GPT-2's
  /// wte and lm_head) on one worker, as V-shaped schedules place them.
  bool post_validation = false;
  /// ZeRO-1 (Rajbhandari et al., 2020, stage 1), with data-parallel replicas across processes: each
  /// replica keeps the optimizer state of 1/R of each stage's parameters (R replicas); the gradients
  /// are reduce-scattered (each replica receives the sums of its shard only), each replica updates
  /// its shard, and the updated shards are gathered over the replicas: the traffic of one
  /// all-reduce, as without ZeRO. The weights equal those without it to rounding (the norm and the
  /// tied copies' sums are added in another order; the update itself is element-wise, the gather
  /// copies); the optimizer state per replica falls by R. Flush schedules only, not with post_validation; the
  /// communicator must gather (MpiCommunicator and NcclCommunicator do). Checkpoints hold the whole state, so they load
  /// with or without ZeRO and under another replica count. Without replicas it changes nothing.
  bool zero = false;
};

namespace detail {

/// Instantiated when a stage list cannot be dealt out to the workers of a multi-chunk schedule.
template <int StageListSize, int ChunksPerWorker>
struct stage_count_fits_chunks {
  static_assert(StageListSize % ChunksPerWorker == 0,
                "Pipeline: the schedule gives each worker V chunks, so the StageList needs a multiple of V stages "
                "(stage_count_fits_chunks<stages in the list, V> above names both numbers)");
  static constexpr bool value = StageListSize % ChunksPerWorker == 0;
};

}  // namespace detail

/// `Backend` is one backend for every worker (backend::Host<float>, backend::Cuda<bfloat16, float>,
/// ...) or backend::PerWorker<one per worker>: then each worker runs its stages in its own precision
/// and memory space, and each hand-over converts (pipeline/hand_over.hpp). Such a mixed pipeline
/// runs in one process.
template <class Stages, schedule::SchedulePolicy Schedule, class Backend>
class Pipeline {
  // Instantiates the check; it reports on its own, so this line adds no second error.
  static_assert(detail::stage_count_fits_chunks<int(Stages::size), Schedule::chunks>::value || true);
  using Executor = pipeline::StageExecutor<Stages, Schedule, Backend>;
  using States = typename Executor::States;
  using Contexts = typename Executor::Contexts;
  using FirstBackend = typename Executor::FirstBackend;  ///< the first stage's worker's: where the batch goes
  using LastBackend = typename Executor::LastBackend;    ///< the last stage's worker's: labels, loss, output

 public:
  /// Whether the workers have backends of different types (backend::PerWorker).
  static constexpr bool mixed = Contexts::mixed;
  /// Storage: weights in use, activations, messages; with a backend per worker, the last stage's
  /// (what predict() writes).
  using T = typename Executor::output_type;
  /// Compute: gradients, master weights, optimizer state; what parameters() and the setters move.
  /// With a backend per worker, the widest of theirs (double when any computes in double).
  using G = typename States::G;
  /// The first stage's memory space (every stage's, with one backend).
  using space = typename FirstBackend::space;
  using Model = typename Stages::model;
  using Loss = typename Stages::loss;
  using input_type = typename Executor::input_type;
  static constexpr int virtual_stages = int(Stages::size);
  static constexpr int chunks = Schedule::chunks;
  static constexpr int stages = virtual_stages / chunks;
  static constexpr schedule::UpdateRule update_rule = Schedule::update;
  static constexpr bool split_backward = Schedule::split_backward;
  static constexpr index_t in_features = Stages::in_features;
  static constexpr index_t out_features = Stages::out_features;
  /// A tensor-parallel model whose last layer's output is split by columns over the group (a
  /// vocabulary-parallel head: each rank's logits are its part of the vocabulary): predict()
  /// assembles the whole output, prediction_features wide.
  static constexpr int output_parts =
      cupipe::output_parts<typename Model::body::template layer<Model::body::size - 1>>();
  static constexpr index_t prediction_features = out_features * output_parts;
  /// Rows that form one sample and stay in one microbatch (a sequence, for a transformer).
  static constexpr index_t rows_per_sample = Model::body::rows_per_sample;
  /// The model's tied copies (GPT-2's wte and lm_head), summed by every flush update.
  static constexpr TiedCopies tied = Model::body::tied;

  explicit Pipeline(PipelineOptions options = {}) : options_(std::move(options)) {
    CUPIPE_REQUIRE(options_.microbatches >= 1, "Pipeline: microbatches must be at least 1, got ", options_.microbatches);
    CUPIPE_REQUIRE(options_.batches >= 0, "Pipeline: batches must not be negative, got ", options_.batches);
    if constexpr (tied.count > 0 && update_rule != schedule::UpdateRule::flush)
      CUPIPE_THROW("Pipeline: ", Schedule::name, " updates each stage on its own, but this model ties a layer to its "
                   "input embedding (as GPT-2 ties lm_head to wte); tied copies are summed by a flush update, so use a "
                   "flush schedule or untie them (gpt::Config::tied = false)");
    if (update_rule == schedule::UpdateRule::flush && options_.batches > 1)
      CUPIPE_THROW("Pipeline: ", Schedule::name, " flushes after every batch, so batches must be 1, got ", options_.batches);
    CUPIPE_REQUIRE(options_.devices.empty() || int(options_.devices.size()) == stages, "Pipeline: ",
                   options_.devices.size(), " devices given for ", stages, " stages");
    if constexpr (mixed) check_mixed();
    if (comm()) {
      const comm::Topology& topology = comm()->topology();
      if (topology.stages != stages)
        CUPIPE_THROW("Pipeline: the communicator splits the world into ", topology.stages, " stages but this pipeline has ",
                     stages);
      local_worker_ = topology.stage();
    }
    check_tensor_parallel();
    for (int k : options_.recompute)
      CUPIPE_REQUIRE(k >= 0 && k < virtual_stages, "Pipeline: recompute names stage ", k, " but there are ",
                     virtual_stages, " (virtual) stages");
    if (options_.post_validation) check_post_validation();
    if (options_.zero) check_zero();
    if constexpr (requires { Schedule::from_options; }) plan_ = user_plan();
    else {
      CUPIPE_REQUIRE(!options_.plan, "Pipeline: PipelineOptions::plan is set, but ", Schedule::name,
                     " makes its own plan; run a plan from a file with schedule::UserPlan");
      plan_ = schedule::generate<Schedule>({stages, options_.microbatches, chunks, std::max(options_.batches, 1)});
    }
    if (const auto verdict = schedule::verify(plan_); !verdict)
      CUPIPE_THROW("Pipeline: the ", Schedule::name, " plan failed verification: ", verdict.message());
    if constexpr (mixed) {
      if (!Contexts::host_only)
        for (const auto& actions : plan_.actions)
          for (const schedule::Action& a : actions)
            if (a.overlap)
              CUPIPE_THROW("Pipeline: ", Schedule::name, " overlaps F&B pairs on a second stream, which a pipeline "
                           "with a device worker among backends of several types (backend::PerWorker) does not "
                           "support yet (a hand-over from another backend copies on the receiver's stream from the "
                           "sender's thread); use another schedule");
    }
    // Across processes every rank must run the same plan: ranks started with another schedule,
    // microbatch count, seed or plan file fail here, every one of them, naming the setting (rather
    // than waiting on a message that never comes). A collective, before any other.
    if (comm() && comm()->topology().world > 1)
      comm::require_same_settings(*comm(), {{"schedule", std::string(Schedule::name)},
                                            {"microbatches", std::to_string(options_.microbatches)},
                                            {"seed", std::to_string(options_.seed)},
                                            {"zero", options_.zero ? "on" : "off"},
                                            {"tensor-parallel ranks", std::to_string(comm()->topology().tensor)},
                                            {"plan fingerprint", schedule::fingerprint(plan_)}});
    if (options_.channel_capacity > 0 && options_.channel_capacity < std::size_t(plan_.channel_depth))
      CUPIPE_THROW("Pipeline: channel_capacity ", options_.channel_capacity, " is below the ", plan_.channel_depth,
                   " messages the ", Schedule::name, " plan queues on one channel (", options_.microbatches,
                   " microbatches); raise it or leave it 0");
    std::vector<int> versions_allowed = schedule::weight_versions(plan_);
    // The plan covers one step; 2BW also keeps W(t-1) across steps for the next step's first batch,
    // so it holds 2 versions even where one step's plan needs only 1.
    if (update_rule == schedule::UpdateRule::double_buffered)
      for (int& allowed : versions_allowed) allowed = std::max(allowed, 2);

    for (int w = 0; w < stages; ++w)
      if (local(w)) workers_.make(w, options_.devices.empty() ? 0 : options_.devices[std::size_t(w)]);
    workers_.for_each([&](int, auto& be) {
      if constexpr (requires { be.tensor_group; })
        if (tensor_group_) be.tensor_group = tensor_group_;
    });
    if constexpr (mixed) {
      transport_ = std::make_unique<typename Executor::TransportType>(workers_, options_.transfer_timeout_seconds);
    } else {
      using Uniform = typename Contexts::Backend;
      if (comm())
        transport_ = std::make_unique<pipeline::CommTransport<Uniform>>(options_.communicator, workers_.pointers(),
                                                                        options_.transfer_timeout_seconds);
      else
        transport_ = std::make_unique<pipeline::LocalTransport<Uniform>>(workers_.pointers(), options_.transfer_timeout_seconds);
    }
    runtime_ = std::make_unique<pipeline::WorkerRuntime<Contexts>>(workers_, stages);
    executor_ = std::make_unique<Executor>(plan_, states_, *transport_, *runtime_, comm(), options_.check_finite);

    states_.for_each_slot([&](auto k, auto& slot) {
      constexpr int K = decltype(k)::value;
      const int w = worker_of(K);
      if (!local(w)) return;
      using Seq = typename Stages::template stage<K>;
      auto& be = *workers_.template get<worker_of(K)>();
      const bool recompute = std::find(options_.recompute.begin(), options_.recompute.end(), K) != options_.recompute.end();
      slot = std::make_unique<std::remove_reference_t<decltype(*slot)>>(be, versions_allowed[std::size_t(w)], recompute);
      // With tensor parallelism each rank draws its part of the whole model's initialisation.
      Seq::init_on(be, slot->master_data(), options_.seed, tensor_group_ ? tensor_group_->rank() : 0);
      slot->publish_master(slot->weights.latest_data());
      if (zero_sharded()) {
        const comm::Topology& t = comm()->topology();
        slot->shard = pipeline::Shard::of(Seq::param_count, t.replicas, t.replica());
      }
    });
  }

  Pipeline(const Pipeline&) = delete;
  Pipeline& operator=(const Pipeline&) = delete;

  const schedule::Plan& plan() const noexcept { return plan_; }
  /// Worker `stage`'s context (one backend for every worker).
  decltype(auto) backend(int stage)
    requires(!mixed)
  {
    CUPIPE_REQUIRE(stage >= 0 && stage < stages && workers_.present(stage), "Pipeline::backend: worker ", stage,
                   " does not run in this process");
    return workers_[stage];
  }
  /// Worker W's context, of its own type (also with a backend per worker).
  template <int W>
  auto& backend() {
    static_assert(W >= 0 && W < stages, "Pipeline::backend<W>: no such worker");
    CUPIPE_REQUIRE(workers_.present(W), "Pipeline::backend: worker ", W, " does not run in this process");
    return *workers_.template get<W>();
  }
  /// What worker `stage`'s context allocated, by purpose (on any backend).
  const MemoryTracker& memory(int stage) const {
    CUPIPE_REQUIRE(stage >= 0 && stage < stages && workers_.present(stage), "Pipeline::memory: worker ", stage,
                   " does not run in this process");
    return workers_.memory(stage);
  }
  /// The worker (physical stage) that runs virtual stage k, from the schedule's placement (which
  /// depends only on the stage and chunk counts).
  static constexpr int worker_of(int virtual_stage) { return Executor::worker_at(virtual_stage); }
  /// Whether worker (physical stage) w runs in this process.
  bool local(int w) const noexcept { return local_worker_ < 0 || w == local_worker_; }
  comm::Communicator* comm() const noexcept { return options_.communicator.get(); }
  /// Whether this process writes checkpoints: the only one, or rank 0 across processes.
  bool writes_checkpoints() const noexcept { return !comm() || comm()->topology().rank == 0; }
  /// The whole model's parameters: for a model split over tensor-parallel ranks, each split tensor
  /// at its whole shape (parameters(), gradients(), optimizer_state() and the setters use this
  /// layout, so checkpoints are the whole model's).
  static std::vector<ParamInfo> parameter_table() { return tensor_parallel::whole_table(Model::parameter_table()); }
  /// Optimizer updates applied so far (per stage they are equal once a step has finished).
  std::int64_t updates() {
    std::int64_t n = 0;
    states_.for_each([&](auto, auto& st) { n = st.updates; });
    return n;
  }

  /// One training step on a batch x (n, in_features) with labels (n,), both in host memory, on any
  /// backend: forward, backward and the optimizer update(s) the schedule prescribes. The pipeline
  /// stages x to the worker that runs the first stage and the labels to the one that runs the last
  /// (no copy on the host backend). Any n >= microbatches (x batches) works: microbatch sizes then
  /// differ by at most one row.
  template <optim::Optimizer Optimizer>
  StepStats train_step(ConstView<input_type> x, ConstView<std::int32_t> labels, const Optimizer& optimizer) {
    check_batch(x, labels, "Pipeline::train_step");
    return train_resident(stage_inputs(x), stage_labels(labels), optimizer);
  }
  /// The same with the batch already in the backend's memory (device backends): x in the first
  /// stage's worker's, labels in the last stage's.
  template <optim::Optimizer Optimizer>
    requires(!mixed && !host_accessible<space>)
  StepStats train_step(ConstViewOn<FirstBackend, input_type> x, ConstViewOn<LastBackend, std::int32_t> labels,
                       const Optimizer& optimizer) {
    check_batch(x, labels, "Pipeline::train_step");
    return train_resident(x, labels, optimizer);
  }

  /// Forward and backward only (flush schedules): gradients accumulate, weights stay. For tests and
  /// for callers that step the optimizer themselves with step(). Host arrays, as train_step.
  StepStats forward_backward(ConstView<input_type> x, ConstView<std::int32_t> labels) {
    check_batch(x, labels, "Pipeline::forward_backward");
    return forward_backward_resident(stage_inputs(x), stage_labels(labels));
  }
  StepStats forward_backward(ConstViewOn<FirstBackend, input_type> x, ConstViewOn<LastBackend, std::int32_t> labels)
    requires(!host_accessible<space>)
  {
    check_batch(x, labels, "Pipeline::forward_backward");
    return forward_backward_resident(x, labels);
  }

  /// Applies one flush update from the accumulated gradients, then zeroes them. Returns the global
  /// gradient norm before clipping.
  template <optim::Optimizer Optimizer>
  double step(const Optimizer& optimizer) {
    static_assert(update_rule == schedule::UpdateRule::flush, "step: only flush schedules update after the step");
    prepare_slots<Optimizer>();
    return flush_step(optimizer);
  }

  /// A batch in host memory, for train_steps.
  struct Batch {
    ConstView<input_type> x;
    ConstView<std::int32_t> labels;
  };

  /// One training step per batch, in order; returns each step's StepStats. Without
  /// PipelineOptions::post_validation this is train_step on each batch. With it the steps overlap:
  /// each worker updates its stages when its part of a step is done and starts the next step's
  /// forwards without waiting for the other workers or the global gradient norm (see post_validation
  /// for what is checked and redone). The results are bitwise those of train_step on each batch in
  /// turn; a step whose update was redone has StepStats::rolled_back set. Action times in the stats
  /// count from the start of the call, and an action's microbatch is step * microbatches + its
  /// microbatch in the step, so schedule::steady_state_bubble reads them; memory peaks cover the whole
  /// call (steps share the allocators while they overlap). If a step fails, it throws
  /// and the pipeline holds the weights and optimizer state after the last step every stage
  /// finished (updates() says how many).
  template <optim::Optimizer Optimizer>
  std::vector<StepStats> train_steps(std::span<const Batch> batches, const Optimizer& optimizer) {
    const std::vector<Optimizer> each(batches.size(), optimizer);
    return train_steps(batches, std::span<const Optimizer>(each));
  }
  /// The same with one optimizer per step (a learning-rate schedule): step t uses optimizers[t].
  template <optim::Optimizer Optimizer>
  std::vector<StepStats> train_steps(std::span<const Batch> batches, std::span<const Optimizer> optimizers) {
    CUPIPE_REQUIRE(optimizers.size() == batches.size(), "Pipeline::train_steps: ", optimizers.size(),
                   " optimizers for ", batches.size(), " batches; give one per step");
    for (const Batch& b : batches) check_batch(b.x, b.labels, "Pipeline::train_steps");
    std::vector<StepStats> out;
    if (!options_.post_validation || batches.size() < 2) {
      for (std::size_t t = 0; t < batches.size(); ++t) out.push_back(train_step(batches[t].x, batches[t].labels, optimizers[t]));
      return out;
    }
    if constexpr (update_rule == schedule::UpdateRule::flush) {
      prepare_slots<Optimizer>();
      const std::size_t count = batches.size();
      std::vector<backend::Staging<FirstBackend, input_type>> x_staging(count);
      std::vector<backend::Staging<LastBackend, std::int32_t>> label_staging(count);
      std::vector<pipeline::StepPlan> plans(count);
      std::vector<typename Executor::Step> steps(count);
      int base = 0;
      states_.for_each([&](auto, auto& st) { base = st.weights.latest(); });
      auto& first = *workers_.template get<worker_of(0)>();
      auto& last = *workers_.template get<worker_of(virtual_stages - 1)>();
      for (std::size_t t = 0; t < count; ++t) {
        plans[t] = pipeline::make_step_plan(plan_, executor_->version_offsets(), batches[t].x.rows(), base, 0,
                                            rows_per_sample);
        steps[t].plan = &plans[t];
        steps[t].x = x_staging[t](first, batches[t].x);
        steps[t].labels = label_staging[t](last, batches[t].labels);
        steps[t].losses.assign(std::size_t(plans[t].microbatches()), 0.0);
      }
      out.resize(count);
      const auto origin = std::chrono::steady_clock::now();
      for (int next = 0; next < int(count);) next = run_post_validated(steps, next, optimizers, out, origin);
    }
    return out;
  }

  /// Inference through all stages on the caller's thread: x (n, in_features) -> out (n, prediction_features),
  /// both in host memory, on any backend. Across processes every rank calls it with its replica's x
  /// (read by stage 0's ranks) and every rank gets the output.
  void predict(ConstView<input_type> x, TensorView<T> out) {
    check_prediction(x, out);
    auto result = predict_resident(stage_inputs(x));
    constexpr int last = worker_of(virtual_stages - 1);
    const std::span<T> host(out.data(), std::size_t(out.numel()));
    if constexpr (output_parts == 1) {
      if (!comm()) {
        workers_.template get<last>()->download(result.data(), host);
        return;
      }
    }
    // The last stage's ranks hold the output; a sum over the pipeline gives it to every stage. A
    // split output: each rank of the group places its columns, and a sum over the group joins them.
    std::fill(host.begin(), host.end(), T(0));
    if (local(last)) {
      if constexpr (output_parts > 1) {
        std::vector<T> part(static_cast<std::size_t>(x.rows() * out_features));
        workers_.template get<last>()->download(result.data(), std::span<T>(part));
        const index_t first = index_t(tensor_group_->rank()) * out_features;
        for (index_t r = 0; r < x.rows(); ++r)
          std::copy_n(part.begin() + r * out_features, out_features, host.begin() + (r * prediction_features + first));
      } else {
        workers_.template get<last>()->download(result.data(), host);
      }
    }
    transport_->finish_step();
    if constexpr (std::is_same_v<T, G>) {
      if constexpr (output_parts > 1) tensor_group_->sum(host.data(), host.size());
      comm()->sum_over_stages(host.data(), host.size());
    } else {  // bf16 outputs travel as float: exact, since one rank holds each value and the others add zeros
      std::vector<G> wide(host.size());
      pipeline::convert_values(host.data(), wide.data(), host.size());
      if constexpr (output_parts > 1) tensor_group_->sum(wide.data(), wide.size());
      comm()->sum_over_stages(wide.data(), wide.size());
      pipeline::convert_values(wide.data(), host.data(), host.size());
    }
  }
  /// The same with x in the first stage's worker's memory and `out` in the last stage's (device
  /// backends, in one process).
  void predict(ConstViewOn<FirstBackend, input_type> x, ViewOn<LastBackend, T> out)
    requires(!host_accessible<space>)
  {
    check_prediction(x, out);
    CUPIPE_REQUIRE(!comm(), "Pipeline::predict: across processes the output is gathered in host memory; pass host views");
    auto result = predict_resident(x);
    auto& be = *workers_.template get<worker_of(virtual_stages - 1)>();
    copy(be, ConstViewOn<LastBackend, T>{result.data(), out.shape()}, out);
    be.synchronize();
  }

  /// The whole model's parameters, in the unsplit model's flat layout (latest versions; the float
  /// master weights with bf16 storage); with tensor parallelism gathered over the group too.
  std::vector<G> parameters() { return whole(gather([](auto& st) { return st.master_data(); })); }
  /// The accumulated gradients, same layout, summed over the replicas (across processes a
  /// collective: every rank calls it).
  std::vector<G> gradients() {
    reduce_gradients();
    return whole(gather([](auto& st) { return st.grads.data(); }));
  }
  void set_parameters(std::span<const G> values) {
    const std::vector<G> mine = part(values);
    states_.scatter(tensor_group_ ? std::span<const G>(mine) : values, [](auto& st) { return st.master_data(); });
    states_.for_each([](auto, auto& st) { st.publish_master(st.weights.latest_data()); });
  }
  /// Optimizer state slot `slot` (e.g. 0 = exp_avg for AdamW), same layout; empty before the first
  /// update. With ZeRO-1 the replicas' shards are gathered first (a collective over the replicas).
  std::vector<G> optimizer_state(std::size_t slot) {
    bool prepared = true;
    states_.for_each([&](auto, auto& st) { prepared = prepared && st.slots.size() > slot; });
    if (!prepared) return {};
    if (!zero_sharded()) return whole(gather([slot](auto& st) { return st.slots[slot].data(); }));
    std::vector<G> out(static_cast<std::size_t>(States::param_count), G(0));
    states_.for_each([&](auto k, auto& st) {
      const std::vector<G> whole = pipeline::gather_shards(*comm(), st, st.slots[slot].data());
      std::copy(whole.begin(), whole.end(), out.begin() + States::template model_offset<decltype(k)::value>());
    });
    comm()->sum_over_stages(out.data(), out.size());
    return whole(std::move(out));
  }
  /// Restores optimizer state and the update count (for checkpoints); slots must be prepared for
  /// `optimizer` first.
  template <optim::Optimizer Optimizer>
  void set_optimizer_state(const Optimizer&, std::size_t slot, std::span<const G> values, std::int64_t updates) {
    prepare_slots<Optimizer>();
    CUPIPE_REQUIRE(slot < Optimizer::slot_names.size(), "set_optimizer_state: ", Optimizer::name, " has ",
                   Optimizer::slot_names.size(), " state slots, not ", slot + 1);
    if (!zero_sharded()) {
      const std::vector<G> mine = part(values);
      states_.scatter(tensor_group_ ? std::span<const G>(mine) : values, [slot](auto& st) { return st.slots[slot].data(); });
    } else {
      const std::vector<G> mine = part(values);
      const std::span<const G> local = tensor_group_ ? std::span<const G>(mine) : values;
      CUPIPE_REQUIRE(index_t(local.size()) == States::param_count, "Pipeline: got ", values.size(),
                     " values for a model of ", States::param_count, " parameters");
      states_.for_each([&](auto k, auto& st) {
        const std::size_t at = std::size_t(States::template model_offset<decltype(k)::value>() + st.shard.begin);
        if (st.shard.size() > 0) States::upload_as(st, local.subspan(at, std::size_t(st.shard.size())), st.slots[slot].data());
      });
    }
    states_.for_each([&](auto, auto& st) { st.updates = updates; });
  }

 private:
  /// With tensor parallelism, the whole model's values from this rank's part (a collective over the
  /// group); else `values` as they are.
  std::vector<G> whole(std::vector<G> values) {
    if (!tensor_group_) return values;
    return tensor_parallel::unshard(parameter_table(), Model::parameter_table(), std::span<const G>(values), *tensor_group_);
  }
  /// With tensor parallelism, this rank's part of the whole model's `values`; else nothing (the
  /// caller uses `values`).
  std::vector<G> part(std::span<const G> values) const {
    if (!tensor_group_) return {};
    return tensor_parallel::shard(parameter_table(), Model::parameter_table(), values, tensor_group_->rank());
  }

  /// A model split over tensor-parallel ranks runs across processes whose communicator has as many
  /// per stage, under a flush schedule (its global norm is the whole model's, so every rank of a
  /// group clips alike).
  void check_tensor_parallel() {
    const int parts = tensor_parallel::parts_of(Model::parameter_table());
    const int ranks = comm() ? comm()->topology().tensor : 1;
    if (parts == 1 && ranks == 1) return;
    if (parts != ranks)
      CUPIPE_THROW("Pipeline: the model's layers are split over ", parts, " tensor-parallel rank(s), but ",
                   comm() ? "the communicator has " + std::to_string(ranks) + " per stage"
                          : std::string("there is no communicator (make one with that many: comm::MpiCommunicator(world, "
                                        "stages, timeout, tensor))"));
    if (update_rule != schedule::UpdateRule::flush)
      CUPIPE_THROW("Pipeline: tensor parallelism needs a flush schedule (its gradient norm is the whole model's), but ",
                   Schedule::name, " updates each stage on its own");
    tensor_group_ = comm()->tensor_group();
    CUPIPE_REQUIRE(tensor_group_ && tensor_group_->size() == parts, "Pipeline: the communicator gives no tensor group of ",
                   parts, " ranks");
  }

  /// The global gradient norm with tensor parallelism: split tensors' squares summed over the group,
  /// replicated tensors' (the same on every rank of it) once; the second tied copy left out (from
  /// the split sum where the copies are split, as a vocabulary-parallel wte and lm_head are).
  double tensor_parallel_norm() {
    double split = 0, replicated = 0;
    const std::vector<ParamInfo> table = Model::parameter_table();
    if constexpr (tied.count > 0)
      (pipeline::split_at(table, tied.second) ? split : replicated) -= pipeline::sum_tied_gradients(states_, comm(), tied);
    states_.for_each([&](auto k, auto& st) {
      constexpr index_t offset = States::template model_offset<decltype(k)::value>();
      for (const ParamInfo& p : table) {
        if (p.offset < offset || p.offset >= offset + st.param_count) continue;
        using St = std::remove_reference_t<decltype(st)>;
        const double s = sum_of_squares(*st.be, ConstViewOn<typename St::backend_type, typename St::G>{
                                                    st.grads.data() + (p.offset - offset), Shape{p.numel}});
        (p.split == TensorSplit::none ? replicated : split) += s;
      }
    });
    double sums[1] = {split};
    tensor_group_->sum(sums, 1);
    return std::sqrt(comm()->sum_over_stages(sums[0] + replicated));
  }

  /// Across processes, a sum over the pipeline in which every other rank contributes zeros.
  template <class Pointer>
  std::vector<G> gather(Pointer pointer) {
    std::vector<G> out = states_.gather(pointer);
    if (comm()) comm()->sum_over_stages(out.data(), out.size());
    return out;
  }

  template <class Optimizer>
  void prepare_slots() {
    states_.for_each([](auto, auto& st) { pipeline::prepare_slots<Optimizer>(st); });
  }

  /// The plan of PipelineOptions::plan, checked against what this pipeline was compiled for.
  schedule::Plan user_plan() const {
    CUPIPE_REQUIRE(options_.plan, "Pipeline: a UserPlan pipeline runs PipelineOptions::plan, which is not set (read a "
                                  "plan with io::load_plan)");
    const schedule::Plan& p = *options_.plan;
    const schedule::Config& c = p.config;
    if (c.stages != stages || c.chunks != chunks || c.microbatches != options_.microbatches || c.batches != 1)
      CUPIPE_THROW("Pipeline: the plan is for stages ", c.stages, ", chunks ", c.chunks, ", microbatches ", c.microbatches,
                   ", batches ", c.batches, " but this pipeline has stages ", stages, ", chunks ", chunks,
                   ", microbatches ", options_.microbatches, ", batches 1");
    if (p.split_backward != split_backward)
      CUPIPE_THROW("Pipeline: the plan ", p.split_backward ? "splits" : "does not split",
                   " the backward into B and W, but the pipeline's UserPlan type says the opposite");
    if (p.update != schedule::UpdateRule::flush)
      CUPIPE_THROW("Pipeline: a UserPlan runs flush updates only, but the plan's update rule is not flush");
    if (!(p.placement == Schedule::placement(c)))
      CUPIPE_THROW("Pipeline: the plan places its virtual stages differently from the pipeline's UserPlan type "
                   "(looped or V-shaped)");
    return p;
  }

  /// A pipeline with a backend per worker: one process, no post-validation, and tied copies (GPT-2's
  /// wte and lm_head) only on workers of one backend type.
  void check_mixed() {
    if (comm())
      CUPIPE_THROW("Pipeline: a pipeline with a backend per worker (backend::PerWorker) runs every stage in one "
                   "process; across processes give every rank the same backend (leave the communicator out)");
    if (options_.post_validation)
      CUPIPE_THROW("Pipeline: post_validation is not supported with a backend per worker (backend::PerWorker) yet; "
                   "leave it off");
    if constexpr (tied.count > 0) {
      std::string holders[2];
      states_.for_each_slot([&](auto k, auto&) {
        constexpr int K = decltype(k)::value;
        constexpr index_t offset = States::template model_offset<K>(), count = Stages::template stage<K>::param_count;
        using B = typename Contexts::template backend<worker_of(K)>;
        for (int c = 0; c < 2; ++c) {
          const index_t at = c == 0 ? tied.first : tied.second;
          if (at >= offset && at + tied.count <= offset + count) holders[c] = backend_label<B>();
        }
      });
      if (holders[0] != holders[1])
        CUPIPE_THROW("Pipeline: this model ties two copies of a parameter (GPT-2's wte and lm_head), held by workers of "
                     "different backends (", holders[0], " and ", holders[1], "); their gradients are summed as one "
                     "tensor, so give those workers one backend, or untie the copies (gpt::Config::tied = false)");
    }
  }

  /// "host<bfloat16, float>": a backend's name and precisions, for messages.
  template <class B>
  static std::string backend_label() {
    std::string label = std::string(B::name) + "<" + std::string(name(dtype_v<typename B::value_type>));
    if constexpr (!std::is_same_v<typename B::value_type, grad_t<B>>) label += ", " + std::string(name(dtype_v<grad_t<B>>));
    return label + ">";
  }

  /// PipelineOptions::post_validation needs a flush schedule, every stage here, and tied copies on one
  /// worker (their gradients are summed before the norm, by the worker that holds both).
  void check_post_validation() {
    if (update_rule != schedule::UpdateRule::flush)
      CUPIPE_THROW("Pipeline: post_validation checks a flush update's global gradient norm, but ", Schedule::name,
                   " updates each stage on its own; it has no flush to take off the critical path");
    if (comm())
      CUPIPE_THROW("Pipeline: post_validation runs every stage in one process; across processes the norm would need a "
                   "non-blocking sum, which the communicators do not offer yet (leave post_validation off)");
    if constexpr (tied.count > 0) {
      int holder[2] = {-1, -1};
      states_.for_each_slot([&](auto k, auto&) {
        constexpr int K = decltype(k)::value;
        constexpr index_t offset = States::template model_offset<K>(), count = Stages::template stage<K>::param_count;
        for (int c = 0; c < 2; ++c) {
          const index_t at = c == 0 ? tied.first : tied.second;
          if (at >= offset && at + tied.count <= offset + count) holder[c] = worker_of(K);
        }
      });
      if (holder[0] != holder[1])
        CUPIPE_THROW("Pipeline: post_validation: this model ties two copies of a parameter (GPT-2's wte and lm_head), "
                     "held by workers ", holder[0], " and ", holder[1], " under ", Schedule::name,
                     "; their gradients are summed before the norm, which needs both on one worker. Use a V-shaped "
                     "schedule (zbv, v-half, v-min, dualpipev: both ends on worker 0) or untie them");
      tied_worker_ = holder[0];
    }
  }

  /// The flush update from the accumulated gradients; refuses a non-finite norm (check_finite).
  /// Gradients not yet reduced over the replicas are reduced first: with ZeRO-1 (and a communicator
  /// that can) reduce-scattered, each replica receiving only the sums of its shard; else all-reduced.
  template <class Optimizer>
  double flush_step(const Optimizer& optimizer) {
    double norm = 0;
    if (zero_sharded() && gradients_unreduced_ && comm()->reduce_scatters()) {
      // The tied copies' gradients are summed over the stages first, each replica its own, so that
      // every shard of either copy receives the whole sum from the reduce-scatter.
      if constexpr (tied.count > 0) (void)pipeline::sum_tied_gradients(states_, comm(), tied);
      states_.for_each([&](auto, auto& st) { pipeline::reduce_scatter_over_replicas(*comm(), st); });
      gradients_unreduced_ = false;
      norm = pipeline::sharded_flush_norm(states_, *comm(), Model::parameter_table(), tied);
    } else {
      reduce_gradients();
      norm = tensor_group_ ? tensor_parallel_norm() : pipeline::flush_norm(states_, comm(), tied);
    }
    refuse_non_finite(norm);
    pipeline::apply_flush(states_, optimizer, norm);
    if (zero_sharded()) states_.for_each([&](auto, auto& st) { pipeline::gather_updated_weights(comm(), st); });
    return norm;
  }

  /// Sums the accumulated gradients over the replicas, if a step left them unreduced: the sums a
  /// train_step started during its backward are finished, the other stages summed now.
  void reduce_gradients() {
    if (!gradients_unreduced_) return;
    const bool any_started = any_sum_started();
    if (any_started) comm()->finish_sums();
    states_.for_each([&](auto k, auto& st) {
      if (!any_started || !sum_started_[std::size_t(decltype(k)::value)]) pipeline::sum_over_replicas(comm(), st);
    });
    std::fill(sum_started_.begin(), sum_started_.end(), 0);
    gradients_unreduced_ = false;
  }

  bool any_sum_started() const { return std::find(sum_started_.begin(), sum_started_.end(), 1) != sum_started_.end(); }

  /// Whether a train_step's stage gradient sums may start inside the step: data parallelism (flush
  /// schedules) with a communicator that starts sums and reads the backend's memory, without ZeRO-1
  /// (which reduce-scatters at the update).
  bool overlaps_gradient_sums() const {
    return update_rule == schedule::UpdateRule::flush && comm() && comm()->topology().replicas > 1 &&
           comm()->starts_sums() && comm::reads_backend_memory<FirstBackend>(*comm()) && !options_.zero;
  }

  /// The action after which each virtual stage's gradients are complete for the step: its last
  /// weight-gradient action in its worker's plan (W where the plan splits the backward, else B).
  void prepare_early_sums() {
    sum_started_.assign(std::size_t(virtual_stages), 0);
    if (!last_gradient_action_.empty()) return;
    last_gradient_action_.assign(std::size_t(virtual_stages), schedule::Action{schedule::ActionKind::F, -1, -1});
    const schedule::ActionKind weights = plan_.split_backward ? schedule::ActionKind::W : schedule::ActionKind::B;
    for (int w = 0; w < int(plan_.actions.size()); ++w)
      for (const schedule::Action& a : plan_.actions[std::size_t(w)])
        if (a.kind == weights) last_gradient_action_[std::size_t(plan_.virtual_stage(w, a))] = a;
  }

  /// After action `a` of worker `w`: if it completed its virtual stage's gradients, starts that
  /// stage's sum over the replicas (the worker goes on with its other stages' backward meanwhile).
  void start_sum_after(int w, const schedule::Action& a) {
    if (a.kind == schedule::ActionKind::F) return;
    const int v = plan_.virtual_stage(w, a);
    if (!(last_gradient_action_[std::size_t(v)] == a)) return;
    states_.visit(v, [&](auto, auto& st) {
      st.be->synchronize();
      comm()->start_sum_over_replicas(st.grads.data(), std::size_t(st.param_count));
    });
    sum_started_[std::size_t(v)] = 1;
  }

  /// Whether ZeRO-1 shards anything here: it is on, and there are replicas.
  bool zero_sharded() const noexcept { return options_.zero && comm() && comm()->topology().replicas > 1; }

  /// PipelineOptions::zero's conditions, checked before anything runs.
  void check_zero() const {
    if (update_rule != schedule::UpdateRule::flush)
      CUPIPE_THROW("Pipeline: zero shards the optimizer state of a flush update over the replicas, but ", Schedule::name,
                   " updates each stage inside the step (use a flush schedule, or leave zero off)");
    if (options_.post_validation)
      CUPIPE_THROW("Pipeline: zero and post_validation cannot be combined yet (post-validation keeps a whole copy of "
                   "the optimizer state to roll back to); leave one of them off");
    if (zero_sharded() && !comm()->all_gathers())
      CUPIPE_THROW("Pipeline: zero gathers the updated parameter shards over the replicas, which this communicator "
                   "cannot do (MpiCommunicator and NcclCommunicator can); leave zero off");
  }

  void refuse_non_finite(double norm) {
    if (!options_.check_finite || std::isfinite(norm)) return;
    states_.for_each([](auto, auto& st) { st.zero_grads(); });
    gradients_unreduced_ = false;
    CUPIPE_THROW("Pipeline: the global gradient norm is ", norm, " (a gradient is not finite); the update was not "
                 "applied, and the weights are those before this step (PipelineOptions::check_finite)");
  }

  /// `steps` steps of the plan as one plan, verified once and kept.
  const schedule::Plan& repeated_plan(int steps) {
    if (auto found = repeated_.find(steps); found != repeated_.end()) return found->second;
    schedule::Plan plan = schedule::repeat_steps(plan_, steps);
    if (const auto verdict = schedule::verify(plan); !verdict)
      CUPIPE_THROW("Pipeline: ", steps, " steps of the ", Schedule::name, " plan back to back failed verification: ",
                   verdict.message());
    return repeated_.emplace(steps, std::move(plan)).first->second;
  }

  /// Runs steps[first..] back to back with post-validation (see NormLedger). Returns the first step
  /// not yet final: the end, or the step after one whose update was redone (it reruns).
  template <class Optimizer>
  int run_post_validated(std::vector<typename Executor::Step>& steps, int first, std::span<const Optimizer> optimizers,
                         std::vector<StepStats>& out, std::chrono::steady_clock::time_point origin) {
    const int count = int(steps.size()) - first, m = plan_.config.microbatches;
    // Step t of this run (step first + t of the call) updates with its own optimizer.
    const auto optimizer = [&](int t) -> const Optimizer& { return optimizers[std::size_t(first + t)]; };
    const schedule::Plan& plan = repeated_plan(count);
    pipeline::NormLedger ledger(count, virtual_stages, stages, tied.count > 0);
    workers_.for_each([](int, auto& be) { be.memory.reset_peaks(); });
    states_.for_each([&](auto, auto& st) {
      st.done.assign(std::size_t(m), 0);
      st.weights.reset_peak();
    });
    // The boundary of worker w after step t: check step t-1's norm, report step t's, save, update.
    auto boundary = [&](int w, int t) {
      if (t > 0 && !pipeline::update_stands(optimizer(t - 1), ledger.norm(t - 1))) {
        ledger.roll_back(t - 1);
        throw pipeline::Aborted{};  // every worker stops at this boundary; the caller redoes step t-1's update
      }
      double excluded = 0;
      if (tied.count > 0 && w == tied_worker_) excluded = pipeline::sum_tied_gradients(states_, nullptr, tied);
      // The worker's sums, read back with one copy per context and reported before anything
      // changes (a failed read leaves the stages as they were); then save and update.
      pipeline::GradientSquares squares{std::size_t(States::size)};
      states_.for_each([&](auto k, auto& st) {
        if (worker_of(decltype(k)::value) == w) squares.add(st, std::size_t(decltype(k)::value));
      });
      std::vector<std::pair<int, double>> sums;
      for (const auto& [k, sum] : squares.read()) sums.emplace_back(int(k), sum);
      ledger.report(w, t, sums, excluded);
      states_.for_each([&](auto k, auto& st) {
        if (worker_of(decltype(k)::value) != w) return;
        pipeline::save_for_rollback(st);
        pipeline::update_stage(st, st.weights.latest_data(), optimizer(t), 1.0);
        st.done.assign(std::size_t(m), 0);
      });
    };
    std::vector<int> current(std::size_t(stages), 0);  // each written by its own worker only
    transport_->begin_step(2 * capacity());  // two adjacent steps' messages can be in flight
    std::exception_ptr failure = runtime_->run(
        plan,
        [&](int w, const schedule::Action& a) {
          const int t = schedule::step_of(a, m);
          if (t != current[std::size_t(w)]) {
            boundary(w, current[std::size_t(w)]);
            current[std::size_t(w)] = t;
          }
          schedule::Action local = a;
          local.microbatch -= t * m;
          executor_->execute(w, local, steps[std::size_t(first + t)]);
        },
        [&] { transport_->abort(); }, origin, first);
    finish_transport(failure);
    if (failure) {
      recover_post_validated(ledger, optimizers.subspan(std::size_t(first)));
      std::rethrow_exception(failure);
    }
    // A worker checks the step before the one it just finished; the second-to-last step's check is
    // here (every worker reported it), and the last step's update is the flush below.
    int rollback = ledger.rollback();
    if (rollback < 0 && count >= 2 && !pipeline::update_stands(optimizer(count - 2), ledger.norm(count - 2)))
      rollback = count - 2;
    const int done = rollback >= 0 ? rollback + 1 : count;  // steps of this run whose update is final
    double last_norm = 0;
    if (rollback >= 0) {
      // Every worker stopped after step rollback + 1 (or the run ended there) without updating: undo
      // rollback's update (and drop rollback + 1's gradients), then update as the flush does.
      states_.for_each([](auto, auto& st) { pipeline::restore(st); });
      last_norm = ledger.norm(rollback);
      refuse_non_finite(last_norm);
      pipeline::apply_flush(states_, optimizer(rollback), last_norm);
    } else {
      last_norm = flush_step(optimizer(count - 1));  // the last step has no boundary after it
    }
    for (int t = 0; t < done; ++t) {
      StepStats& stats = out[std::size_t(first + t)];
      stats = measure_of_step(steps[std::size_t(first + t)], t, first);
      stats.grad_norm = t + 1 == done ? last_norm : ledger.norm(t);
      stats.rolled_back = t == rollback;
    }
    return first + done;
  }

  /// After a failed post-validated run: every stage back to the weights after the last step every
  /// worker finished, gradients zeroed. Workers are at most one boundary apart (see NormLedger).
  template <class Optimizer>
  void recover_post_validated(const pipeline::NormLedger& ledger, std::span<const Optimizer> optimizers) {
    const int low = ledger.passed_by_all();
    const bool stands = low < 0 || pipeline::update_stands(optimizers[std::size_t(low)], ledger.norm(low));
    states_.for_each([&](auto k, auto& st) {
      st.in_flight.clear();
      const int passed = ledger.passed(worker_of(decltype(k)::value));
      if (passed >= 0 && (!stands || passed == low + 1)) pipeline::restore(st);
    });
    if (!stands) pipeline::apply_flush(states_, optimizers[std::size_t(low)], ledger.norm(low));
    states_.for_each([](auto, auto& st) { st.zero_grads(); });
  }

  /// StepStats of step t of a post-validated run that started at step `first`: its own actions only.
  StepStats measure_of_step(const typename Executor::Step& step, int t, int first) {
    const int m = plan_.config.microbatches;
    std::vector<std::vector<ActionRecord>> mine(static_cast<std::size_t>(stages));
    std::vector<const std::vector<ActionRecord>*> records(std::size_t(stages), nullptr);
    for (int w = 0; w < stages; ++w) {
      if (!local(w)) continue;
      for (ActionRecord r : runtime_->records(w))
        if (r.microbatch / m == t) {
          r.microbatch += first * m;
          mine[std::size_t(w)].push_back(r);
        }
      records[std::size_t(w)] = &mine[std::size_t(w)];
    }
    index_t samples = 0;
    for (index_t rows : step.plan->rows) samples += rows;
    return measure(step, *step.plan, records, samples);
  }

  /// After the workers joined without a failure: waits for the step's sends, which may fail too.
  void finish_transport(std::exception_ptr& failure) {
    if (failure) return;
    try {
      transport_->finish_step();
    } catch (...) {
      failure = std::current_exception();
    }
  }

  std::size_t capacity() const {
    if (options_.channel_capacity > 0) return options_.channel_capacity;
    return std::size_t(2 * chunks * plan_.config.total_microbatches());
  }

  /// Shapes and pointers of a batch, in whichever memory it is.
  template <class Space>
  static void check_batch(TensorView<const input_type, Space> x, TensorView<const std::int32_t, Space> labels,
                          std::string_view who) {
    const index_t n = x.rows();
    check_view(x, Shape{n, in_features}, who, "input batch");
    if (labels.numel() != n)
      CUPIPE_THROW(Loss::describe(), ": expected labels (", n, ",) for the input batch ", x.shape(), " but got labels ",
                   labels.shape());
    check_view(labels, labels.shape(), who, "labels");
  }
  template <class Space>
  static void check_prediction(TensorView<const input_type, Space> x, const TensorView<T, Space>& out) {
    CUPIPE_REQUIRE(x.rows() > 0, "Pipeline::predict: the input has 0 rows; there is nothing to predict");
    check_view(x, Shape{x.rows(), in_features}, "Pipeline::predict", "input");
    if (x.rows() % rows_per_sample != 0)
      CUPIPE_THROW("Pipeline::predict: the input's ", x.rows(), " rows are not whole samples of ", rows_per_sample,
                   " rows (the model's sequences)");
    check_view(out, Shape{x.rows(), prediction_features}, "Pipeline::predict", "output");
  }

  /// The batch's inputs in the memory of the worker that runs the first stage; where another process
  /// runs it, only the shape (nothing here reads them).
  ConstViewOn<FirstBackend, input_type> stage_inputs(ConstView<input_type> x) {
    constexpr int w = worker_of(0);
    if (!local(w)) return {nullptr, x.shape()};
    return input_staging_(*workers_.template get<w>(), x);
  }
  /// The labels in the memory of the worker that runs the last stage (the one that computes the loss).
  ConstViewOn<LastBackend, std::int32_t> stage_labels(ConstView<std::int32_t> labels) {
    constexpr int w = worker_of(virtual_stages - 1);
    if (!local(w)) return {nullptr, labels.shape()};
    return label_staging_(*workers_.template get<w>(), labels);
  }

  template <optim::Optimizer Optimizer>
  StepStats train_resident(ConstViewOn<FirstBackend, input_type> x, ConstViewOn<LastBackend, std::int32_t> labels,
                           const Optimizer& optimizer) {
    prepare_slots<Optimizer>();
    // The update follows at once, so no more gradients accumulate: each stage's sum over the
    // replicas may start as soon as its last backward is done.
    early_sums_ = overlaps_gradient_sums();
    StepStats stats;
    try {
      stats = run(x, labels, Executor::StepOptimizer::of(optimizer));
    } catch (...) {
      early_sums_ = false;
      throw;
    }
    early_sums_ = false;
    for (const char started : sum_started_) stats.overlapped_gradient_sums += started;
    if constexpr (update_rule == schedule::UpdateRule::flush) stats.grad_norm = flush_step(optimizer);
    return stats;
  }

  StepStats forward_backward_resident(ConstViewOn<FirstBackend, input_type> x, ConstViewOn<LastBackend, std::int32_t> labels) {
    static_assert(update_rule == schedule::UpdateRule::flush,
                  "forward_backward: asynchronous schedules update inside the step; use train_step");
    return run(x, labels, {});
  }

  /// The last stage's output for x (empty where another process runs the last stage).
  typename Executor::output_buffer predict_resident(ConstViewOn<FirstBackend, input_type> x) {
    transport_->begin_step(1);
    return executor_->predict(x, pipeline::predict_message_id);
  }

  /// One step over a checked batch already in the backend's memory; `optimizer` updates inside it
  /// (asynchronous schedules; empty for flush schedules).
  StepStats run(ConstViewOn<FirstBackend, input_type> x, ConstViewOn<LastBackend, std::int32_t> labels,
                typename Executor::StepOptimizer optimizer) {
    const index_t n = x.rows();
    int base = 0;
    states_.for_each([&](auto, auto& st) { base = st.weights.latest(); });
    const pipeline::StepPlan step_plan = global_step_plan(n, base);
    typename Executor::Step step;
    step.plan = &step_plan;
    step.x = x;
    step.labels = labels;
    step.optimizer = optimizer;
    step.batches_before = batches_done_;
    step.losses.assign(std::size_t(step_plan.microbatches()), 0.0);

    const int total = plan_.config.total_microbatches();
    workers_.for_each([](int, auto& be) { be.memory.reset_peaks(); });
    states_.for_each([&](auto, auto& st) {
      st.done.assign(std::size_t(total), 0);
      st.done_in_batch.assign(std::size_t(plan_.config.batches), 0);
      st.weights.reset_peak();
    });
    // A flush step commits nothing before it ends, so the losses stay where the last stage computed
    // them and the device-side input checks report once, after the actions (asynchronous schedules
    // update inside the step: they read each loss and check each op's input at once).
    DeferredChecks deferred(workers_, update_rule == schedule::UpdateRule::flush);
    if constexpr (update_rule == schedule::UpdateRule::flush) {
      constexpr int last = worker_of(virtual_stages - 1);
      if (local(last))
        step.loss_slots = workers_.template get<last>()->template allocate<grad_t<LastBackend>>(
            index_t(step.losses.size()), MemoryTag::workspace);
    }
    transport_->begin_step(capacity());
    if (early_sums_) prepare_early_sums();
    std::exception_ptr failure = runtime_->run(
        plan_,
        [&](int w, const schedule::Action& a) {
          executor_->execute(w, a, step);
          if (early_sums_) start_sum_after(w, a);
        },
        [&] { transport_->abort(); });
    finish_transport(failure);
    if (!failure) {
      try {
        deferred.report();
        constexpr int last = worker_of(virtual_stages - 1);
        if (local(last)) executor_->collect_losses(step, *workers_.template get<last>());
      } catch (...) {
        failure = std::current_exception();
      }
    }
    if (failure) {
      // Sums already started write into the gradients: let them end before the gradients are zeroed
      // (the other replicas start theirs whatever happened here; a failure of theirs ends in the
      // collective timeout).
      if (any_sum_started()) {
        try {
          comm()->finish_sums();
        } catch (...) {
        }
        std::fill(sum_started_.begin(), sum_started_.end(), 0);
      }
      states_.for_each([](auto, auto& st) {
        st.in_flight.clear();
        st.zero_grads();
      });
      std::rethrow_exception(failure);
    }
    if constexpr (update_rule == schedule::UpdateRule::flush) {
      // Each replica divided by the global batch size, so the sum over the replicas will be the full
      // batch's gradient. It waits for the update (or gradients()): steps of forward_backward
      // accumulate locally and are reduced once.
      if (comm() && comm()->topology().replicas > 1) gradients_unreduced_ = true;
    } else {
      // Keep what the next step's first microbatch runs on.
      const int keep = schedule::version_of(plan_, executor_->version_offsets(), plan_.config.total_microbatches(), base,
                                            batches_done_);
      batches_done_ += plan_.config.batches;
      states_.for_each([&](auto, auto& st) { st.weights.drop_below(std::min(keep, st.weights.latest())); });
    }
    return measure(step, step_plan);
  }

  /// The device-side input checks of every context of this process, deferred for one step (see
  /// backend::capabilities::defer_input_checks): report() restores them and throws what the step's
  /// ops found; leaving without report() (a failed step) only restores them.
  class DeferredChecks {
   public:
    DeferredChecks(const Contexts& contexts, bool defer) : contexts_(contexts), defer_(defer) {
      if (!defer_) return;
      contexts_.for_each([&](int w, auto& be) {
        previous_[std::size_t(w)] = backend::defer_input_checks(be);
      });
    }
    DeferredChecks(const DeferredChecks&) = delete;
    DeferredChecks& operator=(const DeferredChecks&) = delete;
    ~DeferredChecks() {
      try {
        resume(false);
      } catch (...) {  // restoring a flag does not throw; nothing may leave a destructor
      }
    }
    void report() { resume(true); }

   private:
    void resume(bool report) {
      if (!defer_) return;
      defer_ = false;
      std::exception_ptr first;
      contexts_.for_each([&](int w, auto& be) {
        try {
          backend::resume_input_checks(be, previous_[std::size_t(w)], report);
        } catch (const error& e) {  // named as the runtime names a failed action's worker
          if (!first)
            first = std::make_exception_ptr(
                error("stage " + std::to_string(w) + ", after the step's actions: " + e.message(), e.call(), e.file(), e.line()));
        } catch (...) {
          if (!first) first = std::current_exception();
        }
      });
      if (first) std::rethrow_exception(first);
    }
    const Contexts& contexts_;
    bool defer_;
    std::array<bool, std::size_t(stages)> previous_{};
  };

  /// The step plan over this process's n rows; across replicas the normalizers count every
  /// replica's rows, which may differ.
  pipeline::StepPlan global_step_plan(index_t n, int base) {
    pipeline::StepPlan plan = pipeline::make_step_plan(plan_, executor_->version_offsets(), n, base, batches_done_,
                                                             rows_per_sample);
    global_samples_ = n;
    if (comm() && comm()->topology().replicas > 1) {
      std::vector<double> counts(plan.normalizer.begin(), plan.normalizer.end());
      counts.push_back(double(n));
      comm()->sum_over_replicas(counts.data(), counts.size());
      for (std::size_t j = 0; j < plan.normalizer.size(); ++j) plan.normalizer[j] = index_t(counts[j]);
      global_samples_ = index_t(counts.back());
    }
    return plan;
  }

  StepStats measure(const typename Executor::Step& step, const pipeline::StepPlan& plan) {
    std::vector<const std::vector<ActionRecord>*> records;
    for (int w = 0; w < stages; ++w) records.push_back(local(w) ? &runtime_->records(w) : nullptr);
    return measure(step, plan, records, global_samples_);
  }
  StepStats measure(const typename Executor::Step& step, const pipeline::StepPlan& plan,
                    const std::vector<const std::vector<ActionRecord>*>& records, index_t samples) {
    std::vector<int> peak_versions(std::size_t(stages), 0);
    states_.for_each([&](auto k, auto& st) {
      int& peak = peak_versions[std::size_t(plan_.placement.worker_of(decltype(k)::value))];
      peak = std::max(peak, st.weights.peak_live());
    });
    std::vector<const MemoryTracker*> memory(std::size_t(stages), nullptr);
    workers_.for_each([&](int w, auto& be) { memory[std::size_t(w)] = &be.memory; });
    StepStats stats = pipeline::measure_step(records, memory, peak_versions);
    stats.samples = samples;
    for (std::size_t j = 0; j < step.losses.size(); ++j)
      stats.loss += step.losses[j] * double(plan.normalizer[j]) / double(samples);
    // Only the last stage's ranks hold losses; of a tensor-parallel group, the first counts.
    if (comm()) stats.loss = comm()->sum_over_world(comm()->topology().tensor_rank() == 0 ? stats.loss : 0.0);
    return stats;
  }

  PipelineOptions options_;
  schedule::Plan plan_;
  Contexts workers_;  ///< each worker's context; none where another process runs it
  States states_;
  std::unique_ptr<typename Executor::TransportType> transport_;
  std::unique_ptr<pipeline::WorkerRuntime<Contexts>> runtime_;
  std::unique_ptr<Executor> executor_;
  backend::Staging<FirstBackend, input_type> input_staging_;
  backend::Staging<LastBackend, std::int32_t> label_staging_;
  std::int64_t batches_done_ = 0;
  index_t global_samples_ = 0;
  bool gradients_unreduced_ = false;  ///< flush schedules: this replica's own sums, not yet over the replicas
  bool early_sums_ = false;           ///< inside train_step: stage sums start during the backward
  std::vector<char> sum_started_;     ///< [virtual stage]: its sum was started in the step (one writer each)
  std::vector<schedule::Action> last_gradient_action_;  ///< [virtual stage], computed once
  TensorGroup* tensor_group_ = nullptr;  ///< with tensor parallelism: this stage's group (the communicator's)
  int local_worker_ = -1;  ///< the stage this process runs; -1: all of them
  int tied_worker_ = -1;   ///< post-validation: the worker that holds both tied copies
  std::map<int, schedule::Plan> repeated_;  ///< post-validation: plans of several steps, by step count
};

}  // namespace cupipe
