// SPDX-License-Identifier: Apache-2.0
// Run under mpirun with 8 processes: checkpoints reshard between parallel layouts.
//   mpi_reshard_check --checkpoint PREFIX
// Layouts (data-parallel replicas, tensor-parallel ranks, pipeline stages): (1,1,1), (2,1,1), (1,2,1),
// (1,1,2) and (2,2,2), each on the first DP x TP x PP ranks of the world. Each trains the small GPT
// (float64, 1F1B, AdamW with clipping) for 2 steps from the whole model's initialisation on the
// same global batches and saves a checkpoint (weights, AdamW state, update count and data position).
// Then every layout loads every other layout's checkpoint, takes the next step on the batch the
// checkpoint's data position names, and must match one process that trained 3 steps straight:
// the step's loss and the weights after it to 1e-12 relative, the update count and data position
// exactly.
#include <cmath>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "cupipe/comm/mpi.hpp"
#include "cupipe/cupipe.hpp"
#include "cupipe/gpt/model.hpp"
#include "compare.hpp"

using namespace cupipe;
using cupipe::testing::number;
using cupipe::testing::relative;
using cupipe::testing::run_check;
using cupipe::testing::verdict_everywhere;

namespace {

/// V 64, T 8, 2 blocks, 4 heads, C 16.
constexpr gpt::Config small_gpt{64, 8, 2, 4, 16};
constexpr index_t sequences = 4;  ///< per global batch
using B = backend::Host<double>;

struct Layout {
  int dp, tp, pp;
  int ranks() const { return dp * tp * pp; }
  std::string name() const {
    return "(" + std::to_string(dp) + "," + std::to_string(tp) + "," + std::to_string(pp) + ")";
  }
};
const Layout layouts[] = {{1, 1, 1}, {2, 1, 1}, {1, 2, 1}, {1, 1, 2}, {2, 2, 2}};

/// Global batch `b`: token ids and next tokens, the same on every rank.
struct Batch {
  std::vector<std::int32_t> ids, next;
  explicit Batch(std::int64_t b) : ids(std::size_t(sequences * small_gpt.context)), next(ids.size()) {
    Rng rng(std::uint64_t(100 + b));
    for (auto& v : ids) v = std::int32_t(rng.below(std::uint64_t(small_gpt.vocab)));
    for (auto& v : next) v = std::int32_t(rng.below(std::uint64_t(small_gpt.vocab)));
  }
  /// Replica r's share of `replicas`.
  std::pair<ConstView<std::int32_t>, ConstView<std::int32_t>> share(int r, int replicas) const {
    const index_t rows = sequences / replicas * small_gpt.context;
    return {ConstView<std::int32_t>{ids.data() + r * rows, Shape{rows, 1}}, ConstView<std::int32_t>{next.data() + r * rows, Shape{rows}}};
  }
};

const optim::AdamW adamw({.lr = 1e-2, .weight_decay = 0.1, .clip_norm = 0.5});

/// One process, 3 steps straight: the loss of the third and the weights after it.
struct Reference {
  std::vector<double> initial, weights;
  double third_loss = 0;
  Reference() {
    Pipeline<partition<gpt::Model<small_gpt>, 1>, schedule::OneFOneB, B> pipe({.microbatches = 2, .seed = 4});
    initial = pipe.parameters();
    for (std::int64_t b = 0; b < 3; ++b) {
      const Batch batch(b);
      const auto [x, y] = batch.share(0, 1);
      const StepStats stats = pipe.train_step(x, y, adamw);
      if (b == 2) third_loss = stats.loss;
    }
    weights = pipe.parameters();
  }
};

template <int TP>
using ModelOf = gpt::TensorParallelModel<small_gpt, TP>;  // TP 1: gpt::Model itself

/// On the ranks of `layout` (communicator `world`): save after 2 steps (when `save`), or load
/// `from` and take the third step, comparing with the reference. Returns the failures.
template <int TP, int PP>
int run(MPI_Comm world, const Layout& layout, const Reference& reference, const std::string& prefix, bool save,
        const Layout* from) {
  auto comm = std::make_shared<comm::MpiCommunicator>(world, PP, 60, TP);
  const comm::Topology& topo = comm->topology();
  Pipeline<partition<ModelOf<TP>, PP>, schedule::OneFOneB, B> pipe(
      {.microbatches = 2, .seed = 4, .transfer_timeout_seconds = 60.0, .communicator = comm});
  int failures = 0;
  if (save) {
    pipe.set_parameters(reference.initial);
    for (std::int64_t b = 0; b < 2; ++b) {
      const Batch batch(b);
      const auto [x, y] = batch.share(topo.replica(), topo.replicas);
      pipe.train_step(x, y, adamw);
    }
    io::TrainingState state;
    state.updates = pipe.updates();
    state.batch = 2;
    io::save_checkpoint(prefix + "." + layout.name(), pipe, adamw, state);
    return 0;
  }
  const io::TrainingState state = io::load_checkpoint(prefix + "." + from->name(), pipe, adamw);
  const Batch batch(state.batch);
  const auto [x, y] = batch.share(topo.replica(), topo.replicas);
  const StepStats stats = pipe.train_step(x, y, adamw);
  const std::vector<double> weights = pipe.parameters();
  const double r = relative(weights, reference.weights);
  const bool ok = state.updates == 2 && state.batch == 2 && r <= 1e-12 &&
                  std::abs(stats.loss - reference.third_loss) <= 1e-12 * reference.third_loss;
  if (topo.rank == 0 || !ok)
    std::printf("rank %d: saved under %s, loaded under %s: updates %lld, batch %lld, next loss %s (straight %s), "
                "weights after it %s apart: %s\n",
                topo.rank, from->name().c_str(), layout.name().c_str(), static_cast<long long>(state.updates),
                static_cast<long long>(state.batch), number(stats.loss).c_str(), number(reference.third_loss).c_str(),
                number(r).c_str(), ok ? "equal" : "DIFFERENT");
  failures += !ok;
  return failures;
}

int run_layout(const Layout& layout, const Reference& reference, const std::string& prefix, bool save, const Layout* from) {
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm world = MPI_COMM_NULL;
  MPI_Comm_split(MPI_COMM_WORLD, rank < layout.ranks() ? 0 : MPI_UNDEFINED, rank, &world);
  int failures = 0;
  if (world != MPI_COMM_NULL) {
    if (layout.tp == 1 && layout.pp == 1) failures = run<1, 1>(world, layout, reference, prefix, save, from);
    else if (layout.tp == 2 && layout.pp == 1) failures = run<2, 1>(world, layout, reference, prefix, save, from);
    else if (layout.tp == 1 && layout.pp == 2) failures = run<1, 2>(world, layout, reference, prefix, save, from);
    else failures = run<2, 2>(world, layout, reference, prefix, save, from);
    MPI_Comm_free(&world);
  }
  MPI_Barrier(MPI_COMM_WORLD);  // the checkpoint is written before anyone loads it
  return failures;
}

}  // namespace

int main(int argc, char** argv) {
  comm::MpiSession session(&argc, &argv);
  int rank = 0, size = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  std::string prefix;
  for (int i = 1; i < argc; ++i)
    if (!std::strcmp(argv[i], "--checkpoint") && i + 1 < argc) prefix = argv[++i];
  return run_check([&] {
    CUPIPE_REQUIRE(!prefix.empty(), "mpi_reshard_check: give --checkpoint PREFIX");
    CUPIPE_REQUIRE(size == 8, "mpi_reshard_check: run it with 8 processes (the (2,2,2) layout), not ", size);
    const Reference reference;
    int failures = 0, pairs = 0;
    for (const Layout& layout : layouts) failures += run_layout(layout, reference, prefix, true, nullptr);
    for (const Layout& to : layouts)
      for (const Layout& from : layouts)
        if (&to != &from) {
          failures += run_layout(to, reference, prefix, false, &from);
          ++pairs;
        }
    if (rank == 0) std::printf("%d layout pairs: ", pairs);  // run_check ends the line with the verdict
    return verdict_everywhere(failures);
  });
}
