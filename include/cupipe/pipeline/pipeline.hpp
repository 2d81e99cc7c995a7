// SPDX-License-Identifier: Apache-2.0
// Pipeline<Stages, Schedule, Backend>: the front a trainer uses. It holds the parts and calls them;
// none of them calls back up:
//   options.hpp            PipelineOptions
//   checks.hpp             every refusal before a run: options, topology, plan, batch shapes
//   step_plan.hpp          how the batch splits, loss normalizers and weight versions (pure data)
//   step_loop.hpp          the one loop of every step: run the actions, wait for sends, measure
//   stage_executor.hpp     F, B, W and completion on one virtual stage; inference
//   worker_runtime.hpp     one thread per worker (kept across steps), failure propagation, action timing
//   transport.hpp          hand-over to a neighbour: LocalTransport (in process) or CommTransport (MPI, NCCL)
//   gradient_sync.hpp      where replicas meet: early sums, the flush reduction, ZeRO-1 and -2, TP norm, the update
//   parameter_shards.hpp   ZeRO-3: a stage's weights gathered over the replicas for its actions, then released
//   optimizer_step.hpp     optimizer slots, per-stage updates, sums and norms (what gradient_sync calls)
//   post_validated_run.hpp train_steps with post-validation
//   model_values.hpp       the whole model's parameters, gradients and optimizer state, for checkpoints
//   deferred_checks.hpp    device-side input checks reported once per flush step
//   equivalence.hpp        PipelineOptions::check_equivalence: the first steps against the unpipelined model
//   documents.hpp          packed sequences: a step's document borders checked, agreed and set per action
//   context_parallel.hpp   context parallelism: the ring checked and given to the workers, a sample's rows here
// docs/architecture.md draws a training step's path through them.
#pragma once

#include <algorithm>
#include <cstdint>
#include <exception>
#include <memory>
#include <span>
#include <utility>
#include <vector>

#include "cupipe/backend/staging.hpp"
#include "cupipe/comm/communicator.hpp"
#include "cupipe/core/error.hpp"
#include "cupipe/core/tensor.hpp"
#include "cupipe/layers/tensor_parallel.hpp"
#include "cupipe/optim/optimizers.hpp"
#include "cupipe/pipeline/checks.hpp"
#include "cupipe/pipeline/context_parallel.hpp"
#include "cupipe/pipeline/documents.hpp"
#include "cupipe/pipeline/equivalence.hpp"
#include "cupipe/pipeline/gradient_sync.hpp"
#include "cupipe/pipeline/model_values.hpp"
#include "cupipe/pipeline/options.hpp"
#include "cupipe/pipeline/parameter_shards.hpp"
#include "cupipe/pipeline/post_validated_run.hpp"
#include "cupipe/pipeline/prediction.hpp"
#include "cupipe/pipeline/stage_executor.hpp"
#include "cupipe/pipeline/stage_list_fit.hpp"  // and stage_list.hpp
#include "cupipe/pipeline/stage_states.hpp"
#include "cupipe/pipeline/stats.hpp"
#include "cupipe/pipeline/step_loop.hpp"
#include "cupipe/pipeline/step_plan.hpp"
#include "cupipe/pipeline/worker_runtime.hpp"
#include "cupipe/schedule/policy.hpp"
#include "cupipe/schedule/weights.hpp"

namespace cupipe {

/// `Backend` is one backend for every worker (backend::Host<float>, backend::Cuda<bfloat16, float>,
/// ...) or backend::PerWorker<one per worker>: then each worker runs its stages in its own precision
/// and memory space, and each hand-over converts (pipeline/hand_over.hpp). Such a mixed pipeline
/// runs in one process.
template <class Stages, schedule::SchedulePolicy RequestedSchedule, class Backend>
class Pipeline {
  // The stage list against the schedule: one sentence per mistake (pipeline/stage_list_fit.hpp).
  using Schedule = typename detail::stage_list_fit<Stages, RequestedSchedule>::type;
  using Executor = pipeline::StageExecutor<Stages, Schedule, Backend>;
  using Checks = pipeline::PipelineChecks<Stages, Schedule, Executor>;
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
  using stage_list = Stages;  ///< the virtual stages: stage_list::stage<k>::describe() lists stage k's layers
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
  /// A last layer split by columns over a tensor-parallel group (a vocabulary-parallel head): predict()
  /// assembles the whole output, prediction_features wide.
  static constexpr int output_parts =
      cupipe::output_parts<typename Model::body::template layer<Model::body::size - 1>>();
  static constexpr index_t prediction_features = out_features * output_parts;
  /// Rows that form one sample and stay in one microbatch (a sequence, for a transformer).
  static constexpr index_t rows_per_sample = Model::body::rows_per_sample;
  /// The model's tied copies (GPT-2's wte and lm_head), summed by every flush update.
  static constexpr TiedCopies tied = Model::body::tied;

  explicit Pipeline(PipelineOptions options = {}) : options_(std::move(options)) {
    Checks::options(options_);
    if constexpr (mixed) Checks::mixed(options_, states_);
    local_worker_ = Checks::local_worker(comm());
    tensor_group_ = Checks::tensor_group(comm());
    cp::ContextGroup* ring = pipeline::context_ring<Backend>(comm(), options_, rows_per_sample);
    const int tied_worker = options_.post_validation ? Checks::post_validation(options_, states_) : -1;
    const bool zero_sharded = options_.zero && comm() && comm()->topology().replicas > 1;
    if (options_.zero) Checks::zero(options_, zero_sharded);
    plan_ = Checks::plan(options_);
    split_ = {plan_.config.total_microbatches(), rows_per_sample / (ring ? ring->size() : 1)};
    for (int w = 0; w < stages; ++w)
      if (local(w)) workers_.make(w, options_.devices.empty() ? 0 : options_.devices[std::size_t(w)]);
    pipeline::join_groups(workers_, tensor_group_, ring, options_.paired_turns && comm() ? comm()->paired_expert_group() : nullptr);
    transport_ = pipeline::make_transport<Executor>(workers_, options_);
    runtime_ = std::make_unique<pipeline::WorkerRuntime<Contexts>>(
        workers_, stages, options_.measure_actions, pipeline::FlightSetup{options_.communicator, options_.flight_dir, options_.flight_on_signal},
        options_.pin_workers && !options_.communicator);
    executor_ = std::make_unique<Executor>(plan_, states_, *transport_, *runtime_, comm(), options_.check_finite,
        pipeline::HandOverWires(options_.hand_over, int(Stages::size)), pipeline::memory_of(options_));
    loop_ = std::make_unique<pipeline::StepLoop<Executor>>(plan_, workers_, states_, *transport_, *runtime_, *executor_,
                                                           comm(), local_worker_, options_.channel_capacity);
    sync_ = std::make_unique<Sync>(states_, plan_, pipeline::SyncSetup{comm(), tensor_group_, options_.zero, options_.check_finite});
    shards_ = std::make_unique<Shards>(states_, plan_, comm(), zero_sharded && options_.zero >= 3,
                                       options_.reshard_after_forward);
    if (options_.post_validation)
      post_validated_ = std::make_unique<PostValidated>(plan_, Schedule::name, workers_, states_, *executor_, *loop_,
                                                        *sync_, tied_worker, split_.rows_per_sample);
    // With tensor parallelism each rank draws its part of the whole model's initialisation.
    states_.template build<worker_of>(workers_, schedule::versions_held(plan_), options_.recompute, options_.seed,
                                      tensor_group_ ? tensor_group_->rank() : 0, zero_sharded ? options_.zero : 0, comm());
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
  /// The worker that runs virtual stage k, from the schedule's placement (stage and chunk counts only).
  static constexpr int worker_of(int virtual_stage) { return Executor::worker_at(virtual_stage); }
  /// Whether worker (physical stage) w runs in this process.
  bool local(int w) const noexcept { return local_worker_ < 0 || w == local_worker_; }
  comm::Communicator* comm() const noexcept { return options_.communicator.get(); }
  /// Whether this process writes checkpoints: the only one, or rank 0 across processes.
  bool writes_checkpoints() const noexcept { return !comm() || comm()->topology().rank == 0; }
  /// The whole model's parameters (tensor-parallel ones at their whole shape): the layout of parameters(),
  /// gradients(), optimizer_state(), the setters and checkpoints.
  static std::vector<ParamInfo> parameter_table() { return pipeline::ModelValues<States, Model>::table(); }
  /// Optimizer updates applied so far (per stage they are equal once a step has finished).
  std::int64_t updates() { std::int64_t n = 0; states_.for_each([&](auto, auto& st) { n = st.updates; }); return n; }

  /// One training step on a batch x (n, in_features) with labels (n,) (with PipelineOptions::
  /// packed_sequences also its document borders), all in host memory, on any backend: forward,
  /// backward and the update(s) the schedule prescribes. x goes to the worker that runs the first
  /// stage, the labels to the last one's (no copy on the host). Any n >= microbatches (x batches)
  /// works: their sizes then differ by at most a sample. check_equivalence checks it (equivalence.hpp).
  template <optim::Optimizer Optimizer>
  StepStats train_step(ConstView<input_type> x, ConstView<std::int32_t> labels, const Optimizer& optimizer, DocumentStarts documents = {}) {
    Checks::batch(x, labels, "Pipeline::train_step", split_);
    if constexpr (flush) if (equivalence_.due()) return equivalence_.template train_step<input_type>(*this, x, labels, optimizer, documents);
    return train_resident(stage_inputs(x), stage_labels(labels), optimizer, documents);
  }
  /// The same with the batch already in the backend's memory (device backends): x in the first
  /// stage's worker's, labels in the last stage's.
  template <optim::Optimizer Optimizer>
    requires(!mixed && !host_accessible<space>)
  StepStats train_step(ConstViewOn<FirstBackend, input_type> x, ConstViewOn<LastBackend, std::int32_t> labels,
                       const Optimizer& optimizer, DocumentStarts documents = {}) {
    Checks::batch(x, labels, "Pipeline::train_step", split_);
    return train_resident(x, labels, optimizer, documents);
  }

  /// Forward and backward only (flush schedules): gradients accumulate, weights stay. For tests and
  /// for callers that step the optimizer themselves with step(). Host arrays, as train_step.
  StepStats forward_backward(ConstView<input_type> x, ConstView<std::int32_t> labels, DocumentStarts documents = {}) {
    static_assert(flush, "forward_backward: asynchronous schedules update inside the step; use train_step");
    Checks::batch(x, labels, "Pipeline::forward_backward", split_);
    return run(stage_inputs(x), stage_labels(labels), {}, false, documents);
  }
  StepStats forward_backward(ConstViewOn<FirstBackend, input_type> x, ConstViewOn<LastBackend, std::int32_t> labels) requires(!host_accessible<space>) {
    static_assert(flush, "forward_backward: asynchronous schedules update inside the step; use train_step");
    Checks::batch(x, labels, "Pipeline::forward_backward", split_);
    return run(x, labels, {}, false, {});
  }

  /// Applies one flush update from the accumulated gradients, then zeroes them. Returns the global
  /// gradient norm before clipping.
  template <optim::Optimizer Optimizer>
  double step(const Optimizer& optimizer) {
    static_assert(update_rule == schedule::UpdateRule::flush, "step: only flush schedules update after the step");
    prepare_slots<Optimizer>();
    return sync_->flush_update(optimizer);
  }

  /// A batch in host memory, for train_steps (documents: as train_step's).
  struct Batch { ConstView<input_type> x; ConstView<std::int32_t> labels; DocumentStarts documents{}; };

  /// One training step per batch, in order, as train_step on each; with PipelineOptions::post_validation
  /// the steps overlap, bitwise equal to that (post_validated_run.hpp: how, and what stats then hold).
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
    for (const Batch& b : batches) Checks::batch(b.x, b.labels, "Pipeline::train_steps", split_);
    std::vector<StepStats> out;
    if (!options_.post_validation || batches.size() < 2) {
      for (std::size_t t = 0; t < batches.size(); ++t) out.push_back(train_step(batches[t].x, batches[t].labels, optimizers[t], batches[t].documents));
      return out;
    }
    if constexpr (update_rule == schedule::UpdateRule::flush) {
      prepare_slots<Optimizer>();
      for (const Batch& b : batches) pipeline::check_step_documents(b.documents, options_, b.x.rows(), split_.rows_per_sample, "Pipeline::train_steps");
      out = post_validated_->train(batches, optimizers);
    }
    return out;
  }

  /// Inference through all stages on the caller's thread: x (n, in_features) -> out (n, prediction_features),
  /// both in host memory, on any backend. Across processes every rank calls it with its replica's x
  /// (read by stage 0's ranks) and every rank gets the output. `documents`: x's borders (packed sequences).
  void predict(ConstView<input_type> x, TensorView<T> out, DocumentStarts documents = {}) {
    Checks::prediction(x, out, prediction_features, split_.rows_per_sample);
    auto result = predict_resident(stage_inputs(x), documents);
    constexpr int last = worker_of(virtual_stages - 1);
    const std::span<T> host(out.data(), std::size_t(out.numel()));
    if constexpr (output_parts == 1) {
      if (!comm()) {
        workers_.template get<last>()->download(result.data(), host);
        return;
      }
    }
    transport_->finish_step();
    pipeline::share_prediction<G, out_features, output_parts>(local(last) ? workers_.template get<last>() : nullptr,
                                                             result, host, x.rows(), *comm(), tensor_group_);
  }
  /// The same with x in the first stage's worker's memory and `out` in the last stage's (device
  /// backends, in one process).
  void predict(ConstViewOn<FirstBackend, input_type> x, ViewOn<LastBackend, T> out)
    requires(!host_accessible<space>)
  {
    Checks::prediction(x, out, prediction_features, split_.rows_per_sample);
    CUPIPE_REQUIRE(!comm(), "Pipeline::predict: across processes the output is gathered in host memory; pass host views");
    auto result = predict_resident(x);
    auto& be = *workers_.template get<worker_of(virtual_stages - 1)>();
    copy(be, ConstViewOn<LastBackend, T>{result.data(), out.shape()}, out);
    be.synchronize();
  }

  /// The whole model's parameters, in the unsplit model's flat layout (latest versions; the float
  /// master weights with bf16 storage); with tensor parallelism gathered over the group too.
  std::vector<G> parameters() { return values().parameters(); }
  /// The accumulated gradients, same layout, summed over the replicas (across processes a
  /// collective: every rank calls it).
  std::vector<G> gradients() { return sync_->read_summed([&] { return values().gradients(); }); }
  void set_parameters(std::span<const G> values) { this->values().set_parameters(values); }
  /// Optimizer state slot `slot` (e.g. 0 = exp_avg for AdamW), same layout; empty before the first
  /// update. With ZeRO-1 the replicas' shards are gathered first (a collective over the replicas).
  std::vector<G> optimizer_state(std::size_t slot) { return values().optimizer_state(slot); }
  /// Restores optimizer state and the update count (for checkpoints); slots must be prepared for
  /// `optimizer` first.
  template <optim::Optimizer Optimizer>
  void set_optimizer_state(const Optimizer&, std::size_t slot, std::span<const G> values, std::int64_t updates) {
    prepare_slots<Optimizer>();
    CUPIPE_REQUIRE(slot < Optimizer::slot_names.size(), "set_optimizer_state: ", Optimizer::name, " has ",
                   Optimizer::slot_names.size(), " state slots, not ", slot + 1);
    this->values().set_optimizer_state(slot, values, updates);
  }

 private:
  static constexpr bool flush = update_rule == schedule::UpdateRule::flush;
  using Sync = pipeline::GradientSync<States, Model, FirstBackend, flush>;
  using PostValidated = pipeline::PostValidatedRun<Executor, Sync>;
  using Shards = pipeline::ParameterShards<States>;

  pipeline::ModelValues<States, Model> values() {
    return {states_, comm(), tensor_group_, sync_->zero_sharded(), sync_->gradients_sharded(), shards_->on()};
  }

  template <class Optimizer>
  void prepare_slots() {
    states_.for_each([](auto, auto& st) { pipeline::prepare_slots<Optimizer>(st); });
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
                           const Optimizer& optimizer, DocumentStarts documents) {
    prepare_slots<Optimizer>();
    // The update follows at once, so no more gradients accumulate: each stage's sum over the
    // replicas may start as soon as its last backward is done.
    StepStats stats = run(x, labels, Executor::StepOptimizer::of(optimizer), sync_->overlaps_sums(), documents);
    stats.overlapped_gradient_sums = sync_->started();
    if constexpr (flush) stats.grad_norm = sync_->flush_update(optimizer);
    return stats;
  }

  /// The last stage's output for x (empty where another process runs the last stage).
  typename Executor::output_buffer predict_resident(ConstViewOn<FirstBackend, input_type> x, DocumentStarts documents = {}) {
    transport_->begin_step(1);
    return shards_->gathered([&] { return executor_->predict(x, pipeline::predict_message_id, documents); });
  }

  /// One step over a checked batch already in the backend's memory; `optimizer` updates inside it
  /// (asynchronous schedules; empty for flush schedules). `early_sums`: each stage's sum over the
  /// replicas starts when its gradients are complete.
  StepStats run(ConstViewOn<FirstBackend, input_type> x, ConstViewOn<LastBackend, std::int32_t> labels,
                typename Executor::StepOptimizer optimizer, bool early_sums, DocumentStarts documents) {
    pipeline::check_step_documents(documents, options_, x.rows(), split_.rows_per_sample);
    int base = 0;
    states_.for_each([&](auto, auto& st) { base = st.weights.latest(); });
    const pipeline::StepPlan step_plan =
        loop_->plan_step(executor_->version_offsets(), x.rows(), base, batches_done_, split_.rows_per_sample, global_samples_);
    typename Executor::Step step{&step_plan, x, labels, documents, std::vector<double>(std::size_t(step_plan.microbatches()), 0.0),
                                 {}, optimizer, batches_done_};
    if (early_sums) sync_->prepare_early_sums();
    const auto gathers = shards_->count();
    loop_->run_step(
        step, [&](int w, const schedule::Action& a) { shards_->before(w, a); },
        [&](int w, const schedule::Action& a) { if (early_sums) sync_->after_action(w, a); shards_->after(w, a); },
        [&] { shards_->abandon(); sync_->abandon_step(); });
    if constexpr (flush) {
      sync_->step_done();  // each replica divided by the global batch size: the sum will be the batch's gradient
    } else {
      // Keep what the next step's first microbatch runs on.
      const int keep = schedule::version_of(plan_, executor_->version_offsets(), plan_.config.total_microbatches(), base,
                                            batches_done_);
      batches_done_ += plan_.config.batches;
      states_.for_each([&](auto, auto& st) { st.weights.drop_below(std::min(keep, st.weights.latest())); });
    }
    StepStats stats = loop_->measure(step, step_plan, loop_->records(), global_samples_);
    shards_->report(stats, gathers);
    return stats;
  }

  PipelineOptions options_;
  pipeline::EquivalenceCheck<Model, FirstBackend, mixed> equivalence_{options_, flush};
  schedule::Plan plan_;
  Contexts workers_;  ///< each worker's context; none where another process runs it
  States states_;
  std::unique_ptr<typename Executor::TransportType> transport_;
  std::unique_ptr<pipeline::WorkerRuntime<Contexts>> runtime_;
  std::unique_ptr<Executor> executor_;
  std::unique_ptr<pipeline::StepLoop<Executor>> loop_;
  std::unique_ptr<Sync> sync_;
  std::unique_ptr<Shards> shards_;  ///< ZeRO-3's gathers and releases
  std::unique_ptr<PostValidated> post_validated_;  ///< with PipelineOptions::post_validation
  backend::Staging<FirstBackend, input_type> input_staging_;
  backend::Staging<LastBackend, std::int32_t> label_staging_;
  std::int64_t batches_done_ = 0;
  index_t global_samples_ = 0;
  TensorGroup* tensor_group_ = nullptr;  ///< with tensor parallelism: this stage's group (the communicator's)
  pipeline::BatchSplit split_;           ///< microbatches, and a sample's rows here (a share under context parallelism)
  int local_worker_ = -1;                ///< the stage this process runs; -1: all of them
};

}  // namespace cupipe
