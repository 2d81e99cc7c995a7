// SPDX-License-Identifier: Apache-2.0
// Context parallelism's step, measured (docs/benchmarks.md): the tiny GPT's shape (V 256, 4 blocks,
// 4 heads, C 128) at T 256 or 1024, one stage, trained by rings of cp = 1, 2 or 4 MPI ranks on the
// host backend (fp32, one BLAS thread a rank). Prints the median step time of --steps steps after
// one warm-up, the step's time in the ring's attention hand-overs is not separated (a host ring
// computes while MPI moves), and each rank's measured peak memory and activation peak.
//
//   mpirun -np 2 build/host/bench/context_parallel/cp_step --cp 2 --context 1024 [--batch 4] [--steps 5]
//
// Never part of ctest (it measures). On a machine with fewer cores than ranks the ranks share cores,
// so the step time there says what the ring costs, not what it saves; the memory per rank is the
// figure context parallelism exists for.
#include <mpi.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "cupipe/comm/mpi.hpp"
#include "cupipe/cp/context_group.hpp"
#include "cupipe/cupipe.hpp"
#include "cupipe/gpt/model.hpp"

using namespace cupipe;

namespace {

constexpr gpt::Config at_256{256, 256, 4, 4, 128};
constexpr gpt::Config at_1024{256, 1024, 4, 4, 128};

template <gpt::Config config>
int run(int cp, index_t batch, int steps) {
  using Gpt = gpt::Model<config>;
  using Stages = partition<Gpt, 1>;
  constexpr index_t T = config.context;
  auto comm = std::make_shared<comm::MpiCommunicator>(MPI_COMM_WORLD, 1, 120.0, 1, comm::RankOrder::stages_outermost, cp);
  const comm::Topology& topo = comm->topology();
  if (topo.replicas != cp) {
    if (topo.rank == 0) std::fprintf(stderr, "cp_step: run it with mpirun -np %d (one ring, one stage)\n", cp);
    return 2;
  }
  backend::Host<float>::set_blas_threads(1);
  std::vector<std::int32_t> ids(std::size_t(batch * T)), next(ids.size());
  Rng rng(1);
  for (auto& v : ids) v = std::int32_t(rng.below(std::uint64_t(config.vocab)));
  for (auto& v : next) v = std::int32_t(rng.below(std::uint64_t(config.vocab)));
  const std::vector<std::int32_t> x = cp::local_rows(std::span<const std::int32_t>(ids), T, topo.context_rank(), cp);
  const std::vector<std::int32_t> y = cp::local_rows(std::span<const std::int32_t>(next), T, topo.context_rank(), cp);
  const index_t n = index_t(x.size());
  Pipeline<Stages, schedule::OneFOneB, backend::Host<float>> pipe(
      {.microbatches = 1, .seed = 1, .transfer_timeout_seconds = 120.0, .communicator = comm});
  const optim::AdamW adamw({.lr = 1e-3});
  std::vector<double> seconds;
  StepStats last;
  for (int s = 0; s <= steps; ++s) {
    MPI_Barrier(MPI_COMM_WORLD);
    const auto t0 = std::chrono::steady_clock::now();
    last = pipe.train_step(ConstView<std::int32_t>{x.data(), Shape{n, 1}}, ConstView<std::int32_t>{y.data(), Shape{n}}, adamw);
    MPI_Barrier(MPI_COMM_WORLD);
    if (s > 0) seconds.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  std::sort(seconds.begin(), seconds.end());
  const double median = seconds[seconds.size() / 2];
  const double peak = double(pipe.backend(0).memory.peak());
  const double activations = last.peak_activation_bytes.empty() ? 0.0 : double(last.peak_activation_bytes[0]);
  std::vector<double> per_rank(std::size_t(2 * cp), 0.0);
  per_rank[std::size_t(2 * topo.rank)] = peak;
  per_rank[std::size_t(2 * topo.rank + 1)] = activations;
  comm->sum_over_world(per_rank.data(), per_rank.size());
  if (topo.rank == 0) {
    std::printf("T %lld, batch %lld sequences (%lld tokens), cp %d: step %.1f ms (median of %d), loss %.4f, %.0f tokens/s\n",
                (long long)T, (long long)batch, (long long)(batch * T), cp, median * 1e3, steps, last.loss,
                double(batch * T) / median);
    for (int r = 0; r < cp; ++r)
      std::printf("  rank %d: %lld tokens, peak %.1f MiB, activation peak %.1f MiB\n", r, (long long)n,
                  per_rank[std::size_t(2 * r)] / 1048576.0, per_rank[std::size_t(2 * r + 1)] / 1048576.0);
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  comm::MpiSession session(&argc, &argv);
  int cp = 1, steps = 5;
  index_t context = 256, batch = 4;
  for (int i = 1; i + 1 < argc; i += 2) {
    if (!std::strcmp(argv[i], "--cp")) cp = std::atoi(argv[i + 1]);
    else if (!std::strcmp(argv[i], "--context")) context = std::atoll(argv[i + 1]);
    else if (!std::strcmp(argv[i], "--batch")) batch = std::atoll(argv[i + 1]);
    else if (!std::strcmp(argv[i], "--steps")) steps = std::atoi(argv[i + 1]);
  }
  try {
    if (cp < 1 || steps < 1 || batch < 1 || (context != 256 && context != 1024))
      CUPIPE_THROW("usage: cp_step --cp N --context 256|1024 [--batch B] [--steps S]");
    return context == 256 ? run<at_256>(cp, batch, steps) : run<at_1024>(cp, batch, steps);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "cp_step: %s\n", e.what());
    MPI_Abort(MPI_COMM_WORLD, 1);
    return 1;
  }
}
