// SPDX-License-Identifier: Apache-2.0
// StageExecutor: what F, B, W and a microbatch's completion do on one virtual stage, for training
// and for inference. It reads the step's plan, keeps what backward needs in the stage's state, and
// moves every activation and gradient through the Transport, whatever the neighbour is.
//
// How a microbatch travels (see docs/architecture.md for the picture):
// - F on virtual stage k takes its input (the batch rows for k = 0, else the activation from k - 1),
//   runs its layers with the microbatch's weight version, keeps a record for backward and sends its
//   output to k + 1; the last virtual stage computes the loss instead.
// - B takes the gradient from k + 1 (the last stage differentiates the loss), runs the backward with
//   the same version and sends the input gradient to k - 1. Split schedules (zero bubble) defer the
//   weight gradient to W, which keeps the per-layer output gradients.
// - What a stage keeps for a microbatch lives in its ActivationArena, laid out before the step
//   (prepare); a received message goes back to the transport when the stage is done with it.
// - Offloading stages (schedule/offload.hpp) send the records whose backward comes last to host
//   memory when a forward ends, and bring each back as its backward starts.
// - When a stage is done with a microbatch it frees its record; asynchronous schedules then drop
//   every weight version no unfinished microbatch needs and apply their update.
#pragma once

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "cupipe/backend/capabilities.hpp"
#include "cupipe/backend/step_hooks.hpp"
#include "cupipe/comm/communicator.hpp"
#include "cupipe/core/error.hpp"
#include "cupipe/core/memory.hpp"
#include "cupipe/core/tensor.hpp"
#include "cupipe/layers/network.hpp"
#include "cupipe/optim/optimizers.hpp"
#include "cupipe/pipeline/activation_arena.hpp"
#include "cupipe/pipeline/documents.hpp"
#include "cupipe/pipeline/microbatch_scope.hpp"
#include "cupipe/pipeline/hand_over_transport.hpp"
#include "cupipe/pipeline/hand_over_wire.hpp"
#include "cupipe/pipeline/optimizer_step.hpp"
#include "cupipe/pipeline/options.hpp"
#include "cupipe/pipeline/stage_states.hpp"
#include "cupipe/pipeline/step_plan.hpp"
#include "cupipe/pipeline/transport.hpp"
#include "cupipe/pipeline/worker_runtime.hpp"
#include "cupipe/pipeline/workers.hpp"
#include "cupipe/schedule/action.hpp"
#include "cupipe/schedule/offload.hpp"
#include "cupipe/schedule/weights.hpp"

namespace cupipe::pipeline {

namespace detail {
template <class Contexts, int N, bool Mixed = Contexts::mixed>
struct transport_for {
  using type = Transport<typename Contexts::Backend>;
};
template <class Contexts, int N>
struct transport_for<Contexts, N, true> {
  using type = HandOverTransport<Contexts, N>;
};
}  // namespace detail

/// Where a stage's per-microbatch buffers live (PipelineOptions::planned_arena, offload,
/// offload_resident).
struct ExecutorMemory {
  bool arena = true;
  std::vector<int> offload{};
  int offload_resident = 1;
};
inline ExecutorMemory memory_of(const PipelineOptions& o) { return {o.planned_arena, o.offload, o.offload_resident}; }

/// `Spec` is the pipeline's backend argument: one backend, or backend::PerWorker (one per worker).
template <class Stages, class Schedule, class Spec>
class StageExecutor {
 public:
  static constexpr int virtual_stages = int(Stages::size);
  static constexpr int workers = virtual_stages / Schedule::chunks;

 private:
  static constexpr std::array<int, std::size_t(virtual_stages)> worker_table = [] {
    std::array<int, std::size_t(virtual_stages)> table{};
    const schedule::Placement placement = Schedule::placement(schedule::Config{workers, 1, Schedule::chunks, 1});
    for (int k = 0; k < virtual_stages; ++k) table[std::size_t(k)] = placement.worker_of(k);
    return table;
  }();

 public:
  /// The worker that runs virtual stage k (the placement depends only on the stage and chunk counts).
  static constexpr int worker_at(int k) { return worker_table[std::size_t(k)]; }
  using Contexts = Workers<Spec, workers>;
  /// Virtual stage K's backend: its worker's.
  template <int K>
  using stage_backend = typename Contexts::template backend<worker_at(K)>;
  struct StageBackends {
    template <int K>
    using at = stage_backend<K>;
  };
  using FirstBackend = stage_backend<0>;
  using LastBackend = stage_backend<virtual_stages - 1>;
  /// What the last stage outputs (its storage type), in its worker's memory.
  using output_type = typename LastBackend::value_type;
  using output_buffer = typename LastBackend::template buffer<output_type>;
  using Loss = typename Stages::loss;
  using input_type = model_input_t<typename Stages::template stage<0>, typename FirstBackend::value_type>;
  static constexpr schedule::UpdateRule update_rule = Schedule::update;
  static constexpr bool split_backward = Schedule::split_backward;
  static constexpr int max_versions = update_rule == schedule::UpdateRule::flush ? 1 : dynamic_versions;
  using States = StageStates<Stages, StageBackends, max_versions>;
  /// A virtual Transport<Backend> (in process or across processes) with one backend; the
  /// converting HandOverTransport with a backend per worker.
  using TransportType = typename detail::transport_for<Contexts, workers>::type;

  /// The optimizer an asynchronous schedule's step updates with, its type erased: only the update
  /// itself is compiled per optimizer type, not the executor and the runtime around it (the MLP
  /// trainer, which offers SGD and AdamW, compiled every schedule's step twice: its main.cpp took
  /// 167 s instead of 149 s at -O1). Flush schedules update after the step and never call it.
  struct StepOptimizer {
    const void* optimizer = nullptr;
    /// Applies *optimizer to virtual stage k's gradients, writing the weights at params (that stage's
    /// element type), clipped by that stage's own gradient norm.
    void (*update)(const void* optimizer, States& states, int k, void* params) = nullptr;

    template <class Optimizer>
    static StepOptimizer of(const Optimizer& optimizer) {
      return {&optimizer, [](const void* erased, States& states, int k, void* params) {
                const auto& o = *static_cast<const Optimizer*>(erased);
                states.visit(k, [&](auto, auto& st) {
                  const double norm = std::sqrt(gradient_sum_of_squares(st));
                  update_stage(st, static_cast<typename std::remove_cvref_t<decltype(st)>::T*>(params), o,
                               optim::clip_factor(norm, o.clip_norm()));
                });
              }};
    }
    explicit operator bool() const noexcept { return optimizer != nullptr; }
  };

  /// One step's inputs and outputs, shared by every worker.
  struct Step {
    const StepPlan* plan = nullptr;
    ConstViewOn<FirstBackend, input_type> x;
    ConstViewOn<LastBackend, std::int32_t> labels;
    DocumentStarts documents{};             ///< the batch's borders (packed sequences; host memory), or none
    std::vector<double> losses;             ///< [microbatch] written by the last virtual stage
    /// When allocated ([microbatch], in the last virtual stage's worker's memory, compute type): each
    /// forward of the last virtual stage leaves its loss here and collect_losses reads them all with
    /// one copy after the step. Empty: each loss is read back (a wait on a device) as it is computed.
    typename LastBackend::template buffer<grad_t<LastBackend>> loss_slots{};
    /// Asynchronous schedules update inside the step with this optimizer (empty: forward_backward).
    StepOptimizer optimizer{};
    std::int64_t batches_before = 0;        ///< batches finished before this step (2BW versions)
    /// Whether the stages' arenas are laid out for this step (prepare); else every buffer comes from
    /// the pool.
    bool laid_out = false;
    /// Whether this step runs the offload plan (prepare; the actions are counted per worker).
    bool offload = false;
    /// Per worker: bytes its transport moved to other workers (StepStats::sent_bytes).
    std::array<std::int64_t, std::size_t(workers)> sent_bytes{};
  };

  /// `wires`: what each link's hand-overs carry (PipelineOptions::hand_over); `memory`: whether
  /// prepare() lays out the stages' buffers, and which stages offload.
  StageExecutor(const schedule::Plan& plan, States& states, TransportType& transport,
                WorkerRuntime<Contexts>& runtime, comm::Communicator* comm, bool check_finite, HandOverWires wires = {},
                ExecutorMemory memory = {})
      : plan_(plan),
        offsets_(schedule::detail::microbatch_versions(plan)),
        states_(states),
        transport_(transport),
        runtime_(runtime),
        comm_(comm),
        check_finite_(check_finite),
        wires_(std::move(wires)),
        arena_(memory.arena),
        offload_(schedule::plan_offload(plan, memory.offload, memory.offload_resident)),
        cursor_(std::size_t(workers), 0),
        evicted_after_(std::size_t(virtual_stages), std::vector<int>(std::size_t(plan.config.total_microbatches()), -1)) {
    for (std::size_t w = 0; w < offload_.out_after.size(); ++w)
      for (std::size_t i = 0; i < offload_.out_after[w].size(); ++i)
        for (const schedule::OffloadMove& move : offload_.out_after[w][i])
          evicted_after_[std::size_t(move.virtual_stage)][std::size_t(move.microbatch)] = int(i);
  }

  /// The offload plan this executor runs (empty without PipelineOptions::offload).
  const schedule::OffloadPlan& offload_plan() const noexcept { return offload_; }

  int worker_of(int virtual_stage) const { return plan_.placement.worker_of(virtual_stage); }
  const std::vector<int>& version_offsets() const noexcept { return offsets_; }

  /// After a step that kept its losses in Step::loss_slots: reads them with one copy from `last`
  /// (the last virtual stage's worker's context) into Step::losses, and throws, as an immediate read
  /// would have, for a loss that is not finite (PipelineOptions::check_finite).
  void collect_losses(Step& step, LastBackend& last) const {
    if (step.loss_slots.data() == nullptr) return;
    using G = grad_t<LastBackend>;
    std::vector<G> values(step.losses.size());
    last.download(step.loss_slots.data(), std::span<G>(values));
    for (std::size_t j = 0; j < values.size(); ++j) {
      if (check_finite_) {
        const index_t rows = step.plan->rows[j];
        try {
          Loss::check_finite(values[j], ConstViewOn<LastBackend, output_type>{nullptr, Shape{rows, Loss::in_features}},
                             microbatch_labels(step, int(j)));
        } catch (const error& e) {  // named as the runtime names a failed action: this F computed it
          constexpr int K = virtual_stages - 1;
          const schedule::Action f{schedule::ActionKind::F, int(j), plan_.placement.chunk_of(K)};
          throw error(action_where(plan_, worker_of(K), f) + ": " + e.message(), e.call(), e.file(), e.line());
        }
      }
      step.losses[j] = double(values[j]);
    }
  }

  /// Before a step of the plan: lays out every local stage's arena for the step's rows (once for
  /// each new set of rows; a run of same-sized batches lays out once), and starts counting each
  /// worker's actions for the offload plan. Sets Step::laid_out and Step::offload.
  void prepare(Step& step) {
    std::fill(cursor_.begin(), cursor_.end(), std::size_t{0});
    step.offload = !offload_.empty();
    step.laid_out = lay_out(*step.plan);
  }

  /// Runs action `a` of worker `w`.
  void execute(int w, const schedule::Action& a, Step& step) {
    const std::size_t at = step.offload ? cursor_[std::size_t(w)]++ : 0;
    if (a.overlap) take_partner_input(w, a);
    states_.visit(plan_.virtual_stage(w, a), [&](auto k, auto& st) {
      constexpr int K = decltype(k)::value;
      switch (a.kind) {
        case schedule::ActionKind::F: forward<K>(st, a.microbatch, step, a.overlap); break;
        case schedule::ActionKind::B:
          if (step.offload && offload_.back_before[std::size_t(w)][at]) bring_back<K>(st, a.microbatch, step);
          backward<K>(st, a.microbatch, step);
          break;
        case schedule::ActionKind::W: weight<K>(st, a.microbatch, step); break;
      }
    });
    if (step.offload)
      for (const schedule::OffloadMove& move : offload_.out_after[std::size_t(w)][at])
        states_.visit(move.virtual_stage, [&](auto k, auto& st) { send_out<decltype(k)::value>(st, move.microbatch); });
  }

  /// Inference through this process's virtual stages in order, on the caller's thread, with each
  /// stage's latest weights: x (n, in_features) -> the last stage's output (n, out_features), in the
  /// last worker's memory; empty where the last stage runs in another process.
  output_buffer predict(ConstViewOn<FirstBackend, input_type> x, int message_id, DocumentStarts documents = {}) {
    const index_t rows = x.rows();
    output_buffer result;
    states_.for_each([&](auto k, auto& st) {
      constexpr int K = decltype(k)::value;
      using Seq = typename Stages::template stage<K>;
      using B = stage_backend<K>;
      using T = typename B::value_type;
      B& be = *st.be;
      typename B::template buffer<T> input;
      if constexpr (K > 0) input = receive_message<K>(K - 1, {Flow::activation, K, message_id}, rows * Seq::in_features);
      auto record = be.template allocate<T>(Seq::record_elements(rows), MemoryTag::activations);
      const backend::Inference<B> inference(be);  // leaves the training step's state alone (FP8 amaxes)
      const MicrobatchScope<B> borders(be, documents, 0);
      if constexpr (K == 0) Seq::forward(be, st.weights.latest_data(), x, record.data());
      else Seq::forward(be, st.weights.latest_data(), ConstViewOn<B, T>{input.data(), Shape{rows, Seq::in_features}}, record.data());
      const ConstViewOn<B, T> out = Seq::template output<typename B::space>(record.data(), rows);
      if constexpr (K + 1 < virtual_stages) {
        send_message<K, K + 1>(be, {Flow::activation, K + 1, message_id}, out);
      } else {
        result = be.template allocate<T>(out.numel(), MemoryTag::activations);
        copy(be, out, ViewOn<B, T>{result.data(), out.shape()});
      }
    });
    return result;
  }

 private:
  template <int K>
  using stage_seq = typename Stages::template stage<K>;

  /// The arenas' layout for `step_plan`'s rows; false where the arena is off.
  bool lay_out(const StepPlan& step_plan) {
    if (!arena_) return false;
    if (step_plan.rows == laid_out_rows_) return true;
    laid_out_rows_.clear();  // a failure below leaves nothing laid out
    std::vector<ArenaUse> uses;
    states_.for_each([&](auto k, auto& st) {
      constexpr int K = decltype(k)::value;
      arena_uses<K>(st.recompute, step_plan, uses);
      st.arena.lay_out(*st.be, step_plan.microbatches(), uses);
    });
    laid_out_rows_ = step_plan.rows;
    return true;
  }

  template <int K, class St>
  auto stage_input(const typename St::InFlight& f, const Step& step, int j) const {
    using Seq = stage_seq<K>;
    if constexpr (K == 0) return ConstViewOn<FirstBackend, input_type>(step.x.row_slice(step.plan->first[std::size_t(j)], f.rows));
    else return ConstViewOn<stage_backend<K>, typename St::T>{f.input.data(), Shape{f.rows, Seq::in_features}};
  }

  static ConstViewOn<LastBackend, std::int32_t> microbatch_labels(const Step& step, int j) {
    return {step.labels.data() + step.plan->first[std::size_t(j)], Shape{step.plan->rows[std::size_t(j)]}};
  }
  /// Microbatch j's rows of the step's document borders (none where the step has none).
  static DocumentStarts microbatch_documents(const Step& step, int j) {
    return step.documents.slice(step.plan->first[std::size_t(j)], step.plan->rows[std::size_t(j)]);
  }

  /// An overlapped F starts together with the B after it (schedule::Action::overlap): the B's
  /// gradient is taken first, so the pair starts once both inputs are there, as verify and simulate
  /// assume. The host then runs the two back to back; a backend with a second stream
  /// (backend::capabilities::overlap_begin) runs the F's work there once its input is in, and the
  /// worker runtime sends the B back to the main stream (overlap_end) and joins the two after it.
  void take_partner_input(int w, const schedule::Action& a) {
    const auto& list = plan_.actions[std::size_t(w)];
    const auto at = std::find(list.begin(), list.end(), a);
    if (at == list.end() || at + 1 == list.end() || (at + 1)->kind != schedule::ActionKind::B) return;
    const schedule::Action& partner = *(at + 1);
    states_.visit(plan_.virtual_stage(w, partner), [&](auto k, auto& st) {
      constexpr int K = decltype(k)::value;
      if constexpr (K + 1 < virtual_stages) {
        auto* found = st.in_flight.find(partner.microbatch);
        if (found == nullptr) CUPIPE_THROW("backward before forward for microbatch ", partner.microbatch);
        auto& f = *found;
        f.dy = receive<K>(K + 1, {Flow::gradient, K, partner.microbatch}, f.rows * stage_seq<K>::out_features);
      }
    });
  }

  /// The message `key` for virtual stage K from virtual stage `from`, in K's worker's memory.
  template <int K>
  auto receive_message(int from, const MessageKey& key, index_t elements) {
    if constexpr (Contexts::mixed) return transport_.template receive<worker_at(K)>(worker_of(from), key, elements);
    else return transport_.receive(worker_at(K), worker_of(from), key, elements);
  }
  /// Sends `data` (virtual stage From's output or input gradient, in `be`'s memory) to virtual stage
  /// To, as the link between them carries it (HandOverWires: a WireTransport packs it; a mixed
  /// pipeline's transport converts, so it sends the round trip's values), and adds the bytes moved
  /// to another worker to `*sent` (when given).
  template <int From, int To, class U>
  void send_message(stage_backend<From>& be, const MessageKey& key, TensorView<const U, typename stage_backend<From>::space> data,
                    std::int64_t* sent = nullptr) {
    std::size_t bytes = 0;
    if constexpr (Contexts::mixed) {
      send_over(be, wires_.between(From, To), data, [&](TensorView<const U, typename stage_backend<From>::space> values) {
        bytes = transport_.template send<worker_at(From), worker_at(To)>(key, values);
      });
    } else {
      bytes = transport_.send(worker_at(From), worker_at(To), key, data);
    }
    if (sent) *sent += std::int64_t(bytes);
  }
  /// Waits for a message for virtual stage K from virtual stage `from`; the action's measured time
  /// starts when it arrives.
  template <int K>
  auto receive(int from, const MessageKey& key, index_t elements) {
    runtime_.awaiting(worker_at(K), worker_of(from), key);
    auto message = receive_message<K>(from, key, elements);
    runtime_.input_arrived(worker_at(K));
    return message;
  }

  /// What virtual stage K takes for each microbatch of a step with `step_plan`'s rows, with the
  /// actions of its worker's list between which each lives (see activation_arena.hpp).
  template <int K>
  void arena_uses(bool recompute, const StepPlan& step_plan, std::vector<ArenaUse>& uses) const {
    using Seq = stage_seq<K>;
    uses.clear();
    const int m = step_plan.microbatches();
    std::vector<int> f_at(std::size_t(m), -1), f_until(std::size_t(m), -1), b_at(std::size_t(m), -1),
        w_at(std::size_t(m), -1);
    const auto& list = plan_.actions[std::size_t(worker_at(K))];
    for (int t = 0; t < int(list.size()); ++t) {
      const schedule::Action& a = list[std::size_t(t)];
      if (a.microbatch < 0 || a.microbatch >= m || plan_.virtual_stage(worker_at(K), a) != K) continue;
      const std::size_t j = std::size_t(a.microbatch);
      if (a.kind == schedule::ActionKind::F) {
        f_at[j] = t;
        f_until[j] = a.overlap ? t + 1 : t;  // an overlapped F runs beside the B after it
      } else {
        (a.kind == schedule::ActionKind::B ? b_at : w_at)[j] = t;
      }
    }
    for (int j = 0; j < m; ++j) {
      const std::size_t i = std::size_t(j);
      const int done = split_backward ? w_at[i] : b_at[i];
      if (f_at[i] < 0 || b_at[i] < 0 || done < 0) continue;  // not this plan's microbatch: the pool serves it
      const index_t rows = step_plan.rows[i];
      const auto use = [&](ArenaRole role, index_t elements, int first, int last) {
        uses.push_back({j, role, ArenaRequest{elements, first, std::max(last, f_until[i])}});
      };
      const int evicted = evicted_after_[std::size_t(K)][i];  // offload: the record leaves after this action
      if (recompute || evicted >= 0) {
        use(ArenaRole::forward_record, Seq::record_elements(rows), f_at[i], recompute ? f_until[i] : evicted);
        use(ArenaRole::record, Seq::record_elements(rows), b_at[i], done);
      } else {
        use(ArenaRole::record, Seq::record_elements(rows), f_at[i], done);
      }
      if constexpr (K + 1 == virtual_stages) use(ArenaRole::dy, rows * Seq::out_features, b_at[i], done);
      use(ArenaRole::grad_record, Seq::grad_record_elements(rows), b_at[i], done);
      if constexpr (K > 0) use(ArenaRole::dx, rows * Seq::in_features, b_at[i], b_at[i]);
    }
  }

  /// Microbatch j's buffer for `role` on virtual stage K: from its arena when the step is laid out.
  template <class St>
  static typename St::slot take(St& st, const Step& step, int j, ArenaRole role, index_t elements) {
    if (step.laid_out) return st.arena.take(*st.be, j, role, elements);
    return typename St::slot(st.be->template allocate<typename St::T>(elements, MemoryTag::activations));
  }

  /// Offload: microbatch j's record on virtual stage K goes to its host copy, and its memory is free.
  template <int K, class St>
  void send_out(St& st, int j) {
    auto* f = st.in_flight.find(j);
    if (f == nullptr || f->record.data() == nullptr) CUPIPE_THROW("offload: no record of microbatch ", j, " to send out");
    const index_t n = stage_seq<K>::record_elements(f->rows);
    if (st.offloaded.size() <= std::size_t(j)) st.offloaded.resize(std::size_t(j) + 1);
    HostBuffer<typename St::T>& host = st.offloaded[std::size_t(j)];
    if (host.size() != n) host = HostBuffer<typename St::T>(n, nullptr, MemoryTag::activations, BlockFill::none);
    st.be->download(f->record.data(), host.span());
    f->record = {};
  }
  /// Offload: microbatch j's record comes back from its host copy before its backward.
  template <int K, class St>
  void bring_back(St& st, int j, const Step& step) {
    auto* f = st.in_flight.find(j);
    if (f == nullptr || std::size_t(j) >= st.offloaded.size()) CUPIPE_THROW("offload: no record of microbatch ", j, " to bring back");
    const HostBuffer<typename St::T>& host = st.offloaded[std::size_t(j)];
    f->record = take(st, step, j, ArenaRole::record, host.size());
    st.be->upload(host.span(), f->record.data());
  }

  /// A message virtual stage K received and is done with goes back to the transport for reuse.
  template <int K, class Buffer>
  void recycle(Buffer&& message) {
    if constexpr (!Contexts::mixed)
      if (message.data() != nullptr) transport_.recycle(worker_at(K), std::move(message));
  }

  template <int K, class St>
  void forward(St& st, int j, Step& step, bool overlapped) {
    using Seq = stage_seq<K>;
    using B = stage_backend<K>;
    using T = typename St::T;
    B& be = *st.be;
    typename St::InFlight f;
    f.rows = step.plan->rows[std::size_t(j)];
    f.version = step.plan->version[std::size_t(j)];
    if constexpr (K > 0) f.input = receive<K>(K - 1, {Flow::activation, K, j}, f.rows * Seq::in_features);
    if (overlapped) backend::capabilities<B>::overlap_begin(be);  // after the input is in, see take_partner_input
    const bool leaves = st.recompute || (step.offload && evicted_after_[std::size_t(K)][std::size_t(j)] >= 0);
    f.record = take(st, step, j, leaves ? ArenaRole::forward_record : ArenaRole::record, Seq::record_elements(f.rows));
    const MicrobatchScope<B> microbatch(be, microbatch_documents(step, j), step.plan->normalizer[std::size_t(j)]);
    Seq::forward(be, st.weights.data(f.version), stage_input<K, St>(f, step, j), f.record.data());
    const ConstViewOn<B, T> out = Seq::template output<typename B::space>(f.record.data(), f.rows);
    if constexpr (K + 1 < virtual_stages) {
      send_message<K, K + 1>(be, {Flow::activation, K + 1, j}, out, &step.sent_bytes[std::size_t(worker_at(K))]);
    } else {
      const auto labels = microbatch_labels(step, j);
      const index_t normalizer = step.plan->normalizer[std::size_t(j)];
      if (step.loss_slots.data() != nullptr)
        Loss::forward(be, out, labels, ViewOn<B, grad_t<B>>{step.loss_slots.data() + j, Shape{1}}, normalizer);
      else
        step.losses[std::size_t(j)] = double(loss_value<Loss>(be, out, labels, normalizer, check_finite_));
    }
    if (st.recompute) f.record = {};  // keep only the input; backward recomputes
    st.in_flight.emplace(j, std::move(f));
  }

  template <int K, class St>
  void backward(St& st, int j, Step& step) {
    using Seq = stage_seq<K>;
    using B = stage_backend<K>;
    using T = typename St::T;
    using space = typename B::space;
    B& be = *st.be;
    auto* found = st.in_flight.find(j);
    if (found == nullptr) CUPIPE_THROW("backward before forward for microbatch ", j);
    auto& f = *found;
    const T* params = st.weights.data(f.version);
    const auto x0 = stage_input<K, St>(f, step, j);
    const MicrobatchScope<B> microbatch(be, microbatch_documents(step, j), step.plan->normalizer[std::size_t(j)]);
    if (st.recompute) {
      f.record = take(st, step, j, ArenaRole::record, Seq::record_elements(f.rows));
      Seq::forward(be, params, x0, f.record.data());
    }
    if constexpr (K + 1 == virtual_stages) {
      f.dy = take(st, step, j, ArenaRole::dy, f.rows * Seq::out_features);
      Loss::backward(be, ConstViewOn<B, T>(Seq::template output<space>(f.record.data(), f.rows)), microbatch_labels(step, j),
                     ViewOn<B, T>{f.dy.data(), Shape{f.rows, Seq::out_features}}, step.plan->normalizer[std::size_t(j)]);
    } else if (f.dy.data() == nullptr) {  // not taken already by an overlapped F before it
      f.dy = receive<K>(K + 1, {Flow::gradient, K, j}, f.rows * Seq::out_features);
    }
    f.grad_record = take(st, step, j, ArenaRole::grad_record, Seq::grad_record_elements(f.rows));
    typename St::slot dx;
    if constexpr (K > 0) dx = take(st, step, j, ArenaRole::dx, f.rows * Seq::in_features);
    Seq::backward(be, params, x0, f.record.data(), ConstViewOn<B, T>{f.dy.data(), Shape{f.rows, Seq::out_features}},
                  K > 0 ? ViewOn<B, T>{dx.data(), Shape{f.rows, Seq::in_features}} : ViewOn<B, T>{}, st.gradients(),
                  f.grad_record.data(), !split_backward);
    if constexpr (K > 0)
      send_message<K, K - 1>(be, {Flow::gradient, K - 1, j}, ConstViewOn<B, T>{dx.data(), Shape{f.rows, Seq::in_features}},
                             &step.sent_bytes[std::size_t(worker_at(K))]);
    if constexpr (!split_backward) finish<K>(st, j, step);
  }

  template <int K, class St>
  void weight(St& st, int j, Step& step) {
    using Seq = stage_seq<K>;
    auto* found = st.in_flight.find(j);
    if (found == nullptr || found->dy.data() == nullptr) CUPIPE_THROW("W before B for microbatch ", j);
    auto& f = *found;
    const MicrobatchScope<stage_backend<K>> microbatch(*st.be, microbatch_documents(step, j),
                                                       step.plan->normalizer[std::size_t(j)]);
    Seq::backward_weight(*st.be, stage_input<K, St>(f, step, j), f.record.data(),
                         ConstViewOn<stage_backend<K>, typename St::T>{f.dy.data(), Shape{f.rows, Seq::out_features}},
                         f.grad_record.data(), st.gradients());
    finish<K>(st, j, step);
  }

  /// The microbatch is done on this stage: free what it held, then apply the asynchronous update
  /// its completion triggers, keeping exactly the versions unfinished microbatches still need.
  template <int K, class St>
  void finish(St& st, int j, Step& step) {
    if (auto* f = st.in_flight.find(j)) {
      if constexpr (K > 0) recycle<K>(std::move(f->input));
      if constexpr (K + 1 < virtual_stages) recycle<K>(f->dy.release());
    }
    st.in_flight.erase(j);
    st.done[std::size_t(j)] = 1;
    if constexpr (update_rule != schedule::UpdateRule::flush) {
      const schedule::Config& c = plan_.config;
      const bool update = update_rule == schedule::UpdateRule::per_microbatch ||
                          ++st.done_in_batch[std::size_t(j / c.microbatches)] == c.microbatches;
      if (!update || !step.optimizer) return;
      // The oldest version an unfinished microbatch will use: of this step, or the next step's first.
      int needed = schedule::version_of(plan_, offsets_, c.total_microbatches(), st.weights.latest(), step.batches_before);
      for (std::size_t i = 0; i < st.done.size(); ++i)
        if (!st.done[i]) needed = std::min(needed, step.plan->version[i]);
      st.weights.drop_below(std::min(needed, st.weights.latest()));
      typename St::T* params = needed > st.weights.latest() ? st.weights.advance_in_place() : st.weights.advance();
      sum_over_replicas(comm_, st);  // every replica of this stage runs the same actions, so they meet here
      step.optimizer.update(step.optimizer.optimizer, states_, K, params);
    }
  }

  const schedule::Plan& plan_;
  std::vector<int> offsets_;
  States& states_;
  TransportType& transport_;
  WorkerRuntime<Contexts>& runtime_;
  comm::Communicator* comm_;
  bool check_finite_;
  HandOverWires wires_;
  bool arena_;
  std::vector<index_t> laid_out_rows_;  ///< the rows the arenas are laid out for (empty: none)
  schedule::OffloadPlan offload_;
  std::vector<std::size_t> cursor_;  ///< [worker] the action it runs in this step (each written by its own thread)
  std::vector<std::vector<int>> evicted_after_;  ///< [virtual stage][microbatch] offload: the action after which its record leaves, or -1
};

}  // namespace cupipe::pipeline
