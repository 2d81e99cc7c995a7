// SPDX-License-Identifier: Apache-2.0
// Run under mpirun: tensor parallelism over host ranks (MpiCommunicator's tensor group, float64)
// must compute what the whole model computes in one process.
//   mpi_tensor_parallel_check --tensor TP
// World = TP tensor-parallel ranks x D replicas (one stage). Every rank builds the whole small GPT
// (the oracle) and its part of gpt::TensorParallelModel (attention split by heads, the MLP by hidden
// width), sharded from the whole model's initial parameters. Each group trains on the same batch:
//   - the loss after one forward/backward, the gradients gathered back to the whole layout, and the
//     gradient's sum of squares (split tensors summed over the group, replicated ones once): 1e-12
//     relative to the whole model (the sums add the heads' partial products in another order);
//   - the weights after 3 AdamW steps, gathered: 1e-12 relative;
//   - the layers refuse to run without a tensor group, or with one of another size, and a Pipeline
//     refuses a communicator with tensor-parallel ranks, each in one sentence.
// With replicas, the groups must not mix (each group's sums stay inside it).
#include <cmath>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "cupipe/comm/mpi.hpp"
#include "cupipe/cupipe.hpp"
#include "cupipe/models/gpt.hpp"

using namespace cupipe;

namespace {

std::string number(double v) {
  char text[32];
  std::snprintf(text, sizeof text, "%.15g", v);
  return text;
}

double relative(const std::vector<double>& a, const std::vector<double>& b) {
  double diff = 0, norm = 0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    diff = std::max(diff, std::abs(a[i] - b[i]));
    norm = std::max(norm, std::abs(b[i]));
  }
  return a.size() != b.size() ? INFINITY : norm > 0 ? diff / norm : diff;
}

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
  part.set_parameters(tensor_parallel::shard(whole_table, part_table, std::span<const double>(init), group.rank()));

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
  const std::vector<double> gathered = tensor_parallel::unshard(whole_table, part_table, std::span<const double>(part_grads), group);
  const double r = relative(gathered, whole_grads);
  expect("gradients, gathered", r <= 1e-12, "max relative difference " + number(r));
  double whole_squares = 0;
  for (double g : whole_grads) whole_squares += g * g;
  const double part_squares = tensor_parallel::sum_of_squares(part_table, std::span<const double>(part_grads), group);
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
      tensor_parallel::unshard(whole_table, part_table, std::span<const double>(part_weights), group);
  const double w = relative(weights, whole.parameters());
  expect("weights after 3 AdamW steps, gathered", w <= 1e-12, "max relative difference " + number(w));
  const TiedCopies tied = Whole::body::tied;
  expect("tied copies", std::equal(weights.begin() + tied.first, weights.begin() + tied.first + tied.count,
                                   weights.begin() + tied.second), "wte and lm_head");

  // A pipeline over this communicator refuses the tensor-parallel ranks it cannot account for yet.
  std::string refusal;
  try {
    auto shared = std::shared_ptr<comm::Communicator>(&comm, [](comm::Communicator*) {});
    Pipeline<partition<Whole, 1>, schedule::OneFOneB, B> pipe({.microbatches = 2, .communicator = shared});
  } catch (const cupipe::error& e) {
    refusal = e.what();
  }
  const bool refused = refusal.find("tensor-parallel ranks per stage") != std::string::npos;
  if (speaks || !refused) std::printf("rank %d: a Pipeline with tensor-parallel ranks: %s\n", topo.rank, refused ? "refused" : "NOT REFUSED");
  failures += !refused;

  int total = failures;
  MPI_Allreduce(&failures, &total, 1, MPI_INT, MPI_SUM, MPI_COMM_WORLD);
  return total == 0 ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  comm::MpiSession session(&argc, &argv);
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  int tensor = 0;
  for (int i = 1; i < argc; ++i)
    if (!std::strcmp(argv[i], "--tensor") && i + 1 < argc) tensor = std::atoi(argv[++i]);
  try {
    int rc = 2;
    if (tensor == 2 || tensor == 4) {
      comm::MpiCommunicator comm(MPI_COMM_WORLD, 1, 60, tensor);
      if (rank == 0) std::printf("%s\n", comm.topology().describe().c_str());
      rc = tensor == 2 ? check<2>(comm) : check<4>(comm);
    } else {
      std::fprintf(stderr, "usage: mpi_tensor_parallel_check --tensor 2|4\n");
    }
    if (rank == 0) std::printf("%s\n", rc == 0 ? "PASS" : "FAIL");
    return rc;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "rank %d: %s\n", rank, e.what());
    std::fflush(stderr);
    MPI_Abort(MPI_COMM_WORLD, 3);
    return 3;
  }
}
