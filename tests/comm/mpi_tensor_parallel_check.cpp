// SPDX-License-Identifier: Apache-2.0
// Run under mpirun: tensor parallelism over host ranks (MpiCommunicator's tensor group, float64)
// must compute what the whole model computes in one process.
//   mpi_tensor_parallel_check --tensor TP
//   mpi_tensor_parallel_check --tensor 2 --pipeline P [--zero[=2|=3]] [--checkpoint PREFIX]
// World = TP tensor-parallel ranks x D replicas (one stage). Every rank builds the whole small GPT
// (the oracle) and its part of gpt::TensorParallelModel (attention split by heads, the MLP by hidden
// width, wte, lm_head and the loss by vocabulary), sharded from the whole model's initial parameters. Each group trains on the same batch:
//   - the loss after one forward/backward, the gradients gathered back to the whole layout, and the
//     gradient's sum of squares (split tensors summed over the group, replicated ones once): 1e-12
//     relative to the whole model (the sums add the heads' partial products in another order);
//   - the weights after 3 AdamW steps, gathered: 1e-12 relative;
//   - the layers refuse to run without a tensor group, or with one of another size, and a Pipeline
//     refuses a communicator with tensor-parallel ranks, each in one sentence.
// With replicas, the groups must not mix (each group's sums stay inside it).
// --pipeline P: the tensor-parallel GPT in a Pipeline of P stages (x replicas) against the whole
// model's pipeline in one process (see check_pipeline), checkpoints included; --zero with ZeRO-1,
// each replica then holding the AdamW state of its shard only; --bf16 on Host<bfloat16, float>
// against the whole model in bf16, to bf16 accuracy (check_pipeline_bf16); --fp8 with FP8 delayed
// scaling: every weight's scale after a step is the whole weight's (check_pipeline_fp8).
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "cupipe/comm/mpi.hpp"
#include "cupipe/cupipe.hpp"
#include "cupipe/gpt/model.hpp"
#include "checkpoints_both_ways.hpp"
#include "compare.hpp"

using namespace cupipe;
using cupipe::testing::number;
using cupipe::testing::relative;
using cupipe::testing::run_check;
using cupipe::testing::verdict_everywhere;

namespace {

/// V 64, T 8, 2 blocks, 4 heads, C 16.
constexpr gpt::Config small_gpt{64, 8, 2, 4, 16};

/// A group of one rank, to show that a layer split in two refuses it.
class Solo final : public TensorGroup {
 public:
  int size() const override { return 1; }
  int rank() const override { return 0; }
  void sum(float*, std::size_t) override {}
  void sum(double*, std::size_t) override {}
};

template <int TP>
int check(comm::MpiCommunicator& comm) {
  using Whole = gpt::Model<small_gpt>;
  using Part = gpt::TensorParallelModel<small_gpt, TP>;
  using B = backend::Host<double>;
  const comm::Topology& topo = comm.topology();
  TensorGroup& group = *comm.tensor_group();
  const bool speaks = topo.replica() == 0 && group.rank() == 0;
  int failures = 0;
  auto expect = [&](const char* what, bool ok, const std::string& detail) {
    if (speaks || !ok) std::printf("rank %d: %s: %s (%s)\n", topo.rank, what, ok ? "equal" : "DIFFERENT", detail.c_str());
    failures += !ok;
  };

  // The groups are the ranks of one replica, in order.
  std::vector<double> members{double(topo.rank)};
  group.sum(members.data(), 1);
  const double first = double(topo.rank - group.rank());
  expect("the tensor group's ranks", members[0] == TP * first + TP * (TP - 1) / 2.0,
         "sum of ranks " + number(members[0]));

  Network<Whole, B> whole(21);
  Network<Part, B> part(21);
  const std::vector<ParamInfo> whole_table = Network<Whole, B>::parameter_table();
  const std::vector<ParamInfo> part_table = Network<Part, B>::parameter_table();
  std::vector<double> init = whole.parameters();
  part.set_parameters(layers::tensor_parallel::shard(whole_table, part_table, std::span<const double>(init), group.rank()));

  // Vocabulary parallelism: wte and lm_head hold this rank's rows of the vocabulary, and the loss
  // takes this rank's columns of the logits (the logits are never whole on any rank).
  int vocab_split = 0;
  for (const ParamInfo& p : part_table)
    if ((p.name.ends_with("wte.weight") || p.name.ends_with("lm_head.weight")) && p.split == TensorSplit::rows &&
        p.numel == small_gpt.vocab / TP * small_gpt.channels)
      ++vocab_split;
  constexpr index_t logits = Part::body::out_features;  // the head's output, the loss's input
  expect("wte and lm_head split by vocabulary, the loss on a part of the logits",
         vocab_split == 2 && logits == small_gpt.vocab / TP,
         std::to_string(vocab_split) + " tables split, " + std::to_string(logits) + " logits per row of " +
             std::to_string(small_gpt.vocab));

  constexpr index_t sequences = 3, rows = sequences * small_gpt.context;
  std::vector<std::int32_t> ids(static_cast<std::size_t>(rows)), next(ids.size());
  Rng rng(8);
  for (auto& v : ids) v = std::int32_t(rng.below(std::uint64_t(small_gpt.vocab)));
  for (auto& v : next) v = std::int32_t(rng.below(std::uint64_t(small_gpt.vocab)));
  const ConstView<std::int32_t> x{ids.data(), Shape{rows, 1}};
  const ConstView<std::int32_t> y{next.data(), Shape{rows}};

  // Without a group, and with a group of the wrong size, the split layers refuse.
  for (TensorGroup* wrong : {static_cast<TensorGroup*>(nullptr), static_cast<TensorGroup*>(new Solo)}) {
    part.backend().tensor_group = wrong;
    std::string message;
    try {
      part.forward_backward(x, y);
    } catch (const cupipe::error& e) {
      message = e.what();
    }
    const bool ok = message.find("tensor-parallel ranks") != std::string::npos;
    if (speaks || !ok) std::printf("rank %d: %s: %s\n", topo.rank, ok ? "refused" : "NOT REFUSED", message.c_str());
    failures += !ok;
    delete wrong;
    part.zero_grad();
  }
  part.backend().tensor_group = &group;

  const double whole_loss = whole.forward_backward(x, y);
  const double part_loss = part.forward_backward(x, y);
  whole.sum_tied_gradients();
  part.sum_tied_gradients();
  expect("loss after one forward/backward", std::abs(part_loss - whole_loss) <= 1e-12 * std::abs(whole_loss),
         number(part_loss) + " against " + number(whole_loss));
  const std::vector<double> whole_grads = whole.gradients(), part_grads = part.gradients();
  const std::vector<double> gathered = layers::tensor_parallel::unshard(whole_table, part_table, std::span<const double>(part_grads), group);
  const double r = relative(gathered, whole_grads);
  expect("gradients, gathered", r <= 1e-12, "max relative difference " + number(r));
  double whole_squares = 0;
  for (double g : whole_grads) whole_squares += g * g;
  const double part_squares = layers::tensor_parallel::sum_of_squares(part_table, std::span<const double>(part_grads), group);
  expect("the gradient's sum of squares", std::abs(part_squares - whole_squares) <= 1e-12 * whole_squares,
         number(part_squares) + " against " + number(whole_squares));

  // 3 AdamW steps, each on its own layout: the update is element-wise, so the parts step as the whole.
  const optim::AdamW adamw({.lr = 1e-2, .weight_decay = 0.1});
  auto train = [&](auto& net, std::vector<std::vector<double>>& slots, std::int64_t step, bool backward) {
    if (backward) {
      net.zero_grad();
      net.forward_backward(x, y);
      net.sum_tied_gradients();
    }
    const index_t n = index_t(net.parameters().size());
    if (slots.empty()) slots.assign(2, std::vector<double>(static_cast<std::size_t>(n), 0.0));
    const std::vector<ViewOn<B, double>> views{{slots[0].data(), Shape{n}}, {slots[1].data(), Shape{n}}};
    adamw.update(net.backend(), ViewOn<B, double>{net.parameter_data(), Shape{n}},
                 ConstViewOn<B, double>{net.gradient_data(), Shape{n}}, std::span<const ViewOn<B, double>>(views), step, 1.0);
  };
  std::vector<std::vector<double>> whole_slots, part_slots;
  for (std::int64_t step = 0; step < 3; ++step) {
    train(whole, whole_slots, step, step > 0);
    train(part, part_slots, step, step > 0);
  }
  const std::vector<double> part_weights = part.parameters();
  const std::vector<double> weights =
      layers::tensor_parallel::unshard(whole_table, part_table, std::span<const double>(part_weights), group);
  const double w = relative(weights, whole.parameters());
  expect("weights after 3 AdamW steps, gathered", w <= 1e-12, "max relative difference " + number(w));
  const TiedCopies tied = Whole::body::tied;
  expect("tied copies", std::equal(weights.begin() + tied.first, weights.begin() + tied.first + tied.count,
                                   weights.begin() + tied.second), "wte and lm_head");

  // A pipeline of the whole model over this communicator refuses its tensor-parallel ranks.
  std::string refusal;
  try {
    auto shared = std::shared_ptr<comm::Communicator>(&comm, [](comm::Communicator*) {});
    Pipeline<partition<Whole, 1>, schedule::OneFOneB, B> pipe({.microbatches = 2, .communicator = shared});
  } catch (const cupipe::error& e) {
    refusal = e.what();
  }
  const bool refused = refusal.find("split over 1 tensor-parallel rank(s), but the communicator has") != std::string::npos;
  if (speaks || !refused) std::printf("rank %d: a whole model's Pipeline with tensor-parallel ranks: %s (%s)\n", topo.rank,
                                      refused ? "refused" : "NOT REFUSED", refusal.c_str());
  failures += !refused;

  return verdict_everywhere(failures);
}

/// A pipeline check's batch: 4 sequences in all, each replica's share of them.
struct PipelineBatch {
  static constexpr index_t sequences = 4, rows = sequences * small_gpt.context;
  std::vector<std::int32_t> ids, next;
  index_t share = 0, first = 0;
  explicit PipelineBatch(const comm::Topology& topo)
      : ids(std::size_t(rows)), next(std::size_t(rows)), share(sequences / topo.replicas * small_gpt.context),
        first(topo.replica() * share) {
    Rng rng(5);
    for (auto& v : ids) v = std::int32_t(rng.below(std::uint64_t(small_gpt.vocab)));
    for (auto& v : next) v = std::int32_t(rng.below(std::uint64_t(small_gpt.vocab)));
  }
  ConstView<std::int32_t> mine() const { return {ids.data() + first, Shape{share, 1}}; }
  ConstView<std::int32_t> mine_y() const { return {next.data() + first, Shape{share}}; }
  ConstView<std::int32_t> all() const { return {ids.data(), Shape{rows, 1}}; }
  ConstView<std::int32_t> all_y() const { return {next.data(), Shape{rows}}; }
};

template <class V>
std::vector<double> widened(const std::vector<V>& v) {
  return std::vector<double>(v.begin(), v.end());
}

/// The tensor-parallel GPT in a Pipeline of P stages x D replicas x TP ranks (1F1B, AdamW with
/// clipping) against the whole model's pipeline in one process on the whole batch, every rank
/// comparing: the loss and the global gradient norm of 3 steps, the weights after them (1e-12);
/// then checkpoints both ways: this run's loads into a one-stage single process, the single
/// process's into this run.
template <int TP, int P>
int check_pipeline(std::shared_ptr<comm::MpiCommunicator> comm, const std::string& checkpoint, int zero) {
  using Whole = gpt::Model<small_gpt>;
  using Part = gpt::TensorParallelModel<small_gpt, TP>;
  using B = backend::Host<double>;
  const comm::Topology& topo = comm->topology();
  const PipelineBatch batch(topo);
  const ConstView<std::int32_t> mine = batch.mine(), mine_y = batch.mine_y(), all = batch.all(), all_y = batch.all_y();

  Pipeline<partition<Part, P>, schedule::OneFOneB, B> distributed(
      {.microbatches = 2, .seed = 4, .transfer_timeout_seconds = 60.0, .communicator = comm, .zero = zero});
  Pipeline<partition<Whole, P>, schedule::OneFOneB, B> reference({.microbatches = 2 * topo.replicas, .seed = 4});
  const optim::AdamW adamw({.lr = 1e-2, .weight_decay = 0.1, .clip_norm = 0.5});
  int failures = 0;
  const bool speaks = topo.rank == 0;
  auto expect = [&](const std::string& what, bool ok, const std::string& detail) {
    if (speaks || !ok) std::printf("rank %d: %s: %s (%s)\n", topo.rank, what.c_str(), ok ? "equal" : "DIFFERENT", detail.c_str());
    failures += !ok;
  };
  // No set_parameters: each rank draws its part of the whole model's initialisation.
  const double initial = relative(distributed.parameters(), reference.parameters());
  expect("initial parameters (each rank's part of the whole model's draws)", initial == 0, number(initial));
  for (int s = 0; s < 3; ++s) {
    const StepStats got = distributed.train_step(mine, mine_y, adamw);
    const StepStats want = reference.train_step(all, all_y, adamw);
    expect("step " + std::to_string(s) + " loss", std::abs(got.loss - want.loss) <= 1e-12 * want.loss,
           number(got.loss) + " against " + number(want.loss));
    expect("step " + std::to_string(s) + " gradient norm (clipped at 0.5)",
           std::abs(got.grad_norm - want.grad_norm) <= 1e-12 * want.grad_norm,
           number(got.grad_norm) + " against " + number(want.grad_norm));
  }
  const std::vector<double> weights = distributed.parameters(), want = reference.parameters();
  const double r = relative(weights, want);
  expect("weights after 3 AdamW steps", r <= 1e-12, "max relative difference " + number(r));
  const TiedCopies tied = Whole::body::tied;
  expect("tied copies", std::equal(weights.begin() + tied.first, weights.begin() + tied.first + tied.count,
                                   weights.begin() + tied.second), "wte and lm_head");
  const std::vector<double> exp_avg_sq = distributed.optimizer_state(1);
  const double m = relative(exp_avg_sq, reference.optimizer_state(1));
  expect("AdamW's exp_avg_sq, gathered", m <= 1e-12, "max relative difference " + number(m));
  // ZeRO-1: this rank holds the AdamW state of its shard of its part; a stage's replicas together
  // hold the part's state once. ZeRO-2: the same of the gradients, between steps; ZeRO-3: and of
  // the weights.
  const auto sharded = [&](MemoryTag tag, int arrays, const std::string& what) {
    const double mine = double(distributed.backend(topo.stage()).memory.in_use(tag));
    std::vector<double> stage{mine};
    comm->sum_over_replicas(stage.data(), 1);
    const bool ok = mine < stage[0] && mine <= stage[0] / topo.replicas + arrays * 8.0;
    expect(what + " sharded over " + std::to_string(topo.replicas) + " replicas", ok,
           number(mine) + " bytes here, " + number(stage[0]) + " over the stage's replicas");
  };
  if (zero >= 1) sharded(MemoryTag::optimizer, 2, "AdamW state");
  if (zero >= 2) sharded(MemoryTag::gradients, 1, "gradients");
  if (zero >= 3) sharded(MemoryTag::weights, 1, "weights");

  if (!checkpoint.empty())
    cupipe::testing::check_checkpoints_both_ways<Whole, Pipeline<partition<Part, P>, schedule::OneFOneB, B>>(
        checkpoint, distributed, reference, adamw,
        {.microbatches = 2, .seed = 9, .transfer_timeout_seconds = 60.0, .communicator = comm}, topo.rank, expect);
  return verdict_everywhere(failures);
}

/// --bf16: the same layout on Host<bfloat16, float> (tensor_group_sum widens each rank's bf16
/// partial result to fp32, sums, and rounds once; the vocabulary-parallel loss exchanges fp32
/// statistics) against the whole model's bf16 pipeline in one process. The whole model rounds each
/// GEMM's whole sum once where the split one rounds each part first, so they agree to bf16 accuracy,
/// not bitwise:
///   - one forward/backward: the loss within 1e-4 and the gradients within 2e-2 (max difference
///     relative to the largest);
///   - 3 AdamW steps: each loss within 1e-3 and gradient norm within 2e-2, or within twice the
///     bf16 whole run's own distance from the float64 whole run where that is larger (by the third
///     step its rounding has moved its gradient norm by about 1%), and the tied copies equal. The
///     float64 split run is held to the float64 whole run within 1e-6 at every step: the split's
///     arithmetic, apart from any rounding.
/// (AdamW moves a weight whose gradient is near zero by up to lr whatever its sign, so the weights
/// after the steps differ by up to 3 lr between any two roundings, float64 included: not compared.)
/// The float64 tensor-parallel run's distances from the bf16 whole model are printed beside them.
/// With `zero` (TP 2 x DP 2): the trained pipeline shards its AdamW state over the replicas, which
/// gather the updated fp32 master weights: the weights equal the same run without ZeRO-1 to 1e-6.
template <int TP, int P>
int check_pipeline_bf16(std::shared_ptr<comm::MpiCommunicator> comm, bool zero) {
  using Whole = gpt::Model<small_gpt>;
  using Part = gpt::TensorParallelModel<small_gpt, TP>;
  using Bf16 = backend::Host<cupipe::bfloat16, float>;  // in full: OpenBLAS declares a ::bfloat16 too
  using Double = backend::Host<double>;
  const comm::Topology& topo = comm->topology();
  const PipelineBatch batch(topo);
  const PipelineOptions split{.microbatches = 2, .seed = 4, .transfer_timeout_seconds = 60.0, .communicator = comm};
  const PipelineOptions one{.microbatches = 2 * topo.replicas, .seed = 4};
  int failures = 0;
  const bool speaks = topo.rank == 0;
  auto expect = [&](const std::string& what, double got, double bound, const std::string& detail) {
    const bool ok = got <= bound;
    if (speaks || !ok)
      std::printf("rank %d: %s: %s (%s relative, bound %s; %s)\n", topo.rank, what.c_str(), ok ? "close" : "DIFFERENT",
                  number(got).c_str(), number(bound).c_str(), detail.c_str());
    failures += !ok;
  };
  {
    Pipeline<partition<Part, P>, schedule::OneFOneB, Bf16> distributed(split);
    Pipeline<partition<Whole, P>, schedule::OneFOneB, Bf16> reference(one);
    Pipeline<partition<Part, P>, schedule::OneFOneB, Double> exact(split);
    expect("bf16: initial fp32 master weights", relative(widened(distributed.parameters()), widened(reference.parameters())),
           0.0, "each rank's part of the whole model's draws");
    const StepStats got = distributed.forward_backward(batch.mine(), batch.mine_y());
    const StepStats want = reference.forward_backward(batch.all(), batch.all_y());
    const StepStats wide = exact.forward_backward(batch.mine(), batch.mine_y());
    const std::vector<double> grads = widened(distributed.gradients()), want_grads = widened(reference.gradients());
    const std::vector<double> exact_grads = exact.gradients();
    expect("bf16: loss of one forward/backward", std::abs(got.loss - want.loss) / want.loss, 1e-4,
           number(got.loss) + " against " + number(want.loss) + "; float64 " + number(wide.loss));
    expect("bf16: gradients, gathered", relative(grads, want_grads), 2e-2,
           "float64's " + number(relative(exact_grads, want_grads)) + " from the bf16 whole model's");
  }
  PipelineOptions sharded = split;
  sharded.zero = zero;
  Pipeline<partition<Part, P>, schedule::OneFOneB, Bf16> distributed(sharded);
  Pipeline<partition<Whole, P>, schedule::OneFOneB, Bf16> reference(one);
  Pipeline<partition<Part, P>, schedule::OneFOneB, Bf16> unsharded(split);
  Pipeline<partition<Part, P>, schedule::OneFOneB, Double> exact_split(split);
  Pipeline<partition<Whole, P>, schedule::OneFOneB, Double> exact_whole(one);
  const optim::AdamW adamw({.lr = 1e-2, .weight_decay = 0.1, .clip_norm = 0.5});
  for (int s = 0; s < 3; ++s) {
    const StepStats got = distributed.train_step(batch.mine(), batch.mine_y(), adamw);
    const StepStats want = reference.train_step(batch.all(), batch.all_y(), adamw);
    const StepStats split_wide = exact_split.train_step(batch.mine(), batch.mine_y(), adamw);
    const StepStats whole_wide = exact_whole.train_step(batch.all(), batch.all_y(), adamw);
    if (zero) (void)unsharded.train_step(batch.mine(), batch.mine_y(), adamw);
    const std::string step = "step " + std::to_string(s);
    expect("float64: " + step + " loss and gradient norm, split against whole",
           std::max(std::abs(split_wide.loss - whole_wide.loss) / whole_wide.loss,
                    std::abs(split_wide.grad_norm - whole_wide.grad_norm) / whole_wide.grad_norm),
           1e-6, number(split_wide.grad_norm) + " against " + number(whole_wide.grad_norm));
    // How far the bf16 whole run's own rounding has taken it from the exact one.
    const double own_loss = std::abs(whole_wide.loss - want.loss) / want.loss;
    const double own_norm = std::abs(whole_wide.grad_norm - want.grad_norm) / want.grad_norm;
    expect("bf16: " + step + " loss", std::abs(got.loss - want.loss) / want.loss, std::max(1e-3, 2 * own_loss),
           number(got.loss) + " against " + number(want.loss) + "; the bf16 whole run is " + number(own_loss) +
               " from float64's");
    expect("bf16: " + step + " gradient norm", std::abs(got.grad_norm - want.grad_norm) / want.grad_norm,
           std::max(2e-2, 2 * own_norm),
           number(got.grad_norm) + " against " + number(want.grad_norm) + "; the bf16 whole run is " + number(own_norm) +
               " from float64's");
  }
  const std::vector<float> weights = distributed.parameters();
  const TiedCopies tied = Whole::body::tied;
  const bool same = std::equal(weights.begin() + tied.first, weights.begin() + tied.first + tied.count, weights.begin() + tied.second);
  expect("bf16: tied copies after 3 steps (wte and lm_head)", same ? 0.0 : 1.0, 0.0, "equal master weights");
  if (zero) {
    expect("bf16 with ZeRO-1: weights against the same run without it",
           relative(widened(weights), widened(unsharded.parameters())), 1e-6, "fp32 master weights, gathered");
    const double mine = double(distributed.backend(topo.stage()).memory.in_use(MemoryTag::optimizer));
    const double whole = double(unsharded.backend(topo.stage()).memory.in_use(MemoryTag::optimizer));
    expect("bf16 with ZeRO-1: this rank's AdamW bytes over the unsharded run's", mine / whole, 0.5 + 64.0 / whole,
           number(mine) + " of " + number(whole) + " bytes, about 1/" + std::to_string(topo.replicas));
  }
  return verdict_everywhere(failures);
}

/// --fp8: the tensor-parallel GPT in FP8 with delayed scaling (backend::HostFp8<fp8::PerTensorDelayed>)
/// against the whole model's pipeline in one process, one step each. Each rank holds a part of every
/// split weight, whose amax alone is its part's; the step's amaxes are taken over the tensor-parallel
/// group at the update (backend::end_step), so every weight's recorded scale (its forward GEMM's
/// operand B) must be the whole weight's, bit for bit, on every rank (the weights are the same values
/// in both runs before the update). Then the loss: FP8 accuracy.
template <int TP, int P>
int check_pipeline_fp8(std::shared_ptr<comm::MpiCommunicator> comm) {
  using Whole = gpt::Model<small_gpt>;
  using Part = gpt::TensorParallelModel<small_gpt, TP>;
  using Fp8 = backend::HostFp8<fp8::PerTensorDelayed>;
  const comm::Topology& topo = comm->topology();
  const PipelineBatch batch(topo);
  const PipelineOptions split{.microbatches = 2, .seed = 4, .transfer_timeout_seconds = 60.0, .communicator = comm};
  const PipelineOptions one{.microbatches = 2 * topo.replicas, .seed = 4};
  Pipeline<partition<Part, P>, schedule::OneFOneB, Fp8> distributed(split);
  Pipeline<partition<Whole, P>, schedule::OneFOneB, Fp8> reference(one);
  const optim::AdamW adamw({.lr = 1e-2});
  const StepStats got = distributed.train_step(batch.mine(), batch.mine_y(), adamw);
  const StepStats want = reference.train_step(batch.all(), batch.all_y(), adamw);
  int failures = 0;
  const fp8::DelayedScales& mine = distributed.backend(topo.stage()).fp8.scales();
  const fp8::DelayedScales& whole = reference.backend(topo.stage()).fp8.scales();
  int weights = 0, same = 0;
  if (mine.size() == whole.size()) {
    for (std::size_t e = 0; e < mine.size(); ++e) {
      if (mine.role(e) != fp8::GemmRole::forward || whole.role(e) != fp8::GemmRole::forward) continue;
      ++weights;
      same += mine.scale(e, fp8::Operand::b) == whole.scale(e, fp8::Operand::b);
    }
  }
  const bool scales_ok = mine.size() == whole.size() && weights > 0 && same == weights;
  std::printf("rank %d: fp8 delayed: stage %d's weight scales after one step: %s (%d of %d weights' scales the whole "
              "weight's; %zu GEMMs against %zu)\n",
              topo.rank, topo.stage(), scales_ok ? "equal" : "DIFFERENT", same, weights, mine.size(), whole.size());
  failures += !scales_ok;
  const double loss = std::abs(got.loss - want.loss) / want.loss;
  const bool loss_ok = loss <= 1e-2;
  if (topo.rank == 0 || !loss_ok)
    std::printf("rank %d: fp8 delayed: loss of one step: %s (%s against %s, %s relative, bound 1e-2)\n", topo.rank,
                loss_ok ? "close" : "DIFFERENT", number(got.loss).c_str(), number(want.loss).c_str(), number(loss).c_str());
  failures += !loss_ok;
  return verdict_everywhere(failures);
}

}  // namespace

int main(int argc, char** argv) {
  comm::MpiSession session(&argc, &argv);
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  int tensor = 0, stages = 0;
  bool bf16 = false, fp8 = false;
  int zero = 0;
  std::string checkpoint;
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--tensor") && i + 1 < argc) tensor = std::atoi(argv[++i]);
    else if (!std::strcmp(argv[i], "--pipeline") && i + 1 < argc) stages = std::atoi(argv[++i]);
    else if (!std::strcmp(argv[i], "--checkpoint") && i + 1 < argc) checkpoint = argv[++i];
    else if (!std::strcmp(argv[i], "--zero")) zero = 1;
    else if (!std::strcmp(argv[i], "--zero=2")) zero = 2;
    else if (!std::strcmp(argv[i], "--zero=3")) zero = 3;
    else if (!std::strcmp(argv[i], "--bf16")) bf16 = true;
    else if (!std::strcmp(argv[i], "--fp8")) fp8 = true;
  }
  return run_check([&] {
    int rc = 2;
    if (stages > 0 && tensor == 2 && (stages == 1 || stages == 2)) {
      auto comm = std::make_shared<comm::MpiCommunicator>(MPI_COMM_WORLD, stages, 60, tensor);
      if (rank == 0) std::printf("%s\n", comm->topology().describe().c_str());
      if (fp8 && stages == 2) rc = check_pipeline_fp8<2, 2>(comm);
      else if (bf16) rc = stages == 1 ? check_pipeline_bf16<2, 1>(comm, zero) : check_pipeline_bf16<2, 2>(comm, zero);
      else rc = stages == 1 ? check_pipeline<2, 1>(comm, checkpoint, zero) : check_pipeline<2, 2>(comm, checkpoint, zero);
    } else if (stages == 0 && (tensor == 2 || tensor == 4)) {
      comm::MpiCommunicator comm(MPI_COMM_WORLD, 1, 60, tensor);
      if (rank == 0) std::printf("%s\n", comm.topology().describe().c_str());
      rc = tensor == 2 ? check<2>(comm) : check<4>(comm);
    } else {
      std::fprintf(stderr, "usage: mpi_tensor_parallel_check --tensor 2|4 | --tensor 2 --pipeline 1|2 [--zero[=2]] [--checkpoint PREFIX] [--bf16] | --tensor 2 --pipeline 2 --fp8\n");
    }
    return rc;
  });
}
