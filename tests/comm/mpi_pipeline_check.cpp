// SPDX-License-Identifier: Apache-2.0
// Run under mpirun: a pipeline spread over processes (MpiCommunicator, host backend, float64) must
// compute what the same pipeline computes in one process on the whole batch.
//   mpi_pipeline_check --schedule 1f1b|interleaved|gpipe|zbv|gpt|bf16|packed|context --stages P [--cp N] [--stall] [--zero[=2|=3]]
//                      [--keep-gathered] [--checkpoint PREFIX]
// World = P stages x D replicas. Each replica trains on its share of one global batch. Rank 0 also
// runs the single-process reference and compares gradients after one forward/backward and weights
// after 3 AdamW steps: bitwise for one replica (same arithmetic in the same order), 1e-12 relative
// with replicas (the replica sum adds the same terms in another order). Each rank's activation peak
// in its first step must be the planner's to the value (messages landing as their receivers take them).
// --schedule gpt runs 1F1B on a small GPT whose lm_head is tied to wte, on different ranks: the tied
// copies' gradients meet in a sum over the stages, and must stay bitwise equal.
// --schedule bf16 runs 1F1B with bf16 storage and fp32 master weights (Host<bfloat16, float>).
// --schedule context --cp N runs a GPT on 2 stages x D data-parallel replicas x rings of N
// context-parallel ranks (cp/), each rank holding its two zigzag chunks of its replica's sequences:
// losses, gradient norms, weights and predictions equal one process on whole sequences to 1e-12.
// --zero turns ZeRO-1 on (PipelineOptions::zero): the same comparisons must hold, and each replica must
// hold the optimizer state of its shard only, the replicas' shards adding up to the whole stage.
// --zero=2 turns ZeRO-2 on: the same again, and between steps each replica holds its shard of the
// gradients only; their reduce-scatters start inside the step, as the sums do without ZeRO.
// --zero=3 turns ZeRO-3 on: the same again, and between steps each replica holds its shard of the
// weights only; a stage's weights are gathered once per step where the worker has one virtual stage,
// and again at each change of stage with several (--keep-gathered: once per stage and step). With
// --checkpoint, what the run saves loads under the other ZeRO stages (0, 1 and 3) and their next
// step matches the run's.
// --stall makes the rank whose stage holds the Trap layer stop answering in the middle of the second
// step; the other ranks must then fail with an error naming their stage, action and peer within the
// transfer timeout.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <span>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "cupipe/comm/mpi.hpp"
#include "cupipe/cupipe.hpp"
#include "cupipe/gpt/model.hpp"
#include "cupipe/planner/search.hpp"
#include "compare.hpp"
#include "hook_layer.hpp"

using namespace cupipe;
using cupipe::testing::number;
using cupipe::testing::relative;
using cupipe::testing::run_check;
using cupipe::testing::verdict_everywhere;

namespace {

bool stall = false;
int zero = 0;  ///< the ZeRO stage
bool keep_gathered = false;  ///< ZeRO-3 with reshard_after_forward off
int calls = 0;

/// With --stall, the 6th forward of the stage holding the trap blocks for good (a hung peer).
void trap() {
  if (stall && ++calls == 6) std::this_thread::sleep_for(std::chrono::hours(1));
}
using Trap = HookLayer<trap>;

using Model = Sequential<Linear<6, 12>, ReLU, Linear<12, 12>, Trap, Linear<12, 10>, ReLU, Linear<10, 10>, ReLU, Linear<10, 8>,
                         ReLU, Linear<8, 8>, ReLU, Linear<8, 8>, GELU, Linear<8, 6>, ReLU, Linear<6, 3>>;

std::string checkpoint;

/// With --zero: each replica holds the optimizer state (2 AdamW slots of float64) of its shards only,
/// with --zero=2 (between steps) the gradients (one array) too, with --zero=3 the weights too: the replicas of a stage together
/// hold the stage's arrays once, so every rank's bytes add up to the whole model's, and one replica
/// holds at most 1/R of its stages' plus the rounding of each shard. Measured by the allocator.
template <class Pipe>
int check_shards(Pipe& pipe, comm::Communicator& comm, std::size_t model_params, MemoryTag tag, int arrays) {
  const comm::Topology& t = comm.topology();
  constexpr double bytes = sizeof(typename Pipe::G);  // AdamW's slots and the gradients are in the compute precision
  const double mine = double(pipe.backend(t.stage()).memory.in_use(tag));
  std::vector<double> stage{mine};
  comm.sum_over_replicas(stage.data(), 1);
  const double world = comm.sum_over_world(mine), whole = arrays * bytes * double(model_params);
  const bool ok = world == whole && mine <= stage[0] / t.replicas + arrays * bytes * Pipe::chunks &&
                  (t.replicas == 1 || mine < stage[0]);
  std::printf("rank %d: %s %.0f bytes, its stage's replicas %.0f together (%d replicas), all ranks %.0f for a model of "
              "%.0f: %s\n", t.rank, tag == MemoryTag::optimizer ? "optimizer state" : tag == MemoryTag::weights ? "weights" : "gradients", mine, stage[0],
              t.replicas, world, whole, ok ? "sharded" : "DIFFERENT");
  return ok ? 0 : 1;
}
/// check_shards for the ZeRO stage on: the optimizer state, and with ZeRO-2 the gradients.
template <class Pipe>
int check_zero_shards(Pipe& pipe, comm::Communicator& comm, std::size_t model_params) {
  int failures = zero >= 1 ? check_shards(pipe, comm, model_params, MemoryTag::optimizer, 2) : 0;
  if (zero >= 2) failures += check_shards(pipe, comm, model_params, MemoryTag::gradients, 1);
  if (zero >= 3) failures += check_shards(pipe, comm, model_params, MemoryTag::weights, 1);
  return failures;
}

/// The bytes of each of worker w's virtual stages' whole weights (in the storage type).
template <class Pipe>
std::vector<double> local_stage_bytes(int w) {
  using Stages = typename Pipe::stage_list;
  std::vector<double> out;
  [&]<std::size_t... K>(std::index_sequence<K...>) {
    ((Pipe::worker_of(int(K)) == w ? out.push_back(double(Stages::template stage<K>::param_count) * sizeof(typename Pipe::T))
                                   : void()),
     ...);
  }(std::make_index_sequence<Stages::size>());
  return out;
}

/// This rank's activation peak in its first step (`rows` rows) against the planner's: across
/// processes a message takes its receiver's memory as the receiver takes it
/// (planner::detail::Landing::at_receive), so the planner's least and most peak are one figure,
/// whatever the timing, and the allocator must count exactly that.
template <class Pipe>
int check_activation_peak(const Pipe& pipe, const StepStats& stats, const comm::Topology& topo, index_t rows) {
  pipeline::StepPlan split;
  pipeline::split_rows(split, rows, pipe.plan().config.total_microbatches());
  const std::vector<double> per_microbatch(split.rows.begin(), split.rows.end());
  const planner::detail::ActivationBounds bounds = planner::detail::activation_bounds(
      pipe.plan(), planner::detail::stage_chunk_sizes<typename Pipe::stage_list>(), per_microbatch, nullptr,
      planner::detail::Landing::at_receive);
  const std::size_t w = std::size_t(topo.stage());
  const double measured = double(stats.peak_activation_bytes[w]) / double(sizeof(typename Pipe::T));
  const bool ok = measured == bounds.low[w] && measured == bounds.high[w];
  if (!ok || topo.rank == 0)
    std::printf("rank %d: activation peak %.0f values measured, %.0f to %.0f planned (messages land as they are taken): %s\n",
                topo.rank, measured, bounds.low[w], bounds.high[w], ok ? "equal" : "FAIL");
  return ok ? 0 : 1;
}

template <class Stages, class Schedule>
int check(int microbatches, int rank) {
  auto comm = std::make_shared<comm::MpiCommunicator>(MPI_COMM_WORLD, Stages::size / Schedule::chunks);
  const comm::Topology& topo = comm->topology();
  if (rank == 0) std::printf("%s\n", topo.describe().c_str());
  constexpr index_t global_batch = 24;
  const index_t share = global_batch / topo.replicas;
  std::vector<double> x(static_cast<std::size_t>(global_batch * 6));
  std::vector<std::int32_t> y(static_cast<std::size_t>(global_batch));
  Rng rng(3);
  for (double& v : x) v = rng.normal();
  for (auto& v : y) v = std::int32_t(rng.below(3));
  const ConstView<double> mine{x.data() + topo.replica() * share * 6, Shape{share, 6}};
  const ConstView<std::int32_t> mine_y{y.data() + topo.replica() * share, Shape{share}};
  const ConstView<double> all{x.data(), Shape{global_batch, 6}};
  const ConstView<std::int32_t> all_y{y.data(), Shape{global_batch}};

  PipelineOptions options{.microbatches = microbatches, .seed = 11, .transfer_timeout_seconds = stall ? 4.0 : 60.0,
                          .communicator = comm, .zero = zero, .reshard_after_forward = !keep_gathered};
  Pipeline<Stages, Schedule, backend::Host<double>> distributed(options);
  Pipeline<Stages, Schedule, backend::Host<double>> reference({.microbatches = microbatches * topo.replicas, .seed = 11});
  optim::AdamW adamw({.lr = 1e-2, .weight_decay = 0.01});

  int failures = 0;
  auto compare = [&](const char* what, const std::vector<double>& got, const std::vector<double>& want) {
    const double r = relative(got, want);
    const bool exact = got == want;
    const bool ok = topo.replicas == 1 ? exact : r <= 1e-12;
    if (rank == 0) std::printf("%s: %s (max relative difference %.3g)\n", what, ok ? "equal" : "DIFFERENT", r);
    failures += !ok;
  };

  const StepStats stats = distributed.forward_backward(mine, mine_y);
  failures += check_activation_peak(distributed, stats, topo, share);
  const std::vector<double> grads = distributed.gradients();
  distributed.step(adamw);
  if (rank == 0) {
    const StepStats ref = reference.forward_backward(all, all_y);
    compare("gradients after one forward/backward", grads, reference.gradients());
    std::printf("loss %.15g (single process %.15g)\n", stats.loss, ref.loss);
    failures += std::abs(stats.loss - ref.loss) > 1e-12 * std::abs(ref.loss);
    reference.step(adamw);
  }
  for (int s = 0; s < 2; ++s) {
    const StepStats step = distributed.train_step(mine, mine_y, adamw);
    if (rank == 0) reference.train_step(all, all_y, adamw);
    // With replicas (and without ZeRO-1), each of this process's virtual stages started its sum
    // (with ZeRO-2 its reduce-scatter) over the replicas inside the step, as soon as its backward
    // was done.
    const int expected = topo.replicas > 1 && zero != 1 ? Schedule::chunks : 0;
    if (step.overlapped_gradient_sums != expected) {
      std::printf("rank %d: %d gradient sums overlapped the step, expected %d: FAIL\n", rank,
                  step.overlapped_gradient_sums, expected);
      ++failures;
    } else if (rank == 0 && s == 0) {
      std::printf("gradient sums started inside the step: %d per rank\n", expected);
    }
    // ZeRO-3: one gather per virtual stage and step where a worker has one stage, or keeps what it
    // gathered; with several stages per worker, resharding gathers again at each change of stage:
    // as many as the planner counts (planner::detail::gathered_params, one per stage here).
    const bool zero3 = zero == 3 && topo.replicas > 1;
    const std::int64_t planned = std::int64_t(planner::detail::gathered_params(
        distributed.plan(), topo.stage(), std::vector<double>(std::size_t(Stages::size), 1.0), !keep_gathered));
    // Every gather but the step's first is prefetched: started during the action before.
    const std::int64_t g = step.parameter_gathers, early = step.prefetched_parameter_gathers;
    const bool gathers_ok = !zero3 ? g == 0 && early == 0
                                   : (Schedule::chunks == 1 || keep_gathered ? g == Schedule::chunks : g > Schedule::chunks) &&
                                         g == planned && early == g - 1;
    if (!gathers_ok) {
      std::printf("rank %d: %lld parameter gathers in the step, %lld prefetched: FAIL\n", rank, static_cast<long long>(g),
                  static_cast<long long>(early));
      ++failures;
    } else if (rank == 0 && s == 0 && zero3) {
      std::printf("parameter gathers in the step: %lld on rank 0, %lld prefetched\n", static_cast<long long>(g),
                  static_cast<long long>(early));
    }
    // The whole weights a rank held at once within the step, above its shards (the prefetch lands
    // in host memory): resharding, one virtual stage's at most; keeping them, all its stages'.
    if (zero3) {
      const MemoryTracker& memory = distributed.backend(topo.stage()).memory;
      const double above = double(memory.peak(MemoryTag::weights) - memory.in_use(MemoryTag::weights));
      const std::vector<double> stages = local_stage_bytes<decltype(distributed)>(topo.stage());
      double largest = 0, all_of_them = 0;
      for (const double b : stages) largest = std::max(largest, b), all_of_them += b;
      const bool ok = keep_gathered ? above == all_of_them : above <= largest && above > 0;
      if (!ok || (rank == 0 && s == 0))
        std::printf("rank %d: whole weights held at once in the step %.0f bytes (its %zu stages: largest %.0f, all %.0f): %s\n",
                    rank, above, stages.size(), largest, all_of_them, ok ? "as expected" : "FAIL");
      failures += !ok;
    }
  }
  // Gradient accumulation: two forward/backward passes over halves of each replica's share, reduced
  // over the replicas once, at the update; one process sees each half of every replica at once.
  {
    const index_t half = share / 2;
    std::vector<double> halves_x[2];
    std::vector<std::int32_t> halves_y[2];
    for (int h = 0; h < 2; ++h)
      for (int r = 0; r < topo.replicas; ++r) {
        const index_t first = r * share + h * half;
        halves_x[h].insert(halves_x[h].end(), x.begin() + first * 6, x.begin() + (first + half) * 6);
        halves_y[h].insert(halves_y[h].end(), y.begin() + first, y.begin() + first + half);
      }
    // The gradients read between the passes too: the second pass adds to their sum, once.
    std::vector<double> first_half;
    for (int h = 0; h < 2; ++h) {
      distributed.forward_backward(ConstView<double>{mine.data() + h * half * 6, Shape{half, 6}},
                                   ConstView<std::int32_t>{mine_y.data() + h * half, Shape{half}});
      if (h == 0) first_half = distributed.gradients();
    }
    const std::vector<double> accumulated = distributed.gradients();
    if (rank == 0) {
      for (int h = 0; h < 2; ++h) {
        reference.forward_backward(ConstView<double>{halves_x[h].data(), Shape{half * topo.replicas, 6}},
                                   ConstView<std::int32_t>{halves_y[h].data(), Shape{half * topo.replicas}});
        if (h == 0) compare("gradients read after the first of two forward/backward passes", first_half, reference.gradients());
      }
      compare("gradients accumulated over two forward/backward passes", accumulated, reference.gradients());
    }
    distributed.step(adamw);
    if (rank == 0) reference.step(adamw);
    // Once more, stepping straight from the unreduced sums (with ZeRO-1: reduce-scattered).
    for (int h = 0; h < 2; ++h)
      distributed.forward_backward(ConstView<double>{mine.data() + h * half * 6, Shape{half, 6}},
                                   ConstView<std::int32_t>{mine_y.data() + h * half, Shape{half}});
    distributed.step(adamw);
    if (rank == 0) {
      for (int h = 0; h < 2; ++h)
        reference.forward_backward(ConstView<double>{halves_x[h].data(), Shape{half * topo.replicas, 6}},
                                   ConstView<std::int32_t>{halves_y[h].data(), Shape{half * topo.replicas}});
      reference.step(adamw);
    }
  }
  const std::vector<double> weights = distributed.parameters();
  if (rank == 0) compare("weights after 5 AdamW steps (the last two from accumulated halves)", weights, reference.parameters());
  failures += check_zero_shards(distributed, *comm, weights.size());

  // Checkpoints are by layer: what this P x D run saves loads into a single process split another
  // way, and what a single process saves loads into this P x D run.
  if (!checkpoint.empty()) {
    io::TrainingState state;
    state.updates = distributed.updates();
    const std::vector<double> exp_avg_sq = distributed.optimizer_state(1);  // collective: every rank
    io::save_checkpoint(checkpoint + ".distributed", distributed, adamw, state);  // rank 0 writes
    if (rank == 0) io::save_checkpoint(checkpoint + ".single", reference, adamw, state);
    MPI_Barrier(MPI_COMM_WORLD);
    if (rank == 0) {
      Pipeline<partition<Model, 3>, schedule::GPipe, backend::Host<double>> other({.microbatches = 2});
      io::load_checkpoint(checkpoint + ".distributed", other, adamw);
      compare("a 3-stage single process loading this run's checkpoint", other.parameters(), weights);
      compare("its AdamW state", other.optimizer_state(1), exp_avg_sq);
    }
    Pipeline<Stages, Schedule, backend::Host<double>> loaded(options);
    io::load_checkpoint(checkpoint + ".single", loaded, adamw);
    const std::vector<double> loaded_weights = loaded.parameters();
    if (rank == 0) compare("this run loading a single process's checkpoint", loaded_weights, reference.parameters());
    // The same checkpoint under each other ZeRO stage: the weights and AdamW state it loads, and the
    // next step from them, must be this run's.
    distributed.train_step(mine, mine_y, adamw);
    const std::vector<double> next = distributed.parameters();
    for (const int other_zero : {0, 1, 3}) {
      if (other_zero == zero) continue;
      PipelineOptions other_options = options;
      other_options.zero = other_zero;
      Pipeline<Stages, Schedule, backend::Host<double>> other(other_options);
      io::load_checkpoint(checkpoint + ".distributed", other, adamw);
      const std::string under = "ZeRO-" + std::to_string(other_zero) + " loading this run's checkpoint";
      const std::vector<double> other_weights = other.parameters(), other_state = other.optimizer_state(1);
      if (rank == 0) compare(under.c_str(), other_weights, weights);
      if (rank == 0) compare((under + ": its AdamW state").c_str(), other_state, exp_avg_sq);
      other.train_step(mine, mine_y, adamw);
      const std::vector<double> other_next = other.parameters();
      if (rank == 0) compare((under + ": the next step").c_str(), other_next, next);
    }
  }
  return verdict_everywhere(failures);
}

/// V 64, T 8, 2 blocks, 2 heads, C 16: at namespace scope, since clang refuses a local constexpr
/// object as a template argument inside a function template.
constexpr gpt::Config small_gpt{64, 8, 2, 2, 16};

/// A tied GPT (small_gpt) on P stages x D replicas against one process.
template <int P>
int check_gpt(int rank) {
  constexpr gpt::Config config = small_gpt;
  using Gpt = gpt::Model<small_gpt>;
  using Stages = partition<Gpt, P>;
  auto comm = std::make_shared<comm::MpiCommunicator>(MPI_COMM_WORLD, P);
  const comm::Topology& topo = comm->topology();
  if (rank == 0) std::printf("%s\n", topo.describe().c_str());
  constexpr index_t sequences = 8;
  const index_t share = sequences / topo.replicas * config.context;
  std::vector<std::int32_t> ids(std::size_t(sequences * config.context)), next(ids.size());
  Rng rng(5);
  for (auto& v : ids) v = std::int32_t(rng.below(std::uint64_t(config.vocab)));
  for (auto& v : next) v = std::int32_t(rng.below(std::uint64_t(config.vocab)));
  const index_t rows = sequences * config.context;
  const ConstView<std::int32_t> mine{ids.data() + topo.replica() * share, Shape{share, 1}};
  const ConstView<std::int32_t> mine_y{next.data() + topo.replica() * share, Shape{share}};
  const ConstView<std::int32_t> all{ids.data(), Shape{rows, 1}};
  const ConstView<std::int32_t> all_y{next.data(), Shape{rows}};
  Pipeline<Stages, schedule::OneFOneB, backend::Host<double>> distributed(
      {.microbatches = 2, .seed = 4, .transfer_timeout_seconds = 60.0, .communicator = comm, .zero = zero,
       .reshard_after_forward = !keep_gathered});
  Pipeline<Stages, schedule::OneFOneB, backend::Host<double>> reference({.microbatches = 2 * topo.replicas, .seed = 4});
  optim::AdamW adamw({.lr = 1e-2, .weight_decay = 0.1, .clip_norm = 0.5});
  int failures = 0;
  for (int s = 0; s < 3; ++s) {
    const StepStats got = distributed.train_step(mine, mine_y, adamw);
    if (rank == 0) {
      const StepStats want = reference.train_step(all, all_y, adamw);
      const bool ok = std::abs(got.grad_norm - want.grad_norm) <= 1e-12 * want.grad_norm;
      std::printf("step %d: gradient norm %.15g (single process %.15g): %s\n", s, got.grad_norm, want.grad_norm,
                  ok ? "equal" : "DIFFERENT");
      failures += !ok;
    }
  }
  const std::vector<double> weights = distributed.parameters();
  if (rank == 0) {
    const std::vector<double> want = reference.parameters();
    const double r = relative(weights, want);
    const bool ok = topo.replicas == 1 ? weights == want : r <= 1e-12;
    std::printf("weights after 3 AdamW steps: %s (max relative difference %.3g)\n", ok ? "equal" : "DIFFERENT", r);
    constexpr TiedCopies tied = Gpt::body::tied;
    const bool same = std::memcmp(weights.data() + tied.first, weights.data() + tied.second,
                                  std::size_t(tied.count) * sizeof(double)) == 0;
    std::printf("tied copies (stage 0 and stage %d): %s\n", P - 1, same ? "equal" : "DIFFERENT");
    failures += !ok + !same;
  }
  failures += check_zero_shards(distributed, *comm, weights.size());
  return verdict_everywhere(failures);
}

/// Packed sequences (PipelineOptions::packed_sequences) on 2 stages x D replicas against one process
/// given the same borders: 3 AdamW steps, weights to 1e-12. Then every rank of stage 1 passes other
/// borders than stage 0's: every rank throws, naming the disagreement, before any action runs.
int check_packed(int rank) {
  constexpr gpt::Config config = small_gpt;
  using Gpt = gpt::Model<small_gpt>;
  using Stages = partition<Gpt, 2>;
  constexpr index_t T = config.context;
  auto comm = std::make_shared<comm::MpiCommunicator>(MPI_COMM_WORLD, 2);
  const comm::Topology& topo = comm->topology();
  if (rank == 0) std::printf("%s, packed sequences\n", topo.describe().c_str());
  constexpr index_t sequences = 8;
  const index_t share = sequences / topo.replicas * T;
  std::vector<std::int32_t> ids(std::size_t(sequences * T)), next(ids.size());
  Rng rng(6);
  for (auto& v : ids) v = std::int32_t(rng.below(std::uint64_t(config.vocab)));
  for (auto& v : next) v = std::int32_t(rng.below(std::uint64_t(config.vocab)));
  for (index_t s = 0; s < sequences; ++s) ids[std::size_t(s * T + 1 + index_t(rng.below(std::uint64_t(T - 1))))] = 3;
  const std::vector<std::int32_t> starts = document_starts(ids, T, 3);
  const index_t first = topo.replica() * share;
  const ConstView<std::int32_t> mine{ids.data() + first, Shape{share, 1}};
  const ConstView<std::int32_t> mine_y{next.data() + first, Shape{share}};
  const DocumentStarts my_documents{starts.data() + first, share};
  Pipeline<Stages, schedule::OneFOneB, backend::Host<double>> distributed(
      {.microbatches = 2, .seed = 4, .packed_sequences = true, .transfer_timeout_seconds = 60.0, .communicator = comm});
  Pipeline<Stages, schedule::OneFOneB, backend::Host<double>> reference(
      {.microbatches = 2 * topo.replicas, .seed = 4, .packed_sequences = true});
  const optim::AdamW adamw({.lr = 1e-2, .weight_decay = 0.1, .clip_norm = 0.5});
  int failures = 0;
  for (int s = 0; s < 3; ++s) {
    distributed.train_step(mine, mine_y, adamw, my_documents);
    if (rank == 0)
      reference.train_step(ConstView<std::int32_t>{ids.data(), Shape{sequences * T, 1}},
                           ConstView<std::int32_t>{next.data(), Shape{sequences * T}}, adamw,
                           DocumentStarts{starts.data(), sequences * T});
  }
  const std::vector<double> weights = distributed.parameters();
  if (rank == 0) {
    const double r = relative(weights, reference.parameters());
    const bool ok = r <= 1e-12;
    std::printf("packed: weights after 3 AdamW steps: %s (max relative difference %.3g)\n", ok ? "equal" : "DIFFERENT", r);
    failures += !ok;
  }
  // Stage 1 (on every replica) with every sequence one document: the stages disagree.
  const std::vector<std::int32_t> whole(std::size_t(share), 0);
  const bool stage_one = topo.stage() == 1;
  try {
    distributed.train_step(mine, mine_y, adamw, stage_one ? DocumentStarts{whole.data(), share} : my_documents);
    std::printf("rank %d: borders that differ between the stages were NOT REFUSED\n", rank);
    ++failures;
  } catch (const error& e) {
    const bool named = std::string(e.what()).find("given different document borders") != std::string::npos;
    if (!named) std::printf("rank %d: FAIL, another error: %s\n", rank, e.what());
    failures += !named;
  }
  return verdict_everywhere(failures);
}

/// Context parallelism: the GPT (small_gpt, whose 8 tokens cut into 8 chunks of one for rings of
/// 4; the pipeline type check_gpt<2> builds, so no new one to compile) on 2 stages x D data-parallel replicas x rings of `cp`
/// ranks against one process on whole sequences, 3 AdamW steps (losses and gradient norms at each,
/// then weights, to 1e-12), then predictions: each rank's logits equal the reference's rows it
/// holds. Packed sequences with a ring are refused on every rank.
int check_context(int rank, int cp) {
  using Gpt = gpt::Model<small_gpt>;
  using Stages = partition<Gpt, 2>;
  constexpr index_t T = small_gpt.context, V = small_gpt.vocab, sequences = 8;
  auto comm = std::make_shared<comm::MpiCommunicator>(MPI_COMM_WORLD, 2, 60.0, 1, comm::RankOrder::stages_outermost, cp);
  const comm::Topology& topo = comm->topology();
  const int dp = topo.replicas / cp;
  if (rank == 0) std::printf("%s\n", topo.describe().c_str());
  std::vector<std::int32_t> ids(std::size_t(sequences * T)), next(ids.size());
  Rng rng(8);
  for (auto& v : ids) v = std::int32_t(rng.below(std::uint64_t(V)));
  for (auto& v : next) v = std::int32_t(rng.below(std::uint64_t(V)));
  const index_t share = sequences / dp * T, first = topo.data_replica() * share;
  const auto mine = [&](const std::vector<std::int32_t>& whole) {
    return cp::local_rows(std::span<const std::int32_t>(whole.data() + first, std::size_t(share)), T, topo.context_rank(), cp);
  };
  const std::vector<std::int32_t> my_ids = mine(ids), my_next = mine(next);
  const index_t n = index_t(my_ids.size());
  Pipeline<Stages, schedule::OneFOneB, backend::Host<double>> distributed(
      {.microbatches = 2, .seed = 4, .transfer_timeout_seconds = 60.0, .communicator = comm});
  Pipeline<Stages, schedule::OneFOneB, backend::Host<double>> reference({.microbatches = 2 * dp, .seed = 4});
  const optim::AdamW adamw({.lr = 1e-2, .weight_decay = 0.1, .clip_norm = 0.5});
  int failures = 0;
  for (int s = 0; s < 3; ++s) {
    const StepStats got = distributed.train_step(ConstView<std::int32_t>{my_ids.data(), Shape{n, 1}},
                                                 ConstView<std::int32_t>{my_next.data(), Shape{n}}, adamw);
    if (rank != 0) continue;
    const StepStats want = reference.train_step(ConstView<std::int32_t>{ids.data(), Shape{sequences * T, 1}},
                                                ConstView<std::int32_t>{next.data(), Shape{sequences * T}}, adamw);
    const bool ok = std::abs(got.loss - want.loss) <= 1e-12 * want.loss &&
                    std::abs(got.grad_norm - want.grad_norm) <= 1e-12 * want.grad_norm;
    std::printf("step %d: loss %.15g, gradient norm %.15g (single process %.15g, %.15g): %s\n", s, got.loss, got.grad_norm,
                want.loss, want.grad_norm, ok ? "equal" : "DIFFERENT");
    failures += !ok;
  }
  const std::vector<double> weights = distributed.parameters();
  if (rank == 0) {
    const double r = relative(weights, reference.parameters());
    std::printf("context parallel: weights after 3 AdamW steps: %s (max relative difference %.3g)\n",
                r <= 1e-12 ? "equal" : "DIFFERENT", r);
    failures += r > 1e-12;
  }
  // Predictions: every rank gets the logits of its rows; the reference's (one process, rank 0's
  // copy broadcast as doubles) taken at the same rows.
  std::vector<double> got(std::size_t(n * V)), want(std::size_t(sequences * T * V));
  distributed.predict(ConstView<std::int32_t>{my_ids.data(), Shape{n, 1}}, TensorView<double>{got.data(), Shape{n, V}});
  if (rank == 0)
    reference.predict(ConstView<std::int32_t>{ids.data(), Shape{sequences * T, 1}},
                      TensorView<double>{want.data(), Shape{sequences * T, V}});
  MPI_Bcast(want.data(), int(want.size()), MPI_DOUBLE, 0, MPI_COMM_WORLD);
  const std::vector<double> my_want = cp::local_rows(std::span<const double>(want.data() + first * V, std::size_t(share * V)), T,
                                                     topo.context_rank(), cp, V);
  const double pr = relative(got, my_want);
  if (pr > 1e-12) std::printf("rank %d: predictions DIFFERENT (max relative difference %.3g)\n", rank, pr);
  else if (rank == 0) std::printf("predictions on every rank: equal (rank 0: %.3g)\n", pr);
  failures += pr > 1e-12;
  try {
    Pipeline<Stages, schedule::OneFOneB, backend::Host<double>> packed(
        {.microbatches = 2, .packed_sequences = true, .transfer_timeout_seconds = 60.0, .communicator = comm});
    std::printf("rank %d: packed sequences with a ring were NOT REFUSED\n", rank);
    ++failures;
  } catch (const error& e) {
    const bool named = std::string(e.what()).find("packed sequences with context parallelism") != std::string::npos;
    if (!named) std::printf("rank %d: FAIL, another error: %s\n", rank, e.what());
    failures += !named;
  }
  return verdict_everywhere(failures);
}

/// bf16 storage (Host<bfloat16, float>) on P stages x D replicas against one process, 3 AdamW steps.
/// With --zero each replica updates its shard of the fp32 master weights and the shards are
/// gathered; every replica must then hold all of them, and weights in use that are their rounding.
/// Bitwise with one replica; with replicas the gradient sums add in another order, and a master
/// weight that moves across a bf16 rounding boundary changes the next forward by one bf16 ulp, so
/// 1e-3 of the largest weight (a replica that missed the others' shards is off by about the
/// learning rate, 1e-2, on most of them).
template <int P>
int check_bf16(int rank) {
  using BF = cupipe::bfloat16;  // in full: OpenBLAS declares a ::bfloat16 too
  using Bf16 = backend::Host<BF, float>;
  using Stages = partition<Model, P>;
  auto comm = std::make_shared<comm::MpiCommunicator>(MPI_COMM_WORLD, P);
  const comm::Topology& topo = comm->topology();
  if (rank == 0) std::printf("%s, bf16 storage%s\n", topo.describe().c_str(), zero ? (", ZeRO-" + std::to_string(zero)).c_str() : "");
  constexpr index_t global_batch = 24;
  const index_t share = global_batch / topo.replicas;
  std::vector<BF> x(static_cast<std::size_t>(global_batch * 6));
  std::vector<std::int32_t> y(static_cast<std::size_t>(global_batch));
  Rng rng(3);
  for (BF& v : x) v = BF(float(rng.normal()));
  for (auto& v : y) v = std::int32_t(rng.below(3));
  const ConstView<BF> mine{x.data() + topo.replica() * share * 6, Shape{share, 6}};
  const ConstView<std::int32_t> mine_y{y.data() + topo.replica() * share, Shape{share}};
  Pipeline<Stages, schedule::OneFOneB, Bf16> distributed(
      {.microbatches = 2, .seed = 11, .transfer_timeout_seconds = 60.0, .communicator = comm, .zero = zero,
       .reshard_after_forward = !keep_gathered});
  Pipeline<Stages, schedule::OneFOneB, Bf16> reference({.microbatches = 2 * topo.replicas, .seed = 11});
  const optim::AdamW adamw({.lr = 1e-2, .weight_decay = 0.01, .clip_norm = 0.5});
  for (int s = 0; s < 3; ++s) {
    distributed.train_step(mine, mine_y, adamw);
    if (rank == 0)
      reference.train_step(ConstView<BF>{x.data(), Shape{global_batch, 6}}, ConstView<std::int32_t>{y.data(), Shape{global_batch}},
                           adamw);
  }
  const std::vector<float> weights = distributed.parameters();  // collective: every rank
  int failures = 0;
  if (rank == 0) {
    const std::vector<float> want = reference.parameters();
    const std::vector<double> got_d(weights.begin(), weights.end()), want_d(want.begin(), want.end());
    const double r = relative(got_d, want_d);
    const bool ok = topo.replicas == 1 ? weights == want : r <= 1e-3;
    std::printf("bf16 master weights after 3 AdamW steps: %s (max relative difference %.3g)\n", ok ? "equal" : "DIFFERENT", r);
    failures += !ok;
  }
  failures += check_zero_shards(distributed, *comm, weights.size());
  return verdict_everywhere(failures);
}

}  // namespace

int main(int argc, char** argv) {
  comm::MpiSession session(&argc, &argv);
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  std::string schedule = "1f1b";
  int stages = 0, context = 1;
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--stall")) stall = true;
    else if (!std::strcmp(argv[i], "--zero")) zero = 1;
    else if (!std::strcmp(argv[i], "--zero=2")) zero = 2;
    else if (!std::strcmp(argv[i], "--zero=3")) zero = 3;
    else if (!std::strcmp(argv[i], "--keep-gathered")) keep_gathered = true;
    else if (!std::strcmp(argv[i], "--schedule") && i + 1 < argc) schedule = argv[++i];
    else if (!std::strcmp(argv[i], "--stages") && i + 1 < argc) stages = std::atoi(argv[++i]);
    else if (!std::strcmp(argv[i], "--cp") && i + 1 < argc) context = std::atoi(argv[++i]);
    else if (!std::strcmp(argv[i], "--checkpoint") && i + 1 < argc) checkpoint = argv[++i];
  }
  return run_check([&] {
    int rc = 2;
    if (schedule == "1f1b" && stages == 4) rc = check<partition<Model, 4>, schedule::OneFOneB>(4, rank);
    else if (schedule == "1f1b" && stages == 2) rc = check<partition<Model, 2>, schedule::OneFOneB>(4, rank);
    else if (schedule == "1f1b" && stages == 1) rc = check<partition<Model, 1>, schedule::OneFOneB>(2, rank);
    else if (schedule == "interleaved" && stages == 4) rc = check<partition_for<Model, 4, schedule::Interleaved<2>>, schedule::Interleaved<2>>(4, rank);
    else if (schedule == "interleaved" && stages == 2) rc = check<partition_for<Model, 2, schedule::Interleaved<2>>, schedule::Interleaved<2>>(4, rank);
    else if (schedule == "gpipe" && stages == 4) rc = check<partition<Model, 4>, schedule::GPipe>(4, rank);
    else if (schedule == "zbv" && stages == 2) rc = check<partition_for<Model, 2, schedule::ZeroBubbleV>, schedule::ZeroBubbleV>(4, rank);
    else if (schedule == "gpt" && stages == 4) rc = check_gpt<4>(rank);
    else if (schedule == "gpt" && stages == 2) rc = check_gpt<2>(rank);
    else if (schedule == "bf16" && stages == 2) rc = check_bf16<2>(rank);
    else if (schedule == "packed" && stages == 2) rc = check_packed(rank);
    else if (schedule == "context" && stages == 2 && context > 1) rc = check_context(rank, context);
    else std::fprintf(stderr, "usage: mpi_pipeline_check --schedule 1f1b|interleaved|gpipe|zbv|gpt|bf16|packed|context --stages 1|2|4 [--cp N]\n");
    return rc;
  });
}
