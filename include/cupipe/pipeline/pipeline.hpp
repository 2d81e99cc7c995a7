// SPDX-License-Identifier: Apache-2.0
// Pipeline<Stages, Schedule, Backend>: runs a schedule policy's action lists, one worker thread per
// stage, on any backend.
//
// How a microbatch travels (see docs/architecture.md for the full story):
// 1. Before the workers start, every microbatch j gets its weight version v_j: the latest for
//    flush schedules; for PipeDream the number of updates stage 0 will have applied before its F_j
//    (read off the plan); for PipeDream-2BW max(t - 1, 0) for its batch t. Versions are a pure
//    function of the plan, so every stage agrees without talking (vertical sync).
// 2. F on virtual stage k takes its input (the batch rows for k = 0, else the activation message
//    from k - 1), runs its layers with version v_j, keeps a record of what backward needs, and
//    sends its output to k + 1; the last virtual stage computes the loss instead.
// 3. B takes the gradient message from k + 1 (the last stage differentiates the loss), runs the
//    backward with the same version v_j, and sends the input gradient to k - 1. Split schedules
//    (zero bubble) defer the weight gradient to W, which keeps the per-layer output gradients.
// 4. When a stage is done with a microbatch it frees its record and drops every weight version
//    that no unfinished microbatch will use; asynchronous schedules then apply their update.
// 5. Flush schedules update once all workers have joined: the global gradient norm is summed over
//    all stages, then each stage steps its optimizer.
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <climits>
#include <cmath>
#include <cstdint>
#include <exception>
#include <map>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <thread>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "cupipe/comm/communicator.hpp"
#include "cupipe/core/error.hpp"
#include "cupipe/core/tensor.hpp"
#include "cupipe/layers/network.hpp"
#include "cupipe/optim/optimizers.hpp"
#include "cupipe/pipeline/mailbox.hpp"
#include "cupipe/pipeline/stage_list.hpp"
#include "cupipe/pipeline/stats.hpp"
#include "cupipe/pipeline/versioned_weights.hpp"
#include "cupipe/schedule/schedule.hpp"

namespace cupipe {

struct PipelineOptions {
  /// Microbatches per batch (flush schedules) or per update period (2BW).
  int microbatches = 1;
  /// Asynchronous schedules only: batches that one train_step runs without a flush (0: 1).
  int batches = 0;
  /// Seeds the parameter initialisation (identical to Network<Model>(seed)).
  std::uint64_t seed = 0;
  /// Throw when a microbatch's loss is not finite.
  bool check_finite = true;
  /// Virtual stages that keep only their input after forward and recompute it in backward.
  std::vector<int> recompute{};
  /// Device of each worker, for device backends (several workers may share one). Empty: device 0.
  std::vector<int> devices{};
  /// Messages a worker's mailbox holds before senders wait; 0: enough for the schedule.
  std::size_t channel_capacity = 0;
  /// A receive that waits longer than this is an error naming the stage, action and peer; 0: wait.
  double transfer_timeout_seconds = 0;
  /// Host backend: BLAS threads per call. 0: one when several workers share this process — a
  /// multithreaded OpenBLAS called from several threads at once oversubscribes the cores (the
  /// 4-stage Fashion-MNIST MLP ran 11x slower on 2 cores) — else the BLAS library's default.
  /// The setting is process-wide.
  int host_blas_threads = 0;
  /// Across processes: this process runs the stage the communicator's topology gives it, sends to
  /// and receives from the other stages through it, and sums gradients over its replicas. Null: all
  /// stages run in this process.
  std::shared_ptr<comm::Communicator> communicator{};
};

namespace detail {
template <class B>
concept DeviceConstructible = std::is_constructible_v<B, int>;
}

template <class Stages, class Schedule, class Backend>
class Pipeline {
 public:
  using T = typename Backend::value_type;
  using Model = typename Stages::model;
  using Loss = typename Stages::loss;
  using input_type = model_input_t<typename Stages::template stage<0>, T>;
  static constexpr int virtual_stages = int(Stages::size);
  static constexpr int chunks = Schedule::chunks;
  static_assert(virtual_stages % chunks == 0,
                "Interleaved<V> needs the StageList's stage count to be a multiple of V: each of the p workers "
                "holds V chunks, so a list of p*V stages");
  static constexpr int stages = virtual_stages / chunks;
  static constexpr schedule::UpdateRule update_rule = Schedule::update;
  static constexpr bool split_backward = Schedule::split_backward;
  static constexpr int max_versions = update_rule == schedule::UpdateRule::flush ? 1 : dynamic_versions;
  static constexpr index_t in_features = Stages::in_features;
  static constexpr index_t out_features = Stages::out_features;

  explicit Pipeline(PipelineOptions options = {}) : options_(std::move(options)) {
    CUPIPE_REQUIRE(options_.microbatches >= 1, "Pipeline: microbatches must be at least 1, got ", options_.microbatches);
    CUPIPE_REQUIRE(options_.batches >= 0, "Pipeline: batches must not be negative, got ", options_.batches);
    if (update_rule == schedule::UpdateRule::flush && options_.batches > 1)
      CUPIPE_THROW("Pipeline: ", Schedule::name, " flushes after every batch, so batches must be 1, got ", options_.batches);
    CUPIPE_REQUIRE(options_.devices.empty() || int(options_.devices.size()) == stages, "Pipeline: ",
                   options_.devices.size(), " devices given for ", stages, " stages");
    if (comm()) {
      const comm::Topology& topology = comm()->topology();
      if (topology.stages != stages)
        CUPIPE_THROW("Pipeline: the communicator splits the world into ", topology.stages, " stages but this pipeline has ",
                     stages);
      local_worker_ = topology.stage();
    }
    for (int k : options_.recompute)
      CUPIPE_REQUIRE(k >= 0 && k < virtual_stages, "Pipeline: recompute names stage ", k, " but there are ",
                     virtual_stages, " (virtual) stages");
    if constexpr (requires { Backend::set_blas_threads(1); }) {
      const int workers_here = local_worker_ < 0 ? stages : 1;
      const int threads = options_.host_blas_threads > 0 ? options_.host_blas_threads : workers_here > 1 ? 1 : 0;
      if (threads > 0) Backend::set_blas_threads(threads);
    }
    plan_ = schedule::generate<Schedule>(
        schedule::Config{stages, options_.microbatches, chunks, std::max(options_.batches, 1)});
    if (const auto verdict = schedule::verify(plan_); !verdict)
      CUPIPE_THROW("Pipeline: the ", Schedule::name, " plan failed verification: ", verdict.message());
    versions_allowed_ = schedule::weight_versions(plan_);
    // The plan covers one step; 2BW also keeps W(t-1) across steps for the next step's first batch,
    // so it holds 2 versions even where one step's plan needs only 1.
    if constexpr (update_rule == schedule::UpdateRule::double_buffered)
      for (int& allowed : versions_allowed_) allowed = std::max(allowed, 2);
    plan_versions_ = schedule::detail::microbatch_versions(plan_);

    for (int w = 0; w < stages; ++w) {
      if (!local(w))
        backends_.push_back(nullptr);
      else if constexpr (detail::DeviceConstructible<Backend>)
        backends_.push_back(std::make_unique<Backend>(options_.devices.empty() ? 0 : options_.devices[std::size_t(w)]));
      else
        backends_.push_back(std::make_unique<Backend>());
      mailboxes_.push_back(std::make_unique<pipeline::Mailbox<Message>>(capacity()));
    }
    for_each_slot([&](auto k, auto& slot) {
      if (!local(worker_of(k))) return;
      using Seq = typename Stages::template stage<decltype(k)::value>;
      Backend& be = *backends_[std::size_t(worker_of(k))];
      const int allowed = versions_allowed_[std::size_t(worker_of(k))];
      slot = std::make_unique<StageState<Seq>>(be, allowed);
      std::vector<T> host(static_cast<std::size_t>(Seq::param_count));
      Seq::init(std::span<T>(host), options_.seed);
      be.upload(std::span<const T>(host), slot->weights.latest_data());
      slot->recompute = std::find(options_.recompute.begin(), options_.recompute.end(), int(k)) != options_.recompute.end();
    });
  }

  Pipeline(const Pipeline&) = delete;
  Pipeline& operator=(const Pipeline&) = delete;

  const schedule::Plan& plan() const noexcept { return plan_; }
  const PipelineOptions& options() const noexcept { return options_; }
  Backend& backend(int stage) { return *backends_.at(std::size_t(stage)); }
  static constexpr int worker_of(int virtual_stage) { return virtual_stage % stages; }
  /// Whether worker (physical stage) w runs in this process.
  bool local(int w) const noexcept { return local_worker_ < 0 || w == local_worker_; }
  comm::Communicator* comm() const noexcept { return options_.communicator.get(); }
  /// Whether this process writes checkpoints: the only one, or rank 0 across processes.
  bool writes_checkpoints() const noexcept { return !comm() || comm()->topology().rank == 0; }
  static std::vector<ParamInfo> parameter_table() { return Model::parameter_table(); }
  /// Optimizer updates applied so far (per stage they are equal once a step has finished).
  std::int64_t updates() {
    std::int64_t n = 0;
    for_each_stage([&](auto, auto& st) { n = st->updates; });
    return n;
  }

  /// One training step on a batch x (n, in_features) with labels (n,), both in the first and last
  /// workers' backend memory: forward, backward and the optimizer update(s) the schedule prescribes.
  template <optim::Optimizer Optimizer>
  StepStats train_step(ConstView<input_type> x, ConstView<std::int32_t> labels, const Optimizer& optimizer) {
    prepare_slots(optimizer);
    StepStats stats = run(x, labels, &optimizer);
    if constexpr (update_rule == schedule::UpdateRule::flush) stats.grad_norm = apply_flush_update(optimizer);
    return stats;
  }

  /// Forward and backward only (flush schedules): gradients accumulate, weights stay. For tests and
  /// for callers that step the optimizer themselves with step().
  StepStats forward_backward(ConstView<input_type> x, ConstView<std::int32_t> labels) {
    static_assert(update_rule == schedule::UpdateRule::flush,
                  "forward_backward: asynchronous schedules update inside the step; use train_step");
    return run(x, labels, static_cast<const optim::SGD*>(nullptr));
  }

  /// Applies one flush update from the accumulated gradients, then zeroes them. Returns the global
  /// gradient norm before clipping.
  template <optim::Optimizer Optimizer>
  double step(const Optimizer& optimizer) {
    static_assert(update_rule == schedule::UpdateRule::flush, "step: only flush schedules update after the step");
    prepare_slots(optimizer);
    return apply_flush_update(optimizer);
  }

  /// Inference through all stages on the caller's thread: x (n, in_features) -> out (n, out_features).
  /// Across processes every rank calls it with its replica's x (read by stage 0's ranks) and gets
  /// the output in host memory `out` (host backends).
  void predict(ConstView<input_type> x, TensorView<T> out) {
    check_view(out, Shape{x.rows(), out_features}, "Pipeline::predict", "output");
    const index_t rows = x.rows();
    typename Backend::template buffer<T> carry;
    int carry_worker = -1;
    for_each_slot([&](auto k, auto&) {
      constexpr int K = decltype(k)::value;
      using Seq = typename Stages::template stage<K>;
      const int w = worker_of(K);
      if (!local(w)) return;
      Backend& be = *backends_[std::size_t(w)];
      if constexpr (K > 0) {
        if (carry_worker != w) carry = receive_remote(w, {comm::Flow::activation, K, predict_microbatch}, K - 1, rows * Seq::in_features);
      }
      auto& st = *std::get<K>(states_);
      auto record = be.template allocate<T>(Seq::record_elements(rows), MemoryTag::activations);
      if constexpr (K == 0) Seq::forward(be, st.weights.latest_data(), x, record.data());
      else Seq::forward(be, st.weights.latest_data(), ConstView<T>{carry.data(), Shape{rows, Seq::in_features}}, record.data());
      const ConstView<T> output = Seq::output(record.data(), rows);
      if (K + 1 < virtual_stages && !local(worker_of(K + 1))) {
        send_remote(w, worker_of(K + 1), {comm::Flow::activation, K + 1, predict_microbatch}, output);
        carry_worker = -1;
      } else {
        auto next = be.template allocate<T>(rows * Seq::out_features, MemoryTag::activations);
        copy(be, output, TensorView<T>{next.data(), Shape{rows, Seq::out_features}});
        be.synchronize();
        carry = std::move(next);
        carry_worker = worker_of(K + 1 < virtual_stages ? K + 1 : K);
      }
    });
    if (!comm()) {
      copy(*backends_.back(), ConstView<T>{carry.data(), Shape{rows, out_features}}, out);
      backends_.back()->synchronize();
      return;
    }
    // The last stage's ranks hold the output; a sum over the pipeline gives it to every stage.
    std::vector<T> host(static_cast<std::size_t>(rows * out_features), T(0));
    if (local(stages - 1)) backends_[std::size_t(stages - 1)]->download(carry.data(), std::span<T>(host));
    comm()->complete_sends(options_.transfer_timeout_seconds);
    comm()->sum_over_stages(host.data(), host.size());
    std::copy(host.begin(), host.end(), out.data());
  }

  /// The whole model's parameters, in the unsplit model's flat layout (latest versions).
  std::vector<T> parameters() { return gather([](auto& st) { return st.weights.latest_data(); }); }
  /// The accumulated gradients, same layout.
  std::vector<T> gradients() { return gather([](auto& st) { return st.grads.data(); }); }
  void set_parameters(std::span<const T> values) {
    scatter(values, [](auto& st) { return st.weights.latest_data(); });
  }
  /// Optimizer state slot `slot` (e.g. 0 = exp_avg for AdamW), same layout; empty before the first update.
  std::vector<T> optimizer_state(std::size_t slot) {
    bool prepared = true;
    for_each_stage([&](auto, auto& st) { prepared = prepared && st->slots.size() > slot; });
    if (!prepared) return {};
    return gather([slot](auto& st) { return st.slots[slot].data(); });
  }
  /// Restores optimizer state and the update count (for checkpoints); slots must be prepared for
  /// `optimizer` first.
  template <optim::Optimizer Optimizer>
  void set_optimizer_state(const Optimizer& optimizer, std::size_t slot, std::span<const T> values, std::int64_t updates) {
    prepare_slots(optimizer);
    CUPIPE_REQUIRE(slot < Optimizer::slot_names.size(), "set_optimizer_state: ", Optimizer::name, " has ",
                   Optimizer::slot_names.size(), " state slots, not ", slot + 1);
    scatter(values, [slot](auto& st) { return st.slots[slot].data(); });
    for_each_stage([&](auto, auto& st) { st->updates = updates; });
  }

 private:
  struct Message {
    typename Backend::template buffer<T> data;
  };

  template <class Seq>
  struct StageState {
    using buffer = typename Backend::template buffer<T>;
    struct InFlight {
      index_t rows = 0;
      int version = 0;
      buffer input;        // received activation (empty on virtual stage 0: the batch rows are used)
      buffer record;       // what backward needs
      buffer grad_record;  // per-layer output gradients, kept for W
      buffer dy;           // incoming gradient, kept for W
    };

    StageState(Backend& backend, int allowed_versions)
        : be(&backend),
          weights(backend, Seq::param_count, allowed_versions),
          grads(backend.template allocate<T>(Seq::param_count, MemoryTag::gradients)) {
      fill(backend, TensorView<T>{grads.data(), Shape{Seq::param_count}}, T(0));
    }

    Backend* be;
    VersionedWeights<Backend, max_versions> weights;
    buffer grads;
    std::vector<buffer> slots;
    std::string slots_for;  // the optimizer the slots belong to
    std::int64_t updates = 0;
    bool recompute = false;
    std::map<int, InFlight> in_flight;
    std::vector<char> done;           // per microbatch of the running step
    std::vector<int> done_in_batch;   // per batch of the running step
  };

  template <std::size_t... K>
  static auto make_states(std::index_sequence<K...>)
      -> std::tuple<std::unique_ptr<StageState<typename Stages::template stage<K>>>...>;
  using States = decltype(make_states(std::make_index_sequence<Stages::size>()));

  /// Every virtual stage, in order, with its (possibly null, when remote) state pointer.
  template <class F>
  void for_each_slot(F&& f) {
    [&]<std::size_t... K>(std::index_sequence<K...>) {
      (f(std::integral_constant<int, int(K)>{}, std::get<K>(states_)), ...);
    }(std::make_index_sequence<Stages::size>());
  }
  /// Every virtual stage that runs in this process.
  template <class F>
  void for_each_stage(F&& f) {
    for_each_slot([&](auto k, auto& slot) {
      if (slot) f(k, slot);
    });
  }
  template <class F>
  void with_stage(int k, F&& f) {
    [&]<std::size_t... K>(std::index_sequence<K...>) {
      ((int(K) == k ? (f(std::integral_constant<int, int(K)>{}, *std::get<K>(states_)), 0) : 0), ...);
    }(std::make_index_sequence<Stages::size>());
  }

  std::size_t capacity() const {
    if (options_.channel_capacity > 0) return options_.channel_capacity;
    return std::size_t(2 * chunks * plan_.config.total_microbatches());
  }

  /// Offset of virtual stage k's parameters in the whole model's flat layout.
  template <int K>
  static constexpr index_t model_offset() {
    return []<std::size_t... J>(std::index_sequence<J...>) {
      return (index_t{0} + ... + Stages::template stage<J>::param_count);
    }(std::make_index_sequence<std::size_t(K)>());
  }

  /// The whole model's flat array from every stage's slice (across processes, a sum over the
  /// pipeline in which every other rank contributes zeros).
  template <class Pointer>
  std::vector<T> gather(Pointer pointer) {
    std::vector<T> out(static_cast<std::size_t>(Model::body::param_count), T(0));
    for_each_stage([&](auto k, auto& st) {
      using Seq = typename Stages::template stage<decltype(k)::value>;
      st->be->download(pointer(*st), std::span<T>(out.data() + model_offset<decltype(k)::value>(), std::size_t(Seq::param_count)));
    });
    if (comm()) comm()->sum_over_stages(out.data(), out.size());
    return out;
  }
  template <class Pointer>
  void scatter(std::span<const T> values, Pointer pointer) {
    CUPIPE_REQUIRE(index_t(values.size()) == Model::body::param_count, "Pipeline: got ", values.size(),
                   " values for a model of ", Model::body::param_count, " parameters");
    for_each_stage([&](auto k, auto& st) {
      using Seq = typename Stages::template stage<decltype(k)::value>;
      st->be->upload(values.subspan(std::size_t(model_offset<decltype(k)::value>()), std::size_t(Seq::param_count)), pointer(*st));
    });
  }

  template <class Optimizer>
  void prepare_slots(const Optimizer&) {
    for_each_stage([&](auto k, auto& st) {
      using Seq = typename Stages::template stage<decltype(k)::value>;
      if (st->slots_for == Optimizer::name && st->slots.size() == Optimizer::slot_names.size()) return;
      st->slots.clear();
      for (std::size_t i = 0; i < Optimizer::slot_names.size(); ++i) {
        st->slots.push_back(st->be->template allocate<T>(Seq::param_count, MemoryTag::optimizer));
        fill(*st->be, TensorView<T>{st->slots.back().data(), Shape{Seq::param_count}}, T(0));
      }
      st->slots_for = std::string(Optimizer::name);
    });
  }

  /// Updates one stage from its gradients, then zeroes them.
  template <class Seq, class Optimizer>
  void update_stage(StageState<Seq>& st, T* params, const Optimizer& optimizer, double grad_scale) {
    Backend& be = *st.be;
    std::vector<TensorView<T>> slots;
    for (auto& s : st.slots) slots.push_back({s.data(), Shape{Seq::param_count}});
    optimizer.update(be, TensorView<T>{params, Shape{Seq::param_count}}, ConstView<T>{st.grads.data(), Shape{Seq::param_count}},
                     std::span<const TensorView<T>>(slots), st.updates, grad_scale);
    fill(be, TensorView<T>{st.grads.data(), Shape{Seq::param_count}}, T(0));
    ++st.updates;
  }

  template <class Optimizer>
  double apply_flush_update(const Optimizer& optimizer) {
    double sum = 0;
    for_each_stage([&](auto k, auto& st) {
      using Seq = typename Stages::template stage<decltype(k)::value>;
      sum += sum_of_squares(*st->be, ConstView<T>{st->grads.data(), Shape{Seq::param_count}});
    });
    if (comm()) sum = comm()->sum_over_stages(sum);  // replicas hold the same summed gradients
    const double norm = std::sqrt(sum);
    const double scale = optim::clip_factor(norm, optimizer.clip_norm());
    for_each_stage([&](auto, auto& st) { update_stage(*st, st->weights.latest_data(), optimizer, scale); });
    return norm;
  }

  // ---- one step --------------------------------------------------------------------------------

  struct Step {
    ConstView<input_type> x;
    ConstView<std::int32_t> labels;
    std::vector<index_t> first, rows, normalizer;
    std::vector<int> version;
    std::vector<double> losses;
    std::chrono::steady_clock::time_point start;
    std::mutex failure_mutex;
    std::exception_ptr failure;
    std::atomic<bool> failed{false};
    std::vector<std::vector<ActionRecord>> records;
    /// Per worker: when the running action's input had arrived (its start; waiting is idle time).
    std::vector<double> action_start;
    /// Device backends: per worker, the running action's start mark and every action's (start, end)
    /// marks on the worker's stream, read as device time after the step.
    std::vector<int> action_mark;
    std::vector<std::vector<std::pair<int, int>>> marks;
    const void* optimizer = nullptr;

    double now() const { return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count(); }
  };

  /// Splits n samples into microbatches of ceil(n / M) rows, the last one ragged.
  void split_batch(Step& step, index_t n) const {
    const schedule::Config& c = plan_.config;
    const int total = c.total_microbatches();
    if (n < total)
      CUPIPE_THROW("Pipeline: a batch of ", n, " samples cannot be split into ", total, " microbatches");
    const index_t size = (n + total - 1) / total;
    if (size * (total - 1) >= n)
      CUPIPE_THROW("Pipeline: a batch of ", n, " samples split into ", total, " microbatches of ", size,
                   " leaves the last one empty; use a batch size that is a multiple of ", total, " or close to one");
    step.first.resize(std::size_t(total));
    step.rows.resize(std::size_t(total));
    step.normalizer.resize(std::size_t(total));
    for (int j = 0; j < total; ++j) {
      step.first[std::size_t(j)] = j * size;
      step.rows[std::size_t(j)] = std::min(size, n - j * size);
    }
    for (int j = 0; j < total; ++j) {
      const int batch = j / c.microbatches;
      index_t batch_rows = 0;
      for (int i = batch * c.microbatches; i < (batch + 1) * c.microbatches; ++i) batch_rows += step.rows[std::size_t(i)];
      step.normalizer[std::size_t(j)] = update_rule == schedule::UpdateRule::flush             ? n
                                        : update_rule == schedule::UpdateRule::per_microbatch ? step.rows[std::size_t(j)]
                                                                                               : batch_rows;
    }
  }

  template <class Optimizer>
  StepStats run(ConstView<input_type> x, ConstView<std::int32_t> labels, const Optimizer* optimizer) {
    const index_t n = x.rows();
    check_view(x, Shape{n, in_features}, "Pipeline::train_step", "input batch");
    if (labels.numel() != n)
      CUPIPE_THROW(Loss::describe(), ": expected labels (", n, ",) for the input batch ", x.shape(), " but got labels ",
                   labels.shape());
    Step step;
    step.x = x;
    step.labels = labels;
    step.optimizer = optimizer;
    split_batch(step, n);
    index_t global_n = n;
    if (comm() && comm()->topology().replicas > 1) {
      // Replicas may hold different shares of the batch: normalise by the global counts.
      std::vector<double> counts(step.normalizer.begin(), step.normalizer.end());
      counts.push_back(double(n));
      comm()->sum_over_replicas(counts.data(), counts.size());
      for (std::size_t j = 0; j < step.normalizer.size(); ++j) step.normalizer[j] = index_t(counts[j]);
      global_n = index_t(counts.back());
    }
    const int total = plan_.config.total_microbatches();
    step.losses.assign(std::size_t(total), 0.0);
    step.version.resize(std::size_t(total));
    int base = 0;
    for_each_stage([&](auto, auto& st) { base = st->weights.latest(); });
    for (int j = 0; j < total; ++j) {
      const int v = plan_versions_[std::size_t(j)];
      step.version[std::size_t(j)] = update_rule == schedule::UpdateRule::flush ? base
                                     : update_rule == schedule::UpdateRule::per_microbatch
                                         ? base + v
                                         : std::max(int(batches_done_) + j / plan_.config.microbatches - 1, 0);
    }
    for (auto& be : backends_)
      if (be) be->memory.reset_peaks();
    for_each_stage([&](auto, auto& st) {
      st->done.assign(std::size_t(total), 0);
      st->done_in_batch.assign(std::size_t(plan_.config.batches), 0);
      st->weights.reset_peak();
    });
    for (auto& box : mailboxes_) box->reset(capacity());
    step.records.resize(std::size_t(stages));
    step.action_start.assign(std::size_t(stages), 0.0);
    if constexpr (Backend::on_device) {
      step.action_mark.assign(std::size_t(stages), 0);
      step.marks.resize(std::size_t(stages));
      for (auto& be : backends_)
        if (be) be->timeline_start();
    }

    step.start = std::chrono::steady_clock::now();
    {
      std::vector<std::jthread> workers;
      for (int w = 0; w < stages; ++w)
        if (local(w)) workers.emplace_back([this, w, &step] { run_worker<Optimizer>(w, step); });
    }  // joins every worker, also when one failed
    if (comm() && !step.failure) {
      try {
        comm()->complete_sends(options_.transfer_timeout_seconds);
      } catch (...) {
        step.failure = std::current_exception();
      }
    }
    if (step.failure) {
      for_each_stage([&](auto k, auto& st) {
        using Seq = typename Stages::template stage<decltype(k)::value>;
        st->in_flight.clear();
        fill(*st->be, TensorView<T>{st->grads.data(), Shape{Seq::param_count}}, T(0));
      });
      std::rethrow_exception(step.failure);
    }
    if constexpr (Backend::on_device) {
      // Device time: from each worker's origin event (all recorded together just before the
      // workers started) to its action marks, so the timeline shows kernels, not enqueueing.
      for (int w = 0; w < stages; ++w) {
        if (!local(w)) continue;
        auto& records = step.records[std::size_t(w)];
        for (std::size_t i = 0; i < records.size(); ++i) {
          records[i].start = backends_[std::size_t(w)]->timeline_seconds(step.marks[std::size_t(w)][i].first);
          records[i].end = backends_[std::size_t(w)]->timeline_seconds(step.marks[std::size_t(w)][i].second);
        }
      }
    }
    if constexpr (update_rule == schedule::UpdateRule::flush) {
      // Sum each stage's gradients over its replicas (every replica already divided by the global
      // batch size, so the sum is the full batch's gradient).
      if (comm() && comm()->topology().replicas > 1)
        for_each_stage([&](auto k, auto& st) { sum_replicas<typename Stages::template stage<decltype(k)::value>>(*st); });
    }
    if constexpr (update_rule != schedule::UpdateRule::flush) {
      batches_done_ += plan_.config.batches;
      const int keep = update_rule == schedule::UpdateRule::per_microbatch ? INT_MAX : std::max(int(batches_done_) - 1, 0);
      for_each_stage([&](auto, auto& st) { st->weights.drop_below(std::min(keep, st->weights.latest())); });
    }
    return measure(step, n, global_n);
  }

  /// Sums a stage's gradients over its replicas (through host memory unless the communicator takes
  /// device memory).
  template <class Seq>
  void sum_replicas(StageState<Seq>& st) {
    if (!comm() || comm()->topology().replicas == 1) return;
    if (!Backend::on_device || comm()->device_memory()) {
      st.be->synchronize();
      comm()->sum_over_replicas(st.grads.data(), std::size_t(Seq::param_count));
      return;
    }
    std::vector<T> host(static_cast<std::size_t>(Seq::param_count));
    st.be->download(st.grads.data(), std::span<T>(host));
    comm()->sum_over_replicas(host.data(), host.size());
    st.be->upload(std::span<const T>(host), st.grads.data());
  }

  StepStats measure(Step& step, index_t n, index_t global_n) {
    StepStats stats;
    stats.samples = global_n;
    for (std::size_t j = 0; j < step.losses.size(); ++j)
      stats.loss += step.losses[j] * double(step.normalizer[j]) / double(global_n);
    if (comm()) stats.loss = comm()->sum_over_world(stats.loss);  // only the last stage's ranks hold losses
    (void)n;
    double first = 1e300, last = 0;
    for (auto& per_stage : step.records)
      for (auto& r : per_stage) {
        first = std::min(first, r.start);
        last = std::max(last, r.end);
      }
    stats.makespan_seconds = last > first ? last - first : 0;
    double idle_total = 0;
    for (int w = 0; w < stages; ++w) {
      if (!local(w)) {
        // Another process ran this stage; its figures are in that process's StepStats.
        stats.busy_seconds.push_back(0);
        stats.idle_seconds.push_back(0);
        stats.peak_activation_bytes.push_back(0);
        stats.peak_weight_bytes.push_back(0);
        stats.peak_weight_versions.push_back(0);
        continue;
      }
      double busy = 0;
      for (auto& r : step.records[std::size_t(w)]) busy += r.end - r.start;
      stats.busy_seconds.push_back(busy);
      stats.idle_seconds.push_back(stats.makespan_seconds - busy);
      idle_total += stats.makespan_seconds - busy;
      stats.peak_activation_bytes.push_back(backends_[std::size_t(w)]->memory.peak(MemoryTag::activations));
      stats.peak_weight_bytes.push_back(backends_[std::size_t(w)]->memory.peak(MemoryTag::weights));
      stats.peak_weight_versions.push_back(0);
      for (auto& r : step.records[std::size_t(w)]) stats.actions.push_back(r);
    }
    for_each_stage([&](auto k, auto& st) {
      int& peak = stats.peak_weight_versions[std::size_t(worker_of(k))];
      peak = std::max(peak, st->weights.peak_live());
    });
    const int measured_stages = local_worker_ < 0 ? stages : 1;
    stats.bubble_fraction = stats.makespan_seconds > 0 ? idle_total / (measured_stages * stats.makespan_seconds) : 0;
    return stats;
  }

  template <class Optimizer>
  void run_worker(int w, Step& step) {
    auto& records = step.records[std::size_t(w)];
    records.reserve(plan_.actions[std::size_t(w)].size());
    for (const schedule::Action& a : plan_.actions[std::size_t(w)]) {
      if (step.failed.load(std::memory_order_acquire)) return;
      const int k = schedule::virtual_stage(w, a.chunk, stages);
      step.action_start[std::size_t(w)] = step.now();  // moved on by receive() once the input is there
      try {
        const auto run_action = [&] { with_stage(k, [&](auto K, auto& st) { execute<decltype(K)::value, Optimizer>(st, a, step); }); };
        if constexpr (Backend::on_device) {
          Backend& be = *backends_[std::size_t(w)];
          step.action_mark[std::size_t(w)] = be.timeline_mark();
          // Named like the trace's labels ("F3", "B3a"), so Nsight shows the schedule.
          const auto range = be.annotate(schedule::detail::event_label({w, a.kind, a.microbatch, a.chunk, 0, 0}, chunks > 1).c_str());
          run_action();
          step.marks[std::size_t(w)].emplace_back(step.action_mark[std::size_t(w)], be.timeline_mark());
        } else {
          run_action();
        }
      } catch (const pipeline::Aborted&) {
        return;
      } catch (const error& e) {
        fail(step, w, k, a, e.message(), e.call(), e.file(), e.line());
        return;
      } catch (const std::exception& e) {
        fail(step, w, k, a, e.what(), "", __FILE__, __LINE__);
        return;
      }
      records.push_back({w, a.kind, a.microbatch, a.chunk, step.action_start[std::size_t(w)], step.now()});
    }
  }

  static std::string describe_action(int w, int k, const schedule::Action& a) {
    static constexpr const char* kinds[] = {"F", "B", "W"};
    std::string out = "stage " + std::to_string(w);
    if (chunks > 1) out += " (virtual stage " + std::to_string(k) + ")";
    return out + ", action " + kinds[int(a.kind)] + std::to_string(a.microbatch);
  }

  void fail(Step& step, int w, int k, const schedule::Action& a, const std::string& message, const std::string& call,
            const std::string& file, int line) {
    {
      std::lock_guard lock(step.failure_mutex);
      if (!step.failure)
        step.failure = std::make_exception_ptr(error(describe_action(w, k, a) + ": " + message, call, file, line));
    }
    step.failed.store(true, std::memory_order_release);
    for (auto& box : mailboxes_) box->abort();
  }

  template <int K, class Optimizer, class St>
  void execute(St& st, const schedule::Action& a, Step& step) {
    switch (a.kind) {
      case schedule::ActionKind::F: forward<K>(st, a, step); break;
      case schedule::ActionKind::B: backward<K, Optimizer>(st, a, step); break;
      case schedule::ActionKind::W: weight<K, Optimizer>(st, a, step); break;
    }
  }

  template <int K>
  using stage_seq = typename Stages::template stage<K>;

  template <int K, class InFlight>
  auto stage_input(InFlight& f, const Step& step, int j) {
    using Seq = stage_seq<K>;
    if constexpr (K == 0) return ConstView<input_type>(step.x.row_slice(step.first[std::size_t(j)], f.rows));
    else return ConstView<T>{f.input.data(), Shape{f.rows, Seq::in_features}};
  }

  static ConstView<std::int32_t> microbatch_labels(const Step& step, int j) {
    return {step.labels.data() + step.first[std::size_t(j)], Shape{step.rows[std::size_t(j)]}};
  }

  std::chrono::duration<double> timeout() const { return std::chrono::duration<double>(options_.transfer_timeout_seconds); }

  /// Copies `from` into a buffer owned by worker `to_worker`'s backend (the `transfer` customization
  /// point) and posts it; to a stage in another process, sends it through the communicator.
  void send(int from_worker, int to_worker, pipeline::MessageKey key, ConstView<T> from) {
    if (!local(to_worker)) return send_remote(from_worker, to_worker, key, from);
    Backend& target = *backends_[std::size_t(to_worker)];
    Message message{target.template allocate<T>(from.numel(), MemoryTag::activations)};
    Backend& source = *backends_[std::size_t(from_worker)];
    // Host: a copy. Device backends order it between the two streams without a host wait.
    transfer(source, target, from, TensorView<T>{message.data.data(), from.shape()});
    mailboxes_[std::size_t(to_worker)]->send(key, std::move(message));
  }

  static std::string describe_wait(pipeline::MessageKey key, int peer_worker) {
    return std::string("waiting for the ") + (key.flow == pipeline::Flow::activation ? "activation" : "gradient") +
           " of microbatch " + std::to_string(key.microbatch) + " from stage " + std::to_string(peer_worker);
  }

  /// Waits for a message of `elements` values; the action's measured time starts when it arrives.
  Message receive(Step& step, int worker, pipeline::MessageKey key, int peer_virtual_stage, index_t elements) {
    const int peer = worker_of(peer_virtual_stage);
    Message message = local(peer) ? mailboxes_[std::size_t(worker)]->receive(key, timeout(), [&] { return describe_wait(key, peer); })
                                  : Message{receive_remote(worker, key, peer_virtual_stage, elements)};
    step.action_start[std::size_t(worker)] = step.now();
    if constexpr (Backend::on_device) step.action_mark[std::size_t(worker)] = backends_[std::size_t(worker)]->timeline_mark();
    return message;
  }

  void send_remote(int from_worker, int to_worker, pipeline::MessageKey key, ConstView<T> from) {
    Backend& source = *backends_[std::size_t(from_worker)];
    source.synchronize();
    auto describe = [&] {
      return std::string("sending the ") + (key.flow == pipeline::Flow::activation ? "activation" : "gradient") +
             " of microbatch " + std::to_string(key.microbatch) + " to stage " + std::to_string(to_worker);
    };
    const std::size_t bytes = std::size_t(from.numel()) * sizeof(T);
    if (!Backend::on_device || comm()->device_memory()) {
      comm()->send(to_worker, key, from.data(), bytes, describe);
    } else {
      std::vector<T> host(static_cast<std::size_t>(from.numel()));
      source.download(from.data(), std::span<T>(host));
      comm()->send(to_worker, key, host.data(), bytes, describe);
    }
  }

  typename Backend::template buffer<T> receive_remote(int worker, pipeline::MessageKey key, int peer_virtual_stage,
                                                      index_t elements) {
    Backend& be = *backends_[std::size_t(worker)];
    auto data = be.template allocate<T>(elements, MemoryTag::activations);
    const int peer = worker_of(peer_virtual_stage);
    auto describe = [&] { return describe_wait(key, peer); };
    const std::size_t bytes = std::size_t(elements) * sizeof(T);
    if (!Backend::on_device || comm()->device_memory()) {
      // The block may have come straight back from work still queued on this worker's stream; a
      // transport writing on its own stream must not start before that work is done.
      if constexpr (Backend::on_device) be.synchronize();
      comm()->receive(peer, key, data.data(), bytes, options_.transfer_timeout_seconds, describe);
    } else {
      std::vector<T> host(static_cast<std::size_t>(elements));
      comm()->receive(peer, key, host.data(), bytes, options_.transfer_timeout_seconds, describe);
      be.upload(std::span<const T>(host), data.data());
    }
    return data;
  }

  template <int K, class St>
  void forward(St& st, const schedule::Action& a, Step& step) {
    using Seq = stage_seq<K>;
    Backend& be = *st.be;
    const int j = a.microbatch;
    typename St::InFlight f;
    f.rows = step.rows[std::size_t(j)];
    f.version = step.version[std::size_t(j)];
    if constexpr (K > 0)
      f.input = std::move(receive(step, worker_of(K), {pipeline::Flow::activation, K, j}, K - 1, f.rows * Seq::in_features).data);
    f.record = be.template allocate<T>(Seq::record_elements(f.rows), MemoryTag::activations);
    const T* params = st.weights.data(f.version);
    const auto x0 = stage_input<K>(f, step, j);
    Seq::forward(be, params, x0, f.record.data());
    const ConstView<T> out = Seq::output(f.record.data(), f.rows);
    if constexpr (K + 1 < virtual_stages) {
      send(worker_of(K), worker_of(K + 1), {pipeline::Flow::activation, K + 1, j}, out);
    } else {
      const auto labels = microbatch_labels(step, j);
      auto loss = be.template allocate<T>(1, MemoryTag::workspace);
      Loss::forward(be, out, labels, TensorView<T>{loss.data(), Shape{1}}, step.normalizer[std::size_t(j)]);
      T value{};
      be.download(loss.data(), std::span<T>(&value, 1));
      if (options_.check_finite) Loss::check_finite(value, out, labels);
      step.losses[std::size_t(j)] = double(value);
    }
    if (st.recompute) f.record = {};  // keep only the input; backward recomputes
    st.in_flight.emplace(j, std::move(f));
  }

  template <int K, class Optimizer, class St>
  void backward(St& st, const schedule::Action& a, Step& step) {
    using Seq = stage_seq<K>;
    Backend& be = *st.be;
    const int j = a.microbatch;
    auto it = st.in_flight.find(j);
    if (it == st.in_flight.end()) CUPIPE_THROW("backward before forward for microbatch ", j);
    auto& f = it->second;
    const T* params = st.weights.data(f.version);
    const auto x0 = stage_input<K>(f, step, j);
    if (st.recompute) {
      f.record = be.template allocate<T>(Seq::record_elements(f.rows), MemoryTag::activations);
      Seq::forward(be, params, x0, f.record.data());
    }
    if constexpr (K + 1 == virtual_stages) {
      f.dy = be.template allocate<T>(f.rows * Seq::out_features, MemoryTag::activations);
      const auto labels = microbatch_labels(step, j);
      Loss::backward(be, ConstView<T>(Seq::output(f.record.data(), f.rows)), labels,
                     TensorView<T>{f.dy.data(), Shape{f.rows, Seq::out_features}}, step.normalizer[std::size_t(j)]);
    } else {
      f.dy = std::move(receive(step, worker_of(K), {pipeline::Flow::gradient, K, j}, K + 1, f.rows * Seq::out_features).data);
    }
    f.grad_record = be.template allocate<T>(Seq::grad_record_elements(f.rows), MemoryTag::activations);
    typename Backend::template buffer<T> dx;
    if constexpr (K > 0) dx = be.template allocate<T>(f.rows * Seq::in_features, MemoryTag::activations);
    Seq::backward(be, params, x0, f.record.data(), ConstView<T>{f.dy.data(), Shape{f.rows, Seq::out_features}},
                  K > 0 ? TensorView<T>{dx.data(), Shape{f.rows, Seq::in_features}} : TensorView<T>{}, st.grads.data(),
                  f.grad_record.data(), !split_backward);
    if constexpr (K > 0)
      send(worker_of(K), worker_of(K - 1), {pipeline::Flow::gradient, K - 1, j},
           ConstView<T>{dx.data(), Shape{f.rows, Seq::in_features}});
    if constexpr (!split_backward) finish<K, Optimizer>(st, j, step);
  }

  template <int K, class Optimizer, class St>
  void weight(St& st, const schedule::Action& a, Step& step) {
    using Seq = stage_seq<K>;
    const int j = a.microbatch;
    auto it = st.in_flight.find(j);
    if (it == st.in_flight.end() || it->second.dy.data() == nullptr) CUPIPE_THROW("W before B for microbatch ", j);
    auto& f = it->second;
    Seq::backward_weight(*st.be, stage_input<K>(f, step, j), f.record.data(),
                         ConstView<T>{f.dy.data(), Shape{f.rows, Seq::out_features}}, f.grad_record.data(), st.grads.data());
    finish<K, Optimizer>(st, j, step);
  }

  /// The microbatch is done on this stage: free what it held, then apply the asynchronous update
  /// its completion triggers, keeping exactly the versions unfinished microbatches still need.
  template <int K, class Optimizer, class St>
  void finish(St& st, int j, Step& step) {
    st.in_flight.erase(j);
    st.done[std::size_t(j)] = 1;
    if constexpr (update_rule != schedule::UpdateRule::flush) {
      const int batch = j / plan_.config.microbatches;
      const bool update = update_rule == schedule::UpdateRule::per_microbatch ||
                          ++st.done_in_batch[std::size_t(batch)] == plan_.config.microbatches;
      if (!update || step.optimizer == nullptr) return;
      // The oldest version an unfinished microbatch will use: of this step, or for 2BW the next
      // step's first batch, which runs on the version this batch's update starts from.
      int needed = update_rule == schedule::UpdateRule::double_buffered
                       ? std::max(int(batches_done_) + plan_.config.batches - 1, 0)
                       : INT_MAX;
      for (std::size_t i = 0; i < st.done.size(); ++i)
        if (!st.done[i]) needed = std::min(needed, step.version[i]);
      st.weights.drop_below(std::min(needed, st.weights.latest()));
      T* params = needed > st.weights.latest() ? st.weights.advance_in_place() : st.weights.advance();
      using Seq = stage_seq<K>;
      sum_replicas<Seq>(st);  // every replica of this stage runs the same actions, so they meet here
      const auto& optimizer = *static_cast<const Optimizer*>(step.optimizer);
      const double norm = std::sqrt(sum_of_squares(*st.be, ConstView<T>{st.grads.data(), Shape{Seq::param_count}}));
      update_stage(st, params, optimizer, optim::clip_factor(norm, optimizer.clip_norm()));
    }
  }

  PipelineOptions options_;
  schedule::Plan plan_;
  std::vector<int> versions_allowed_;
  std::vector<int> plan_versions_;
  std::vector<std::unique_ptr<Backend>> backends_;
  std::vector<std::unique_ptr<pipeline::Mailbox<Message>>> mailboxes_;
  States states_;
  std::int64_t batches_done_ = 0;
  int local_worker_ = -1;  ///< the stage this process runs; -1: all of them
  /// Message key of predict()'s single microbatch, clear of any training microbatch id.
  static constexpr int predict_microbatch = 1 << 19;
};

}  // namespace cupipe
