// SPDX-License-Identifier: Apache-2.0
// Run under mpirun: expert parallelism over host ranks (MpiCommunicator's expert-parallel groups,
// float64) must train what the whole mixture-of-experts model trains in one process.
//   mpi_expert_parallel_check --experts EP --pipeline P [--dropless] [--checkpoint PREFIX]
// World = P stages x D replicas, the replicas of a stage in groups of EP (D a multiple of EP). Every
// rank runs its part of gpt::ExpertParallelModel (each MoE block holding E / EP of its experts) in a
// 1F1B Pipeline (AdamW with clipping) on its replica's share of a batch, against the whole model's
// pipeline in one process on the whole batch (check_pipeline):
//   - the initial parameters (each rank's part of the whole model's draws): equal;
//   - the loss and the global gradient norm of 3 steps, and the weights and AdamW's exp_avg_sq after
//     them, gathered to the whole layout: 1e-12 relative (an expert sums its tokens' gradients in
//     another order);
//   - with replicas beyond one group (D > EP), the experts' gradients sum over the replicas that hold
//     them, the rest over all;
//   - with --checkpoint, checkpoints both ways: this run's loads into one process, and one process's
//     into this layout.
// With 2 stages and a capacity, DualPipeV's overlapped pairs train the same, taking turns at their
// all-to-alls or back to back, bitwise (check_dualpipe).
// Then the layer's exchange refuses ranks whose microbatches differ, every rank naming the two ranks
// (check_mismatch), and (EP 2 x PP 2) a Pipeline refuses ZeRO and a whole model under
// expert-parallel groups.
// The model: V 64, T 16, 2 blocks, 4 heads, C 16, both MLPs 4 experts of top-2, with a capacity of
// 1.0 that drops (or --dropless); DualPipeV's has 4 such blocks.
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

// {vocab, context, layers, heads, channels, tied, experts, top_k, moe_every, capacity_factor}
constexpr gpt::Config capacity_gpt{64, 16, 2, 4, 16, true, 4, 2, 1, 1.0};
constexpr gpt::Config dropless_gpt{64, 16, 2, 4, 16, true, 4, 2, 1, 0.0};
// DualPipeV's: 4 blocks, so that each of a worker's two chunks holds MoE blocks and a pair's two
// actions both send tokens (with 2 blocks every pair has one chunk without experts).
constexpr gpt::Config dual_gpt{64, 16, 4, 4, 16, true, 4, 2, 1, 1.0};

/// 8 sequences in all, each replica's share of them.
struct Batch {
  static constexpr index_t sequences = 8;
  index_t rows, share, first;
  std::vector<std::int32_t> ids, next;
  Batch(const comm::Topology& topo, index_t T)
      : rows(sequences * T), share(sequences / topo.replicas * T), first(topo.replica() * share),
        ids(std::size_t(rows)), next(std::size_t(rows)) {
    Rng rng(5);
    for (auto& v : ids) v = std::int32_t(rng.below(64));
    for (auto& v : next) v = std::int32_t(rng.below(64));
  }
  ConstView<std::int32_t> mine() const { return {ids.data() + first, Shape{share, 1}}; }
  ConstView<std::int32_t> mine_y() const { return {next.data() + first, Shape{share}}; }
  ConstView<std::int32_t> all() const { return {ids.data(), Shape{rows, 1}}; }
  ConstView<std::int32_t> all_y() const { return {next.data(), Shape{rows}}; }
};

struct Expect {
  const comm::Topology& topo;
  int failures = 0;
  void operator()(const std::string& what, bool ok, const std::string& detail) {
    if (topo.rank == 0 || !ok) std::printf("rank %d: %s: %s (%s)\n", topo.rank, what.c_str(), ok ? "equal" : "DIFFERENT", detail.c_str());
    failures += !ok;
  }
};

template <gpt::Config config, int EP, int P>
int check_pipeline(std::shared_ptr<comm::MpiCommunicator> comm, const std::string& checkpoint) {
  using Whole = gpt::Model<config>;
  using Part = gpt::ExpertParallelModel<config, EP>;
  using B = backend::Host<double>;
  const comm::Topology& topo = comm->topology();
  const Batch batch(topo, config.context);
  Expect expect{topo};

  Pipeline<partition<Part, P>, schedule::OneFOneB, B> distributed(
      {.microbatches = 2, .seed = 4, .transfer_timeout_seconds = 60.0, .communicator = comm});
  Pipeline<partition<Whole, P>, schedule::OneFOneB, B> reference({.microbatches = 2 * topo.replicas, .seed = 4});
  std::array<moe::Tally, P> tallies;
  for (int w = 0; w < P; ++w)
    if (w == topo.stage()) distributed.backend(w).moe_tally = &tallies[std::size_t(w)];
  const optim::AdamW adamw({.lr = 1e-2, .weight_decay = 0.1, .clip_norm = 0.5});
  const double initial = relative(distributed.parameters(), reference.parameters());
  expect("initial parameters (each rank's part of the whole model's draws)", initial == 0, number(initial));
  for (int s = 0; s < 3; ++s) {
    const StepStats got = distributed.train_step(batch.mine(), batch.mine_y(), adamw);
    const StepStats want = reference.train_step(batch.all(), batch.all_y(), adamw);
    expect("step " + std::to_string(s) + " loss", std::abs(got.loss - want.loss) <= 1e-12 * want.loss,
           number(got.loss) + " against " + number(want.loss));
    expect("step " + std::to_string(s) + " gradient norm (clipped at 0.5)",
           std::abs(got.grad_norm - want.grad_norm) <= 1e-12 * want.grad_norm,
           number(got.grad_norm) + " against " + number(want.grad_norm));
  }
  const std::vector<double> weights = distributed.parameters(), want = reference.parameters();
  const double r = relative(weights, want);
  expect("weights after 3 AdamW steps", r <= 1e-12, "max relative difference " + number(r));
  const std::vector<double> exp_avg_sq = distributed.optimizer_state(1);
  const double m = relative(exp_avg_sq, reference.optimizer_state(1));
  expect("AdamW's exp_avg_sq, gathered", m <= 1e-12, "max relative difference " + number(m));
  // The slots this rank's tokens sent, over every rank, are the whole batch's: 3 steps x 2 layers x
  // the batch's tokens x top-2.
  std::vector<double> routed{double(tallies[std::size_t(topo.stage())].routed),
                             double(tallies[std::size_t(topo.stage())].dropped)};
  comm->sum_over_world(routed.data(), routed.size());
  expect("slots routed over every rank", routed[0] == 3.0 * 2 * double(batch.rows) * 2,
         number(routed[0]) + " routed, " + number(routed[1]) + " dropped");
  if (config.capacity_factor > 0) expect("the capacity drops slots", routed[1] > 0, number(routed[1]));

  if (!checkpoint.empty())
    cupipe::testing::check_checkpoints_both_ways<Whole, Pipeline<partition<Part, P>, schedule::OneFOneB, B>>(
        checkpoint, distributed, reference, adamw,
        {.microbatches = 2, .seed = 9, .transfer_timeout_seconds = 60.0, .communicator = comm}, topo.rank, expect);
  return expect.failures;
}

/// DualPipeV (2 stages, 4 virtual stages, overlapped F&B pairs) with experts split over EP ranks,
/// against the whole model's 1F1B in one process: the losses of 3 steps and the weights after them,
/// 1e-12. Its pairs take turns (pipeline/paired_turns.hpp: the F on a second thread, each action
/// computing while the other's all-to-all is in flight: PipelineOptions::paired_turns); without, they
/// run back to back, and the losses and weights must be the same bitwise. The tallies show the
/// turns: with them, some of every rank's all-to-alls ran beside the partner; without, none.
template <gpt::Config config, int EP>
int check_dualpipe(std::shared_ptr<comm::MpiCommunicator> comm) {
  using B = backend::Host<double>;
  using Part = gpt::ExpertParallelModel<config, EP>;
  using Dual = Pipeline<partition_for<Part, 2, schedule::DualPipeV>, schedule::DualPipeV, B>;
  const comm::Topology& topo = comm->topology();
  const Batch batch(topo, config.context);
  Expect expect{topo};
  Dual dual({.microbatches = 4, .seed = 4, .transfer_timeout_seconds = 60.0, .communicator = comm, .paired_turns = true});
  Dual back_to_back({.microbatches = 4, .seed = 4, .transfer_timeout_seconds = 60.0, .communicator = comm});
  Pipeline<partition<gpt::Model<config>, 2>, schedule::OneFOneB, B> reference({.microbatches = 4 * topo.replicas, .seed = 4});
  moe::Tally turns, plain;
  dual.backend(topo.stage()).moe_tally = &turns;
  back_to_back.backend(topo.stage()).moe_tally = &plain;
  const optim::AdamW adamw({.lr = 1e-2, .weight_decay = 0.1, .clip_norm = 0.5});
  for (int s = 0; s < 3; ++s) {
    const double got = dual.train_step(batch.mine(), batch.mine_y(), adamw).loss;
    const double unpaired = back_to_back.train_step(batch.mine(), batch.mine_y(), adamw).loss;
    const double want = reference.train_step(batch.all(), batch.all_y(), adamw).loss;
    expect("DualPipeV step " + std::to_string(s) + " loss", std::abs(got - want) <= 1e-12 * want,
           number(got) + " against 1F1B in one process " + number(want));
    expect("DualPipeV step " + std::to_string(s) + " loss, pairs taking turns against back to back", got == unpaired,
           number(got) + " against " + number(unpaired));
  }
  const std::vector<double> weights = dual.parameters();
  const double r = relative(weights, reference.parameters());
  expect("DualPipeV's weights after 3 AdamW steps", r <= 1e-12, "max relative difference " + number(r));
  expect("DualPipeV's weights, pairs taking turns against back to back, bitwise", weights == back_to_back.parameters(),
         "max relative difference " + number(relative(weights, back_to_back.parameters())));
  const std::string counts = std::to_string(turns.all_to_alls_beside_partner) + " of " + std::to_string(turns.all_to_alls) +
                             " taking turns, " + std::to_string(plain.all_to_alls_beside_partner) + " of " +
                             std::to_string(plain.all_to_alls) + " back to back";
  expect("all-to-alls that ran while the paired action computed", turns.all_to_alls_beside_partner > 0 &&
         turns.all_to_alls == plain.all_to_alls && plain.all_to_alls_beside_partner == 0, counts);
  if (topo.rank == 0)
    std::printf("rank 0: all-to-all time a step, in flight / exposed: %.2f / %.2f ms taking turns, %.2f / %.2f ms back to back\n",
                turns.all_to_all_seconds / 3 * 1e3, turns.exposed_all_to_all_seconds / 3 * 1e3,
                plain.all_to_all_seconds / 3 * 1e3, plain.exposed_all_to_all_seconds / 3 * 1e3);
  return expect.failures;
}

/// The layer on its own: the ranks of a group run microbatches of different sizes (rank 0 two
/// sequences, the others one), and every rank refuses in the counts' exchange, naming two ranks.
template <int EP>
int check_mismatch(comm::MpiCommunicator& comm) {
  using L = MixtureOfExperts<16, 64, 16, gpt::routing_of<capacity_gpt>, EP>;
  Expect expect{comm.topology()};
  backend::Host<double> be;
  be.expert_group = comm.expert_group();
  const index_t n = (be.expert_group->rank() == 0 ? 2 : 1) * 16;
  index_t count = 0;
  for (const ParamSpec& spec : L::params(16)) count += spec.numel();
  std::vector<double> p(std::size_t(count), 0.01), x(std::size_t(n * 16), 0.5), y(x.size()),
      saved(std::size_t(n * L::saved_per_row(16)));
  std::string error;
  try {
    L::forward(be, p.data(), ConstView<double>{x.data(), Shape{n, 16}}, TensorView<double>{y.data(), Shape{n, 16}},
               TensorView<double>{saved.data(), Shape{n, L::saved_per_row(16)}});
  } catch (const std::exception& e) {
    error = e.what();
  }
  const bool named = error.find("rows in the microbatch") != std::string::npos && error.find("but rank") != std::string::npos;
  expect("microbatches of different sizes refused on every rank, naming the ranks", named, error);
  return expect.failures;
}

/// A Pipeline refuses ZeRO under expert parallelism, and a whole model (experts not split) under a
/// communicator with expert-parallel groups.
template <int EP, int P>
int check_refusals(std::shared_ptr<comm::MpiCommunicator> comm) {
  Expect expect{comm->topology()};
  using B = backend::Host<double>;
  const auto refusal = [&](auto make) {
    try {
      make();
    } catch (const std::exception& e) {
      return std::string(e.what());
    }
    return std::string();
  };
  const std::string zero = refusal([&] {
    Pipeline<partition<gpt::ExpertParallelModel<capacity_gpt, EP>, P>, schedule::GPipe, B> p(
        {.microbatches = 2, .communicator = comm, .zero = 1});
  });
  expect("ZeRO refused under expert parallelism", zero.find("leave zero off") != std::string::npos, zero);
  const std::string whole = refusal([&] {
    Pipeline<partition<gpt::Model<capacity_gpt>, P>, schedule::GPipe, B> p({.microbatches = 2, .communicator = comm});
  });
  expect("a whole model refused under expert-parallel groups", whole.find("ExpertParallelModel") != std::string::npos, whole);
  return expect.failures;
}

}  // namespace

int main(int argc, char** argv) {
  const comm::MpiSession mpi(&argc, &argv);
  int experts = 0, stages = 1;
  bool dropless = false;
  std::string checkpoint;
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--experts") && i + 1 < argc) experts = std::atoi(argv[++i]);
    else if (!std::strcmp(argv[i], "--pipeline") && i + 1 < argc) stages = std::atoi(argv[++i]);
    else if (!std::strcmp(argv[i], "--dropless")) dropless = true;
    else if (!std::strcmp(argv[i], "--checkpoint") && i + 1 < argc) checkpoint = argv[++i];
  }
  return run_check([&] {
    auto comm = std::make_shared<comm::MpiCommunicator>(MPI_COMM_WORLD, stages, 60.0, 1, comm::RankOrder::stages_outermost,
                                                        1, experts);
    if (comm->topology().rank == 0) std::printf("%s\n", comm->topology().describe().c_str());
    int failures = 0;
    // The layouts the tests run, each instantiated once (EP 2 x PP 2 with a capacity also under
    // DualPipeV, and with the Pipeline's refusals; EP 2 x DP 4; EP 4 x PP 2 dropless).
    if (experts == 2 && stages == 2 && !dropless)
      failures += check_pipeline<capacity_gpt, 2, 2>(comm, checkpoint) + check_dualpipe<dual_gpt, 2>(comm) +
                  check_mismatch<2>(*comm) + check_refusals<2, 2>(comm);
    else if (experts == 2 && stages == 1 && !dropless)
      failures += check_pipeline<capacity_gpt, 2, 1>(comm, checkpoint) + check_mismatch<2>(*comm);
    else if (experts == 4 && stages == 2 && dropless)
      failures += check_pipeline<dropless_gpt, 4, 2>(comm, checkpoint) + check_mismatch<4>(*comm);
    else {
      std::fprintf(stderr, "usage: mpi_expert_parallel_check --experts 2 --pipeline 1|2 [--checkpoint PREFIX], or "
                           "--experts 4 --pipeline 2 --dropless\n");
      return 2;
    }
    return verdict_everywhere(failures);
  });
}
