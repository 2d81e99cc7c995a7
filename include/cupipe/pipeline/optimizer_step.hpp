// SPDX-License-Identifier: Apache-2.0
// Applying an optimizer to stage states: its state slots, one stage's update from its gradients, the
// sum of a stage's gradients over its data-parallel replicas, the flush update with the global
// gradient norm summed over every stage, and what post-validation saves to undo an update.
#pragma once

#include <algorithm>
#include <cmath>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <type_traits>
#include <vector>

#include "cupipe/backend/step_hooks.hpp"
#include "cupipe/comm/communicator.hpp"
#include "cupipe/core/error.hpp"
#include "cupipe/core/memory.hpp"
#include "cupipe/core/tensor.hpp"
#include "cupipe/layers/sequential.hpp"
#include "cupipe/optim/optimizers.hpp"
#include "cupipe/pipeline/stage_state.hpp"

namespace cupipe::pipeline {

/// Allocates (zeroed) the optimizer's state slots of a stage, unless it already has them: one array
/// per slot over the stage's shard (all its parameters without ZeRO-1).
template <class Optimizer, class St>
void prepare_slots(St& st) {
  using B = std::remove_reference_t<decltype(*st.be)>;
  using T = grad_t<B>;
  if (st.slots_for == Optimizer::name && st.slots.size() == Optimizer::slot_names.size()) return;
  st.slots.clear();
  const index_t n = st.shard.size();
  for (std::size_t i = 0; i < Optimizer::slot_names.size(); ++i) {
    st.slots.push_back(st.be->template allocate<T>(n, MemoryTag::optimizer));
    if (n > 0) fill(*st.be, ViewOn<B, T>{st.slots.back().data(), Shape{n}}, T(0));
  }
  st.slots_for = std::string(Optimizer::name);
}

/// The stage's layers of a StageState.
template <class St>
struct stage_layers;
template <class Seq, class Backend, int MaxVersions>
struct stage_layers<StageState<Seq, Backend, MaxVersions>> {
  using type = Seq;
};

/// Updates the stage's shard of `params` (one of its weight versions; the whole of them without
/// ZeRO) from its shard's gradients scaled by `grad_scale`, then zeroes the gradients. The update is
/// element-wise, so a shard's values are bitwise those of the whole update. With master weights
/// (bf16 storage) the optimizer updates them in float and `params` becomes their rounding. Weight
/// decay spares the tensors the optimizer's decay_on leaves out (optim::update_runs). The backend
/// context closes its step first (backend::end_step: FP8 delayed scaling records its amaxes).
template <class Optimizer, class St, class T>
void update_stage(St& st, T* params, const Optimizer& optimizer, double grad_scale) {
  using B = std::remove_reference_t<decltype(*st.be)>;
  using G = grad_t<B>;
  backend::end_step(*st.be);
  static const std::vector<optim::DecayRun> runs = optim::decay_runs(stage_layers<St>::type::parameter_table());
  const index_t begin = st.shard.begin, n = st.shard.size();
  if (n > 0) {
    std::vector<ViewOn<B, G>> slots;
    for (auto& s : st.slots) slots.push_back({s.data(), Shape{n}});
    optim::update_runs(optimizer, std::span<const optim::DecayRun>(runs), begin, *st.be,
                       ViewOn<B, G>{st.shard_parameter_data(params), Shape{n}},
                       ConstViewOn<B, G>{st.shard_gradient_data(), Shape{n}}, std::span<const ViewOn<B, G>>(slots),
                       st.updates, grad_scale);
    if (!st.sharded_params) st.publish_master(params, begin, begin + n);
  }
  st.zero_grads();
  ++st.updates;
}

/// ZeRO-1: every replica's shard of `data` (a stage's parameters, param_count values in backend
/// memory, this replica's shard current) gathered over the replicas, in host memory.
/// The host buffer such a gather runs in: replicas x stride values, this replica's shard of the
/// values (`shard_values`, in backend memory) at its place, the rest zero.
template <class St, class T>
std::vector<T> own_block(St& st, const T* shard_values) {
  std::vector<T> host(static_cast<std::size_t>(st.shard.stride * st.shard.replicas), T(0));
  st.be->synchronize();
  if (st.shard.size() > 0)
    st.be->download(shard_values, std::span<T>(host.data() + st.shard.begin, std::size_t(st.shard.size())));
  return host;
}
template <class St, class T>
std::vector<T> gather_shards(comm::Communicator& comm, St& st, const T* shard_values) {
  std::vector<T> host = own_block(st, shard_values);
  comm.all_gather_over_replicas(host.data(), std::size_t(st.shard.stride));
  host.resize(std::size_t(st.param_count));
  return host;
}

/// ZeRO-1, after each replica updated its shard of the stage's latest weights: every replica gets
/// every shard (an exact copy: the values travel, nothing is summed).
template <class St>
void gather_updated_weights(comm::Communicator* comm, St& st) {
  if (!comm || !st.shard.sharded() || st.sharded_params) return;  // ZeRO-3 gathers where the weights are used
  if constexpr (St::master_weights) {
    // bf16 storage: each replica updated the float master weights of its shard (and rounded them into
    // its weights in use). The master weights travel, not their bf16 rounding: every replica keeps
    // all of them (checkpoints and parameters() read them), and its weights in use become their
    // rounding. Twice the bytes of gathering the bf16 weights.
    using G = typename St::G;
    const std::vector<G> all = gather_shards(*comm, st, st.master.data() + st.shard.begin);
    st.be->upload(std::span<const G>(all), st.master.data());
    st.publish_master(st.weights.latest_data());
  } else {
    using T = typename std::remove_reference_t<decltype(*st.be)>::value_type;
    T* weights = st.weights.latest_data();
    const std::vector<T> all = gather_shards(*comm, st, weights + st.shard.begin);
    st.be->upload(std::span<const T>(all), weights);
  }
}

/// Sum of squares of a stage's gradients.
template <class St>
double gradient_sum_of_squares(St& st) {
  using B = std::remove_reference_t<decltype(*st.be)>;
  return sum_of_squares(*st.be, ConstViewOn<B, grad_t<B>>(st.grad_view()));
}

/// Whether backend B can leave a sum of squares in its own memory without waiting
/// (`sum_of_squares_into(be, x, out)`, `out` a double of B's memory), so that a caller combining
/// several reads them back with one copy. The CUDA backend can; the host's sums are ready at once.
template <class B>
concept defers_sums_of_squares = requires(B& be, ConstViewOn<B, grad_t<B>> x, double* out) { sum_of_squares_into(be, x, out); };

namespace detail {
/// The deferred sums of squares on one context: doubles in its memory, read back with one copy.
struct SquaresOnContext {
  virtual ~SquaresOnContext() = default;
  /// The `used` slots, in one copy.
  virtual std::vector<double> read() = 0;
  std::size_t used = 0;
};
template <class B>
struct SquaresOn final : SquaresOnContext {
  SquaresOn(B& b, std::size_t capacity) : be(&b), sums(b.template allocate<double>(index_t(capacity), MemoryTag::workspace)) {}
  std::vector<double> read() override {
    std::vector<double> host(used);
    be->download(sums.data(), std::span<double>(host));
    return host;
  }
  B* be;
  typename B::template buffer<double> sums;
};
}  // namespace detail

/// Sums of squares of stages' gradients, gathered so that each context is read once: where a
/// stage's backend defers them (defers_sums_of_squares), add() only enqueues the sum into a slot in
/// that context's memory and read() copies each context's slots back at once (one wait per context,
/// where each virtual stage used to wait for its own); elsewhere add() sums at once. The same
/// kernels either way, so the same bits.
class GradientSquares {
 public:
  /// `capacity`: the most stages add() is called for.
  explicit GradientSquares(std::size_t capacity) : capacity_(capacity) {}

  /// The sum of squares of `st`'s gradients, to be read as `term`.
  template <class St>
  void add(St& st, std::size_t term) {
    using B = std::remove_reference_t<decltype(*st.be)>;
    if constexpr (defers_sums_of_squares<B>) {
      std::size_t& index = of_context_.try_emplace(static_cast<const void*>(st.be), contexts_.size()).first->second;
      if (index == contexts_.size()) contexts_.push_back(std::make_unique<detail::SquaresOn<B>>(*st.be, capacity_));
      // A context is one object of one type, so its entry is a SquaresOn<B>.
      auto& on = static_cast<detail::SquaresOn<B>&>(*contexts_[index]);
      CUPIPE_REQUIRE(on.used < capacity_, "GradientSquares: more than ", capacity_, " sums on one context");
      sum_of_squares_into(*st.be, ConstViewOn<B, grad_t<B>>(st.grad_view()), on.sums.data() + on.used);
      entries_.push_back({term, 0.0, index, on.used++});
    } else {
      entries_.push_back({term, gradient_sum_of_squares(st), none, 0});
    }
  }

  /// Every sum added, as (term, sum) in the order added.
  std::vector<std::pair<std::size_t, double>> read() {
    std::vector<std::vector<double>> back;
    for (const auto& context : contexts_) back.push_back(context->read());
    std::vector<std::pair<std::size_t, double>> out;
    for (const Entry& e : entries_) out.emplace_back(e.term, e.context == none ? e.value : back[e.context][e.slot]);
    return out;
  }

 private:
  static constexpr std::size_t none = std::size_t(-1);
  struct Entry {
    std::size_t term;
    double value;
    std::size_t context, slot;
  };
  std::size_t capacity_;
  std::map<const void*, std::size_t> of_context_;
  std::vector<std::unique_ptr<detail::SquaresOnContext>> contexts_;
  std::vector<Entry> entries_;
};

/// The sum of squares of each local stage's gradients into terms[k + 1] (virtual stage k), each
/// context read once (GradientSquares).
template <class States>
void gradient_sums_of_squares(States& states, std::vector<double>& terms) {
  GradientSquares squares{std::size_t(States::size)};
  states.for_each([&](auto k, auto& st) { squares.add(st, std::size_t(decltype(k)::value) + 1); });
  for (const auto& [term, sum] : squares.read()) terms[term] = sum;
}

/// Sums a stage's gradients over its replicas (through host memory unless the communicator takes
/// the backend's memory). Nothing to do without replicas.
template <class St>
void sum_over_replicas(comm::Communicator* comm, St& st) {
  if (!comm || comm->topology().replicas == 1) return;
  using Backend = std::remove_reference_t<decltype(*st.be)>;
  using T = grad_t<Backend>;
  st.be->synchronize();
  if (comm::reads_backend_memory<Backend>(*comm)) {
    comm->sum_over_replicas(st.grads.data(), std::size_t(st.param_count));
    return;
  }
  std::vector<T> host(static_cast<std::size_t>(st.param_count));
  st.be->download(st.grads.data(), std::span<T>(host));
  comm->sum_over_replicas(host.data(), host.size());
  st.be->upload(std::span<const T>(host), st.grads.data());
}

/// ZeRO-1 with a communicator that reduce-scatters: sums the stage's gradients over its replicas
/// into this replica's shard only (through host memory); the rest of the gradient buffer keeps this
/// replica's own, unsummed values, which nothing reads before update_stage zeroes them.
template <class St>
void reduce_scatter_over_replicas(comm::Communicator& comm, St& st) {
  using T = grad_t<std::remove_reference_t<decltype(*st.be)>>;
  std::vector<T> host(static_cast<std::size_t>(st.shard.stride * st.shard.replicas), T(0));
  st.be->synchronize();
  st.be->download(st.grads.data(), std::span<T>(host.data(), std::size_t(st.param_count)));
  comm.reduce_scatter_over_replicas(host.data(), std::size_t(st.shard.stride));
  if (st.shard.size() > 0)
    st.be->upload(std::span<const T>(host.data() + st.shard.begin, std::size_t(st.shard.size())),
                  st.grads.data() + st.shard.begin);
}

/// Whether the tensor that starts at flat offset `at` of `table` is split over a tensor-parallel
/// group (each rank then holds its own part, whose squares count on every rank).
inline bool split_at(const std::vector<ParamInfo>& table, index_t at) {
  for (const ParamInfo& p : table)
    if (p.offset == at) return p.split != TensorSplit::none;
  return false;
}

/// The global gradient norm after reduce_scatter_over_replicas (or ZeRO-2's scatter_gradients):
/// each replica's sum of squares over its shards, less the part of the second tied copy inside them (counted once, as by flush_norm),
/// summed over every rank. The tied copies' gradients must already hold their sum (summed before
/// the reduce-scatter). `table` (the model's parameter table, in the flat layout) says which tensors
/// a tensor-parallel group splits: their squares count on every rank of the group, replicated ones
/// (the same on each) on its first rank only.
template <class States>
double sharded_flush_norm(States& states, comm::Communicator& comm, const std::vector<ParamInfo>& table,
                          const TiedCopies& tied = {}) {
  const bool counts_replicated = comm.topology().tensor_rank() == 0;
  const bool tied_split = tied.count > 0 && split_at(table, tied.second);
  double sum = 0;
  states.for_each([&](auto k, auto& st) {
    using B = std::remove_reference_t<decltype(*st.be)>;
    using T = grad_t<B>;
    const index_t begin = st.shard.begin, end = st.shard.begin + st.shard.size();
    const index_t offset = States::template model_offset<decltype(k)::value>();
    // Squares of [from, to) of the stage's gradients (its own coordinates), within the shard.
    const auto squares = [&](index_t from, index_t to) {
      from = std::max(from, begin), to = std::min(to, end);
      return to > from ? sum_of_squares(*st.be, ConstViewOn<B, T>{st.shard_gradient_data() + (from - begin), Shape{to - from}}) : 0.0;
    };
    for (const ParamInfo& p : table)
      if (p.offset >= offset && p.offset < offset + st.param_count && (p.split != TensorSplit::none || counts_replicated))
        sum += squares(p.offset - offset, p.offset - offset + p.numel);
    if (tied.count > 0 && (tied_split || counts_replicated)) sum -= squares(tied.second - offset, tied.second + tied.count - offset);
  });
  return std::sqrt(comm.sum_over_world(sum));
}

/// Replaces the gradients of both tied copies (in the whole model's flat layout) by their sum, on
/// whichever local stages hold them; across processes every rank of the pipeline adds its part (zeros
/// where it holds neither) in one sum over the stages. Returns this process's share of the sum of
/// squares to leave out of the gradient norm (the second copy's, where it is held here), so the
/// shared tensor counts once, as PyTorch counts a tied parameter.
///
/// Where this process holds both copies and no other process holds a part (one stage, or no
/// pipeline across processes), the sum stays on the backends: `first += second`, then `second =
/// first`, as Network::sum_tied_gradients does: each element a + b in T, as through the host
/// (tested bitwise on the host backend; the CUDA path has not run on a GPU yet). When
/// the copies are on two stages, the second copy travels to the first's backend and back through
/// transfer(), the stages' hand-over. Otherwise the copies travel through host memory. On a GPU that
/// matters: GPT-2's tied table is 154 MB, and the host path drained the device for about 400 ms per
/// step (measured on an H100, docs/benchmarks.md, 2026-11-26).
template <class States>
double sum_tied_gradients(States& states, comm::Communicator* comm, const TiedCopies& tied) {
  using T = typename States::G;
  const auto holds = [&](index_t offset, index_t count, index_t at) { return at >= offset && at + tied.count <= offset + count; };
  const bool across_processes = comm && comm->topology().stages > 1;
  double excluded = 0;
  if constexpr (States::uniform) {
    if (!across_processes) {
      // Where each copy is held here (one pass over the stages, so one instantiation per stage).
      using B = typename States::backend_type;
      B *holder_first = nullptr, *holder_second = nullptr;
      T *first_data = nullptr, *second_data = nullptr;
      states.for_each([&](auto k, auto& st) {
        constexpr index_t offset = States::template model_offset<decltype(k)::value>();
        if (holds(offset, st.param_count, tied.first)) {
          holder_first = st.be;
          first_data = st.grads.data() + (tied.first - offset);
        }
        if (holds(offset, st.param_count, tied.second)) {
          holder_second = st.be;
          second_data = st.grads.data() + (tied.second - offset);
        }
      });
      if (holder_first && holder_second) {
        const ViewOn<B, T> first{first_data, Shape{tied.count}}, second{second_data, Shape{tied.count}};
        if (holder_first == holder_second) {
          axpy(*holder_first, T(1), ConstViewOn<B, T>(second), first);
        } else {
          auto theirs = holder_first->template allocate<T>(tied.count, MemoryTag::workspace);
          const ViewOn<B, T> copy_of_second{theirs.data(), Shape{tied.count}};
          transfer(*holder_second, *holder_first, ConstViewOn<B, T>(second), copy_of_second);
          axpy(*holder_first, T(1), ConstViewOn<B, T>(copy_of_second), first);
        }
        transfer(*holder_first, *holder_second, ConstViewOn<B, T>(first), second);
        return sum_of_squares(*holder_second, ConstViewOn<B, T>(second));
      }
    }
  }
  std::vector<T> sum(static_cast<std::size_t>(tied.count), T(0)), part(sum.size());
  auto each_copy = [&](auto&& f) {
    states.for_each([&](auto k, auto& st) {
      constexpr index_t offset = States::template model_offset<decltype(k)::value>();
      for (const index_t at : {tied.first, tied.second})
        if (holds(offset, st.param_count, at)) f(st, st.grads.data() + (at - offset), at == tied.second);
    });
  };
  // Stages of several compute types (backend::PerWorker) add in the widest, T.
  each_copy([&](auto& st, auto* grads, bool) {
    States::download_as(st, grads, std::span<T>(part));
    for (std::size_t i = 0; i < sum.size(); ++i) sum[i] += part[i];
  });
  if (across_processes) comm->sum_over_stages(sum.data(), sum.size());
  each_copy([&](auto& st, auto* grads, bool second) {
    using B = std::remove_reference_t<decltype(*st.be)>;
    States::upload_as(st, std::span<const T>(sum), grads);
    if (second) excluded += sum_of_squares(*st.be, ConstViewOn<B, grad_t<B>>{grads, Shape{tied.count}});
  });
  return excluded;
}

/// The global gradient norm of a flush update: the tied copies' gradients summed, then the sum of
/// squares over every stage (and process), the second tied copy left out.
/// The same bits however the stages are spread over processes: every rank fills its own entries of
/// one vector (the second tied copy's squares, then one sum per virtual stage) and leaves the others
/// zero, the pipeline sums the vectors (exact: each entry has one non-zero term, whatever order MPI
/// adds them in) and each rank adds the entries up in stage order, as one process does.
template <class States>
double flush_norm(States& states, comm::Communicator* comm, const TiedCopies& tied = {}) {
  std::vector<double> terms(std::size_t(States::size) + 1, 0.0);
  if (tied.count > 0) terms[0] = -sum_tied_gradients(states, comm, tied);
  gradient_sums_of_squares(states, terms);
  if (comm && comm->topology().stages > 1) comm->sum_over_stages(terms.data(), terms.size());  // replicas hold the same sums
  double sum = 0;
  for (const double t : terms) sum += t;
  return std::sqrt(sum);
}

/// Every local stage steps with one clip factor from the global norm `norm`.
template <class Optimizer, class States>
void apply_flush(States& states, const Optimizer& optimizer, double norm) {
  const double scale = optim::clip_factor(norm, optimizer.clip_norm());
  states.for_each([&](auto, auto& st) {
    // ZeRO-3 updates its shard, and the whole weights (where still gathered) are stale after it.
    update_stage(st, st.weights.held() ? st.weights.latest_data() : nullptr, optimizer, scale);
    if (st.sharded_params) st.drop_weights();
  });
}

/// The flush update: flush_norm, then apply_flush. Returns the norm before clipping.
template <class Optimizer, class States>
double flush_update(States& states, comm::Communicator* comm, const Optimizer& optimizer, const TiedCopies& tied = {}) {
  const double norm = flush_norm(states, comm, tied);
  apply_flush(states, optimizer, norm);
  return norm;
}

// Optimizer post-validation (PipelineOptions::post_validation): a worker updates its stages without
// waiting for the global gradient norm, keeping what it needs to undo the update.

/// Whether an update made without the global norm (clip factor 1) is the one the flush update would
/// have made: the norm is finite and does not clip.
template <class Optimizer>
bool update_stands(const Optimizer& optimizer, double norm) {
  return std::isfinite(norm) && optim::clip_factor(norm, optimizer.clip_norm()) == 1.0;
}

/// Copies a stage's (master) weights, gradients and optimizer slots (and its update count) aside, so
/// that restore() can undo the update that follows.
template <class St>
void save_for_rollback(St& st) {
  using B = std::remove_reference_t<decltype(*st.be)>;
  using T = grad_t<B>;
  const std::size_t arrays = 2 + st.slots.size();
  if (st.saved.size() != arrays) {
    st.saved.clear();
    st.saved.push_back(st.be->template allocate<T>(st.param_count, MemoryTag::weights));
    st.saved.push_back(st.be->template allocate<T>(st.param_count, MemoryTag::gradients));
    for (std::size_t i = 0; i < st.slots.size(); ++i)
      st.saved.push_back(st.be->template allocate<T>(st.param_count, MemoryTag::optimizer));
  }
  const Shape shape{st.param_count};
  auto save = [&](const T* from, std::size_t i) { copy(*st.be, ConstViewOn<B, T>{from, shape}, ViewOn<B, T>{st.saved[i].data(), shape}); };
  save(st.master_data(), 0);
  save(st.grads.data(), 1);
  for (std::size_t i = 0; i < st.slots.size(); ++i) save(st.slots[i].data(), 2 + i);
  st.saved_updates = st.updates;
}

/// Undoes what followed the last save_for_rollback: weights, gradients, slots and update count.
template <class St>
void restore(St& st) {
  using B = std::remove_reference_t<decltype(*st.be)>;
  using T = grad_t<B>;
  CUPIPE_REQUIRE(st.saved.size() == 2 + st.slots.size(), "post-validation: a stage has nothing saved to roll back to");
  const Shape shape{st.param_count};
  auto load = [&](T* to, std::size_t i) { copy(*st.be, ConstViewOn<B, T>{st.saved[i].data(), shape}, ViewOn<B, T>{to, shape}); };
  load(st.master_data(), 0);
  st.publish_master(st.weights.latest_data());
  load(st.grads.data(), 1);
  for (std::size_t i = 0; i < st.slots.size(); ++i) load(st.slots[i].data(), 2 + i);
  st.updates = st.saved_updates;
}

}  // namespace cupipe::pipeline
