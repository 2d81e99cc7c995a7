// SPDX-License-Identifier: Apache-2.0
// A planner cost model from a model's compile-time layer list and measured profiles: times from
// cupipe::profile_layers (rebalance.hpp) on the backend at hand at two microbatch sizes (their
// difference separates each action's fixed part from the part that scales with the rows), the
// optimizer step's time per parameter, and sizes from the LayerSeq; the runtime's own costs (per
// action, per step) and workers slowing each other (contention), all put together by calibrate().
// The link costs, in one process or between ranks, are measured in calibrate_links.hpp.
#pragma once

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <exception>
#include <latch>
#include <limits>
#include <span>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "cupipe/core/cpus.hpp"
#include "cupipe/core/rng.hpp"
#include "cupipe/layers/linear.hpp"
#include "cupipe/layers/network.hpp"
#include "cupipe/layers/sequential.hpp"
#include "cupipe/optim/optimizers.hpp"
#include "cupipe/pipeline/pipeline.hpp"
#include "cupipe/schedule/policies/one_f_one_b.hpp"
#include "cupipe/pipeline/rebalance.hpp"
#include "cupipe/planner/calibrate_links.hpp"
#include "cupipe/planner/planner.hpp"
#include "cupipe/planner/rounds.hpp"

namespace cupipe::planner {

/// The cost model of `Body` (a model's LayerSeq, Model::body) with `profile`'s times, for values of
/// `value_bytes` bytes and an optimizer with `optimizer_slots` arrays per parameter. Times are taken
/// as proportional to the rows (no fixed part): see the overload with two profiles.
template <class Body>
CostModel cost_model(const LayerProfile& profile, int value_bytes, int optimizer_slots, index_t rows_per_sample = 1) {
  CUPIPE_REQUIRE(profile.forward.size() == Body::size, "planner: the profile has ", profile.forward.size(),
                 " layers but the model has ", Body::size);
  CostModel model;
  model.profiled_rows = profile.rows;
  model.rows_per_sample = rows_per_sample;
  model.value_bytes = value_bytes;
  model.optimizer_slots = optimizer_slots;
  [&]<std::size_t... I>(std::index_sequence<I...>) {
    (model.layers.push_back(LayerCost{profile.names[I], profile.forward[I], profile.backward_input[I],
                                      profile.backward_weight[I],
                                      double(Body::param_offsets[I + 1] - Body::param_offsets[I]),
                                      double(Body::widths[I]), double(Body::widths[I + 1]),
                                      double(Body::template layer<I>::saved_per_row(Body::widths[I]))}),
     ...);
    ((model.layers[I].ring_values = double(ring_values_of<typename Body::template layer<I>>())), ...);
    ((model.layers[I].all_to_all_values = double(all_to_all_values_of<typename Body::template layer<I>>())), ...);
  }(std::make_index_sequence<Body::size>());
  return model;
}

/// `model` with its layers' sizes (parameters, saved values per row) taken from `Body`, another
/// build of the same layers: one rank of expert groups (gpt::ExpertParallelModel), whose mixtures of
/// experts hold a share of the experts. The times stay the whole model's: with balanced routing a
/// rank computes as many tokens through its experts as one process does through all of them.
template <class Body>
CostModel sized_as(CostModel model) {
  CUPIPE_REQUIRE(model.layers.size() == Body::size, "planner: sized_as: the cost model has ", model.layers.size(),
                 " layers, the other build ", Body::size);
  [&]<std::size_t... I>(std::index_sequence<I...>) {
    ((model.layers[I].params = double(Body::param_offsets[I + 1] - Body::param_offsets[I]),
      model.layers[I].saved = double(Body::template layer<I>::saved_per_row(Body::widths[I]))),
     ...);
  }(std::make_index_sequence<Body::size>());
  return model;
}

namespace detail {
/// The fixed part of a time linear in rows, from `large` at `rows_large` and `small` at `rows_small`,
/// kept within [0, large].
inline double fixed_part(double large, double small, double rows_large, double rows_small) {
  const double slope = (large - small) / (rows_large - rows_small);
  return std::clamp(large - slope * rows_large, 0.0, large);
}
}  // namespace detail

/// The same from two profiles of the model at different microbatch sizes: `large` gives the times
/// at its rows, the pair gives each action's fixed part (a microbatch of r rows then takes
/// fixed + (time - fixed) x r / large.rows).
template <class Body>
CostModel cost_model(const LayerProfile& large, const LayerProfile& small, int value_bytes, int optimizer_slots,
                     index_t rows_per_sample = 1) {
  CUPIPE_REQUIRE(small.forward.size() == Body::size && small.rows >= 1 && small.rows < large.rows,
                 "planner: the second profile must cover the same ", Body::size, " layers with fewer rows (",
                 small.rows, " vs ", large.rows, ")");
  CostModel model = cost_model<Body>(large, value_bytes, optimizer_slots, rows_per_sample);
  const double rl = double(large.rows), rs = double(small.rows);
  for (std::size_t l = 0; l < Body::size; ++l) {
    LayerCost& c = model.layers[l];
    c.forward_fixed = detail::fixed_part(large.forward[l], small.forward[l], rl, rs);
    c.backward_input_fixed = detail::fixed_part(large.backward_input[l], small.backward_input[l], rl, rs);
    c.backward_weight_fixed = detail::fixed_part(large.backward_weight[l], small.backward_weight[l], rl, rs);
  }
  return model;
}

/// Measured seconds of a loss's forward and backward for one microbatch of `rows` rows.
struct LossProfile {
  double forward = 0, backward = 0;
  index_t rows = 0;
  /// A tensor-parallel loss (profile_loss' `group`): values one forward and one backward summed over
  /// the group, and the sums each ran.
  double sum_forward = 0, sum_backward = 0, sum_forward_calls = 0, sum_backward_calls = 0;
};

/// Times `Loss` (forward, then backward) on `rows` rows of random logits on a fresh context of
/// `Backend`, median of `repeats` runs; a tensor-parallel loss runs on `group`, which counts its sums.
template <class Loss, class Backend>
LossProfile profile_loss(index_t rows, int repeats = 5, CountingGroup* group = nullptr) {
  using T = typename Backend::value_type;  // the logits and their gradient
  using G = grad_t<Backend>;               // the loss (fp32 with bf16 storage)
  constexpr index_t classes = Loss::in_features;
  CUPIPE_REQUIRE(rows >= 1, "planner: time the loss on at least one row");
  Backend be;
  be.tensor_group = group;
  Rng rng(3);
  std::vector<T> logits_host(static_cast<std::size_t>(rows * classes));
  for (T& v : logits_host) v = T(float(rng.normal()));
  std::vector<std::int32_t> labels_host(static_cast<std::size_t>(rows));
  for (auto& l : labels_host) l = std::int32_t(rng.below(std::uint64_t(classes)));
  auto logits = be.template allocate<T>(rows * classes, MemoryTag::activations);
  auto dlogits = be.template allocate<T>(rows * classes, MemoryTag::activations);
  auto labels = be.template allocate<std::int32_t>(rows, MemoryTag::activations);
  auto loss = be.template allocate<G>(1, MemoryTag::workspace);
  be.upload(std::span<const T>(logits_host), logits.data());
  be.upload(std::span<const std::int32_t>(labels_host), labels.data());
  const ConstViewOn<Backend, T> x{logits.data(), Shape{rows, classes}};
  const ConstViewOn<Backend, std::int32_t> y{labels.data(), Shape{rows}};
  LossProfile out;
  out.rows = rows;
  const double runs = std::max(repeats, 1);
  if (group) group->reset();
  out.forward = cupipe::detail::median_seconds(repeats, [&] {
    Loss::forward(be, x, y, ViewOn<Backend, G>{loss.data(), Shape{1}}, rows);
    be.synchronize();
  });
  if (group) out.sum_forward = group->values / runs, out.sum_forward_calls = group->calls / runs, group->reset();
  out.backward = cupipe::detail::median_seconds(repeats, [&] {
    Loss::backward(be, x, y, ViewOn<Backend, T>{dlogits.data(), Shape{rows, classes}}, rows);
    be.synchronize();
  });
  if (group) out.sum_backward = group->values / runs, out.sum_backward_calls = group->calls / runs, group->reset();
  return out;
}

/// `profile` with the loss's times added to the last layer's forward and input gradient, the
/// actions the pipeline runs them in (the last stage's F and B).
inline LayerProfile with_loss(LayerProfile profile, const LossProfile& loss) {
  CUPIPE_REQUIRE(loss.rows == profile.rows, "planner: the loss was timed on ", loss.rows, " rows, the layers on ",
                 profile.rows);
  CUPIPE_REQUIRE(!profile.forward.empty(), "planner: the profile has no layers");
  profile.forward.back() += loss.forward;
  profile.backward_input.back() += loss.backward;
  if (!profile.sum_forward.empty()) {
    profile.sum_forward.back() += loss.sum_forward;
    profile.sum_forward_calls.back() += loss.sum_forward_calls;
    profile.sum_backward.back() += loss.sum_backward;
    profile.sum_backward_calls.back() += loss.sum_backward_calls;
  }
  return profile;
}

/// Measured seconds per parameter of a flush update's work on a fresh context of `Backend`: the
/// gradients' sum of squares, AdamW's step and zeroing the gradients, over `elements` parameters:
/// the median of at least `repeats` runs, more (up to 3 x `repeats`) while they disagree by over 2%
/// (detail::Rounds); `seen` records their spread. In the compute type: with bf16 storage the
/// optimizer updates the fp32 master weights (their rounding into the weights in use is left out).
template <class Backend>
double update_seconds_per_param(index_t elements, int repeats = 5, detail::RoundsSeen* seen = nullptr) {
  using T = grad_t<Backend>;
  CUPIPE_REQUIRE(elements >= 1, "planner: time the update on at least one parameter");
  Backend be;
  auto param = be.template allocate<T>(elements, MemoryTag::weights);
  auto grad = be.template allocate<T>(elements, MemoryTag::gradients);
  auto m = be.template allocate<T>(elements, MemoryTag::optimizer);
  auto v = be.template allocate<T>(elements, MemoryTag::optimizer);
  const Shape s{elements};
  for (auto* b : {&param, &grad, &m, &v}) fill(be, ViewOn<Backend, T>{b->data(), s}, T(0.01));
  const ViewOn<Backend, T> slots[] = {{m.data(), s}, {v.data(), s}};
  const optim::AdamW adamw({.lr = 1e-6});
  std::int64_t step = 0;
  double sink = 0;
  const std::vector<double> runs = detail::repeated({repeats, 3 * repeats, 0.02}, [&] {
    return cupipe::detail::median_seconds(1, [&] {
      sink += sum_of_squares(be, ConstViewOn<Backend, T>{grad.data(), s});
      adamw.update(be, ViewOn<Backend, T>{param.data(), s}, ConstViewOn<Backend, T>{grad.data(), s},
                   std::span<const ViewOn<Backend, T>>(slots), step++, 1.0);
      fill(be, ViewOn<Backend, T>{grad.data(), s}, T(0));
      be.synchronize();
    });
  });
  (void)sink;
  if (seen) seen->add(runs);
  return cupipe::detail::median(runs) / double(elements);
}

namespace detail {
/// Measured seconds a training step of `Model` on `Backend` takes beyond what `model` predicts for
/// its actions (their layers, CostModel::action_overhead_seconds each) and update, signed: a
/// one-stage pipeline (1F1B, `microbatches` microbatches) trains on `x` with random labels, and the
/// median of `steps` steps (after one) less the prediction.
template <class Model, class Backend>
double step_residual(ConstView<model_input_t<typename Model::body, typename Backend::value_type>> x, const CostModel& model,
                     int microbatches, int steps) {
  using Loss = loss_of_t<Model>;
  Rng rng(7);
  std::vector<std::int32_t> labels(static_cast<std::size_t>(x.rows()));
  for (auto& l : labels) l = std::int32_t(rng.below(std::uint64_t(Loss::in_features)));
  PipelineOptions options;
  options.microbatches = microbatches;
  Pipeline<partition<Model, 1>, schedule::OneFOneB, Backend> pipe(options);
  const ConstView<std::int32_t> y{labels.data(), Shape{x.rows()}};
  const optim::AdamW adamw({.lr = 1e-6});
  (void)pipe.train_step(x, y, adamw);  // allocates the optimizer's slots
  const double measured = cupipe::detail::median_seconds(steps, [&] { (void)pipe.train_step(x, y, adamw); });
  // The runtime's split of the rows into microbatches (whole samples; the first take one more).
  const index_t samples = x.rows() / model.rows_per_sample;
  double predicted = 0, params = 0;
  for (int j = 0; j < microbatches; ++j) {
    const double rows = double((samples / microbatches + (j < samples % microbatches ? 1 : 0)) * model.rows_per_sample);
    for (const LayerCost& l : model.layers)
      for (int action = 0; action < 3; ++action) predicted += detail::at_rows(model, l, action, rows);
    predicted += 2 * model.action_overhead_seconds;  // 1F1B: an F and a B (with its W) per microbatch
  }
  for (const LayerCost& l : model.layers) params += l.params;
  return measured - predicted - params * model.update_seconds_per_param;
}
}  // namespace detail

/// Measured seconds a training step of `Model` on `Backend` takes beyond what `model` predicts for
/// its actions (their layers, and CostModel::action_overhead_seconds each: measure that first) and
/// update: a one-stage pipeline (1F1B, `microbatches` microbatches) trains on `x` with random
/// labels, and the median of `steps` steps (after one) less the prediction is the overhead (staging
/// the batch, fresh allocations, reading the step's losses, waking the worker, and what running
/// layers back to back costs beyond timing each alone). Measured `tries` times, keeping the
/// smallest: a burst of load elsewhere on the machine only adds, and one such burst put a single
/// measurement 4x too high. Never negative.
template <class Model, class Backend>
double step_overhead_seconds(ConstView<model_input_t<typename Model::body, typename Backend::value_type>> x,
                             const CostModel& model, int microbatches = 2, int steps = 5, int tries = 3) {
  CUPIPE_REQUIRE(tries >= 1, "planner: measure the step overhead at least once, got ", tries, " tries");
  double best = std::numeric_limits<double>::infinity();
  for (int t = 0; t < tries; ++t) best = std::min(best, detail::step_residual<Model, Backend>(x, model, microbatches, steps));
  return std::max(0.0, best);
}

namespace detail {

/// The layer costs of `Model` on `Backend` from profiles on `x` (a batch of real inputs in host
/// memory), on a quarter and on a sixteenth of its samples (LayerCost::points; the first two also
/// give each action's fixed part); each size is profiled in rounds (detail::Rounds: 3, and up to 7
/// while their totals disagree by over 2%), each action taking its median over the rounds; `seen`
/// records the rounds' spread. A tensor-parallel Model runs on `group`, and each layer's sums per
/// row and calls come from the largest size.
template <class Model, class Backend>
CostModel profiled_layers(ConstView<model_input_t<typename Model::body, typename Backend::value_type>> x, int repeats,
                          index_t rows_per_sample, CountingGroup* group, const std::vector<int>& microbatch_counts = {},
                          RoundsSeen* seen = nullptr) {
  using Body = typename Model::body;
  using T = typename Backend::value_type;
  CUPIPE_REQUIRE(rows_per_sample >= 1 && x.rows() % rows_per_sample == 0, "planner: calibrate on whole samples of ",
                 rows_per_sample, " rows, got ", x.rows(), " rows");
  const index_t samples = x.rows() / rows_per_sample;
  CUPIPE_REQUIRE(samples >= 2, "planner: calibrate on at least two samples (the fixed part needs two sizes), got ", samples);
  const index_t small = std::max<index_t>(1, samples / 4) * rows_per_sample, width = x.numel() / x.rows();
  const auto once = [&](index_t rows) {
    const LayerProfile layers =
        profile_layers<Body, Backend>(ConstView<model_input_t<Body, T>>{x.data(), Shape{rows, width}}, repeats, group);
    return with_loss(layers, profile_loss<loss_of_t<Model>, Backend>(rows, repeats, group));
  };
  // Each size in rounds, the median over them per action: a stretch of slow wake-ups or a busy
  // neighbour (tens of milliseconds) then spoils a minority of them. The smaller of two rounds,
  // kept before, came out up to 26% faster than the steps that followed (issue #60).
  const auto profile = [&](index_t rows) {
    std::vector<LayerProfile> rounds;
    const std::vector<double> totals = repeated(Rounds{}, [&] {
      rounds.push_back(once(rows));
      double total = 0;
      for (std::size_t l = 0; l < rounds.back().forward.size(); ++l)
        total += rounds.back().forward[l] + rounds.back().backward_input[l] + rounds.back().backward_weight[l];
      return total;
    });
    if (seen) seen->add(totals);
    LayerProfile out = rounds.front();
    const auto median_of = [&](std::vector<double> LayerProfile::*action, std::size_t l) {
      std::vector<double> values;
      for (const LayerProfile& r : rounds) values.push_back((r.*action)[l]);
      return cupipe::detail::median(std::move(values));
    };
    for (std::size_t l = 0; l < out.forward.size(); ++l) {
      out.forward[l] = median_of(&LayerProfile::forward, l);
      out.backward_input[l] = median_of(&LayerProfile::backward_input, l);
      out.backward_weight[l] = median_of(&LayerProfile::backward_weight, l);
    }
    return out;
  };
  const LayerProfile large = profile(x.rows()), small_profile = profile(small);
  CostModel model = cost_model<Body>(large, small_profile, int(sizeof(T)), 2, rows_per_sample);
  model.compute_bytes = int(sizeof(grad_t<Backend>));
  // A third, smaller size where the batch allows: small microbatches are where times stop being
  // linear (a GEMM of a few rows runs far below its peak), and the points capture it.
  std::vector<LayerProfile> sizes{small_profile, large};
  if (const index_t tiny = std::max<index_t>(1, samples / 16) * rows_per_sample; tiny < small) sizes.insert(sizes.begin(), profile(tiny));
  // The largest microbatch of each count the planner will try (planned_microbatch_counts), where
  // the batch is split so: the planner then reads those times instead of drawing a line between
  // neighbours (a GEMM of 43 rows runs slower per row than the line from 16 to 64 rows says, by
  // about 8% for the MLP here).
  for (const int m : microbatch_counts) {
    CUPIPE_REQUIRE(m >= 1, "planner: a microbatch count to profile must be at least 1, got ", m);
    if (m < 2 || m > samples) continue;
    const index_t rows = (samples + m - 1) / m * rows_per_sample;
    // sizes stays ascending and distinct: insert where the rows belong, unless they are there.
    const auto at = std::lower_bound(sizes.begin(), sizes.end(), rows, [](const LayerProfile& p, index_t r) { return p.rows < r; });
    if (at == sizes.end() || at->rows != rows) sizes.insert(at, profile(rows));
  }
  for (std::size_t l = 0; l < Body::size; ++l) {
    LayerCost& c = model.layers[l];
    for (const LayerProfile& p : sizes) c.points.push_back({double(p.rows), p.forward[l], p.backward_input[l], p.backward_weight[l]});
    if (group) {
      c.sum_forward = large.sum_forward[l] / double(large.rows);
      c.sum_backward = large.sum_backward[l] / double(large.rows);
      c.sum_forward_calls = large.sum_forward_calls[l];
      c.sum_backward_calls = large.sum_backward_calls[l];
    }
  }
  model.tied = Body::tied.count > 0;
  return model;
}

}  // namespace detail

/// Measured seconds the runtime adds to each action on `Backend` beyond its layers' own work (the
/// dispatch, the record's allocation, the clocks, the mailbox): a one-stage pipeline of a 1 x 2
/// Linear trains on 16 rows in 2 and in 16 microbatches, and what the 14 more microbatches cost
/// beyond their profiled layers, over their 28 more actions (an F and a B each), is the figure. A
/// layout of many small microbatches pays it per action, which a per-layer profile does not see.
/// Never negative; the smaller of two measurements (the figure is microseconds, and a descheduled
/// thread only adds).
template <class Backend>
double action_overhead_seconds(int repeats = 3) {
  using T = typename Backend::value_type;
  using Trivial = Sequential<Linear<1, 2>>;
  constexpr index_t rows = 16;
  std::vector<T> values(static_cast<std::size_t>(rows));
  for (index_t i = 0; i < rows; ++i) values[std::size_t(i)] = T(double(i % 5) / 4.0 - 0.5);
  const ConstView<T> x{values.data(), Shape{rows, 1}};
  CostModel model = detail::profiled_layers<Trivial, Backend>(x, repeats, 1, nullptr);
  model.update_seconds_per_param = 0;  // 4 parameters: the same update in both runs, which cancels
  double best = std::numeric_limits<double>::infinity();
  for (int attempt = 0; attempt < 2; ++attempt) {
    const double few = detail::step_residual<Trivial, Backend>(x, model, 2, 15);
    const double many = detail::step_residual<Trivial, Backend>(x, model, 16, 15);
    best = std::min(best, (many - few) / 28.0);
  }
  return std::max(0.0, best);
}

/// How many processes the launcher started on this node, from its environment (Open MPI's
/// OMPI_COMM_WORLD_LOCAL_SIZE, MPICH's MPI_LOCALNRANKS, Slurm's SLURM_NTASKS_PER_NODE); 0 when
/// none says (not launched, or a launcher that does not tell).
inline int processes_on_this_node() {
  for (const char* name : {"OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS", "SLURM_NTASKS_PER_NODE"}) {
    const char* value = std::getenv(name);
    if (value == nullptr) continue;
    char* end = nullptr;
    const long n = std::strtol(value, &end, 10);  // Slurm may add "(x3)" after the count
    if (end != value && n > 0 && n < 1 << 20) return int(n);
  }
  return 0;
}

namespace detail {
/// Calls work(i) on `n` threads released together and returns each one's result, in order; the
/// first failure is rethrown once every thread has joined. `processes`: the threads stand for the
/// processes of this node, each on its own share of the machine's CPUs
/// (core::cpus::spread_over_machine), not on the CPUs of the calling thread, which a launcher may
/// have bound to one core (Open MPI does where it starts two or fewer ranks).
template <class Work>
std::vector<double> at_once(int n, bool processes, Work&& work) {
  std::vector<double> each(static_cast<std::size_t>(n), 0.0);
  std::vector<std::exception_ptr> errors(static_cast<std::size_t>(n));
  std::latch start(n);
  std::vector<std::thread> threads;
  try {
    for (int i = 0; i < n; ++i)
      threads.emplace_back([&, i] {
        try {
          if (processes) (void)core::cpus::spread_over_machine(std::size_t(i), std::size_t(n));
        } catch (...) {  // nothing above throws but an allocation: the thread runs where it was
        }
        start.arrive_and_wait();
        try {
          each[std::size_t(i)] = work(i);
        } catch (...) {
          errors[std::size_t(i)] = std::current_exception();
        }
      });
  } catch (...) {  // a thread that did not start: release the ones waiting for it, then report
    start.count_down(std::ptrdiff_t(n) - std::ptrdiff_t(threads.size()));
    for (std::thread& t : threads) t.join();
    throw;
  }
  for (std::thread& t : threads) t.join();
  for (const std::exception_ptr& e : errors)
    if (e) std::rethrow_exception(e);
  return each;
}
}  // namespace detail

/// Measured slowdown when `workers` workers compute at once on this machine (CostModel::contention):
/// entry n - 1, for n = 2 ... workers, is the wall time each of n threads takes to profile Model's
/// layers on `x` (each its own context, all started together) over the wall time one thread takes
/// alone, the fastest of three rounds that alternate the two for each (never below 1); entry 0 is 1.
/// Workers on cores of their own still share caches and memory bandwidth, which a profile taken
/// alone does not see; workers beyond the cores take turns on them. `processes`: the threads stand
/// for the processes a launcher started on this node, each on its own share of the machine's CPUs
/// (detail::at_once); otherwise they stand for one process's workers and run on its CPUs. A device
/// backend's workers each have their own device, and host threads of one process share nothing it
/// times: empty there.
template <class Model, class Backend>
std::vector<double> contention(ConstView<model_input_t<typename Model::body, typename Backend::value_type>> x, int workers,
                               int repeats = 3, bool processes = false) {
  using Body = typename Model::body;
  CUPIPE_REQUIRE(workers >= 1, "planner: measure contention for at least 1 worker, got ", workers);
  if constexpr (!host_accessible<typename Backend::space>) {
    return {};
  } else {
    // The wall time of a whole profile, not the medians it reports: a median of short timings
    // skips the samples a time-sliced thread lost to the others, so it cannot see workers beyond
    // the cores (4 threads on 2 cores read x1.07-1.17 that way).
    const auto seconds = [&] {
      const auto start = std::chrono::steady_clock::now();
      (void)profile_layers<Body, Backend>(x, repeats, nullptr, /*cold_caches=*/false);  // the layers' work alone
      return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    };
    const auto together = [&](int n) {
      double mean = 0;
      for (double t : detail::at_once(n, processes, [&](int) { return seconds(); })) mean += t / double(n);
      return mean;
    };
    std::vector<double> factors{1.0};
    for (int n = 2; n <= workers; ++n) {
      // Alone and together alternate, three rounds; the fastest of each. Contention is in every
      // round together, while a burst of load elsewhere only slows some rounds: a median of the
      // ratios read x1.46 and x1.83 on a 2-core VM in runs whose layouts then ran as if x1.0.
      double alone = std::numeric_limits<double>::infinity(), shared = alone;
      for (int round = 0; round < 3; ++round) {
        alone = std::min(alone, seconds());
        shared = std::min(shared, together(n));
      }
      factors.push_back(alone > 0 && std::isfinite(shared) ? std::max(1.0, shared / alone) : 1.0);
    }
    return factors;
  }
}

/// The cost model of `Model` on `Backend`, measured here: every layer and the model's loss profiled
/// on `x` (a batch of real inputs in host memory), on a quarter and on a sixteenth of its samples
/// (LayerCost::points; the first two also give each action's fixed part), the optimizer step (AdamW:
/// two slots), the runtime's cost per action (action_overhead_seconds), the step's overhead
/// (step_overhead_seconds), an in-process hand-over between two contexts (local_link) and a
/// waiting worker's wake-up (wake_seconds) and workers slowing each other (contention). Each size is
/// profiled in rounds, more where they disagree, and each action keeps its median over them; the
/// update too (CostModel::calibration_spread says how well they agreed). `rows_per_sample`: a sequence's tokens
/// for a transformer. `microbatch_counts` (planned_microbatch_counts): also profile the largest
/// microbatch of each count, ceil(samples / m), as the planner will split this batch (one
/// replica's), so its times at those sizes are measured, not interpolated. Takes a few seconds.
template <class Model, class Backend>
CostModel calibrate(ConstView<model_input_t<typename Model::body, typename Backend::value_type>> x, int repeats = 3,
                    index_t rows_per_sample = 1, const std::vector<int>& microbatch_counts = {}) {
  using Body = typename Model::body;
  if (detail::quick_calibration()) repeats = 1;  // one run per measurement, and one round (rounds.hpp)
  detail::RoundsSeen seen;
  CostModel model = detail::profiled_layers<Model, Backend>(x, repeats, rows_per_sample, nullptr, microbatch_counts, &seen);
  model.update_seconds_per_param = update_seconds_per_param<Backend>(std::max<index_t>(1, Body::param_count), std::max(repeats, 5), &seen);
  model.calibration_spread = seen.spread;
  model.calibration_rounds = seen.rounds;
  model.action_overhead_seconds = action_overhead_seconds<Backend>(repeats);
  model.wake_seconds = wake_seconds<Backend>();
  // Contention on the microbatch size of the profile's middle point (a quarter of the batch), for
  // as many workers as this machine has cores, or as the launcher started processes on this node
  // if more (they time-slice), 2 to 8.
  const index_t quarter = std::max<index_t>(1, x.rows() / rows_per_sample / 4) * rows_per_sample, width = x.numel() / x.rows();
  const int cores = std::clamp(std::max(int(std::thread::hardware_concurrency()), processes_on_this_node()), 2, 8);
  // Under a launcher the threads stand for its processes, each with cores of its own.
  model.contention = contention<Model, Backend>(ConstView<model_input_t<Body, typename Backend::value_type>>{x.data(), Shape{quarter, width}},
                                                cores, repeats, processes_on_this_node() > 1);
  // Measured with two microbatches: one microbatch of the whole batch is the one layout whose
  // working set is largest, and on a CPU it runs slower than its layers timed alone.
  model.step_overhead_seconds = step_overhead_seconds<Model, Backend>(x, model, 2);
  const LinkCost link = local_link<Backend>();
  model.link_latency = link.latency;
  model.link_bytes_per_second = link.bytes_per_second;
  model.offload_bytes_per_second = offload_bandwidth<Backend>();
  return model;
}

/// One rank's part of `TensorParallelModel` (the model split `degree` ways, e.g.
/// gpt::TensorParallelModel<c, 2>), profiled on `Backend` as calibrate profiles the whole model, on
/// a group of `degree` ranks whose sums are counted, not run: per layer the part's times, sizes and
/// the values per row it sums in its forward and input gradient (with the calls). The planner adds
/// the sums' time from CostModel::tensor_sum_latency and tensor_sum_bytes_per_second. Add the result
/// to the whole model's CostModel::tensor_variants; its layers must be the same list.
template <class TensorParallelModel, class Backend>
TensorVariant calibrate_tensor_parts(ConstView<model_input_t<typename TensorParallelModel::body, typename Backend::value_type>> x,
                                     int degree, int repeats = 3, index_t rows_per_sample = 1) {
  CUPIPE_REQUIRE(degree >= 2, "planner: a tensor-parallel profile splits the model at least 2 ways, got ", degree);
  // A device backend's sums would go to a group that takes device memory (NCCL): no host copies.
  CountingGroup group(degree, 0, nullptr, !host_accessible<typename Backend::space>);
  return {degree, detail::profiled_layers<TensorParallelModel, Backend>(x, repeats, rows_per_sample, &group).layers};
}

}  // namespace cupipe::planner
