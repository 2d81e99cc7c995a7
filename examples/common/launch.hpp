// SPDX-License-Identifier: Apache-2.0
// How the example trainers start under mpirun or srun: MPI comes up when --dp or --tp > 1 or a launcher
// started the process, the process count must be stages x replicas (x tensor-parallel ranks), and one rank's failure ends the
// whole job instead of leaving the others waiting for it. Also what the trainers' placement and
// agreement flags share: --devices lists, and exact text for numbers the ranks must agree on.
#pragma once

#include <cstdio>
#include <cstdlib>
#include <exception>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "cupipe/backend/host/blas_core.hpp"
#include "cupipe/comm/communicator.hpp"
#include "cupipe/core/error.hpp"
#if CUPIPE_HAS_MPI
#include "cupipe/comm/mpi.hpp"
#endif

namespace cupipe::examples {

/// A number as the ranks compare it in require_same_settings: all 17 significant digits.
inline std::string exact_text(double v) {
  char text[32];
  std::snprintf(text, sizeof text, "%.17g", v);
  return text;
}

/// "0,0,1,1" -> {0, 0, 1, 1}; empty -> {}. Throws naming the item that is not a device number.
inline std::vector<int> parse_devices(const std::string& text) {
  std::vector<int> out;
  std::size_t pos = 0;
  while (pos < text.size()) {
    const std::size_t comma = text.find(',', pos);
    const std::string item = text.substr(pos, comma == std::string::npos ? std::string::npos : comma - pos);
    try {
      std::size_t used = 0;
      out.push_back(std::stoi(item, &used));
      if (used != item.size() || out.back() < 0) throw std::invalid_argument(item);
    } catch (const std::exception&) {
      CUPIPE_THROW("--devices '", text, "': '", item, "' is not a device number");
    }
    if (comma == std::string::npos) break;
    pos = comma + 1;
  }
  return out;
}

/// The process's place in a multi-process run: none when run alone. `replica` and `replicas` count
/// the data-parallel replicas (each reads its own share of a batch); the `context` ranks of a
/// context-parallel ring read the same sequences, each keeping its share of their tokens.
struct Launch {
  std::shared_ptr<comm::Communicator> communicator;
  int rank = 0;
  int replica = 0;
  int replicas = 1;
  int context = 1;  ///< context-parallel ranks per ring (--cp); the ring itself: communicator->context_group()
  bool leader() const { return rank == 0; }
};

/// Says on stderr (the leader only) when the host BLAS runs kernels slower than this CPU's, and the
/// environment that fixes it for the next run (backend/host/blas_core.hpp).
inline void note_blas_kernels(const char* program, const Launch& launch) {
  if (!launch.leader()) return;
  const std::string advice = backend::host::blas_core_advice();
  if (!advice.empty()) std::fprintf(stderr, "%s: note: %s\n", program, advice.c_str());
}

/// Holds MPI (when it is used) for the trainer's lifetime. Declare it before the trainer's try block
/// and start() it inside, so that abort_job() can still reach MPI from the catch.
class Launcher {
 public:
  /// Starts MPI when `dp`, `tp` or `cp` > 1 or a launcher's environment is present, and checks the
  /// process count (stages x dp x tp x cp); the replicas form expert-parallel groups of `ep`. `program` names the binary in the mpirun command a wrong
  /// count suggests. `stages` 0 (--plan auto): the processes over dp x tp, which must divide them.
  const Launch& start(int& argc, char**& argv, const char* program, int stages, int dp, double timeout, int tp = 1,
                      comm::RankOrder order = comm::RankOrder::stages_outermost, int cp = 1, int ep = 1) {
#if CUPIPE_HAS_MPI
    const bool under_launcher = std::getenv("OMPI_COMM_WORLD_SIZE") || std::getenv("PMI_SIZE") || std::getenv("SLURM_NTASKS");
    if (dp > 1 || tp > 1 || cp > 1 || under_launcher) {
      mpi_ = std::make_unique<comm::MpiSession>(&argc, &argv);
      int world = 0;
      CUPIPE_CHECK_MPI(MPI_Comm_size(MPI_COMM_WORLD, &world));
      if (stages == 0) {
        if (world % (dp * tp) != 0)
          CUPIPE_THROW("--plan auto with --dp ", dp, tp > 1 ? " x --tp " + std::to_string(tp) : std::string(),
                       " plans stages for a multiple of ", dp * tp, " processes, but ", world,
                       world == 1 ? " was" : " were", " launched");
        stages = world / (dp * tp);
      }
      const int needed = stages * dp * tp * cp;
      if (world != needed)
        CUPIPE_THROW("--stages ", stages, " x --dp ", dp, tp > 1 ? " x --tp " + std::to_string(tp) : std::string(),
                     cp > 1 ? " x --cp " + std::to_string(cp) : std::string(), " needs ",
                     needed, " processes but ", world, world == 1 ? " was" : " were", " launched: run it as `mpirun -np ",
                     needed, " ", program, " ...` (or srun -n ", needed, ")");
      timeout_ = timeout;
      order_ = order;
      ep_ = ep;
      reshape(stages, tp, cp);
    }
#else
    (void)argc, (void)argv, (void)program, (void)stages, (void)timeout, (void)order, (void)ep;
    if (dp > 1 || tp > 1 || cp > 1)
      CUPIPE_THROW(dp > 1 ? "--dp" : tp > 1 ? "--tp" : "--cp",
                   " needs MPI; this trainer was built without it (install libopenmpi-dev and reconfigure)");
#endif
    return launch_;
  }

  const Launch& launch() const { return launch_; }

  /// A communicator of every process with `stages` stages and `tp` tensor-parallel ranks (the rest
  /// replicas, in the launch's context-parallel rings), with the launch's timeout and rank order;
  /// collective: every rank calls it. Null when MPI is not up (one process).
  std::shared_ptr<comm::Communicator> communicator(int stages, int tp) const {
#if CUPIPE_HAS_MPI
    if (mpi_) return std::make_shared<comm::MpiCommunicator>(MPI_COMM_WORLD, stages, timeout_, tp, order_, cp_, ep_);
#else
    (void)stages, (void)tp;
#endif
    return nullptr;
  }

  /// Forms the launch's communicator as `stages` x replicas x `tp`, the replicas in context-parallel
  /// rings of `cp` or expert-parallel groups of `ep` (0: the launch's) (again for --plan auto, once
  /// it has chosen a tensor-parallel degree, a ring or a group); collective. Nothing when MPI is not up.
  void reshape(int stages, int tp, int cp, int ep = 0) {
    if (!mpi_up()) return;
#if CUPIPE_HAS_MPI
    cp_ = cp;
    if (ep > 0) ep_ = ep;
#else
    (void)cp, (void)ep;
#endif
    launch_.communicator.reset();  // its progress thread and MPI communicator end first, on every rank
    launch_.communicator = communicator(stages, tp);
    const comm::Topology& topology = launch_.communicator->topology();
    launch_.rank = topology.rank;
    launch_.replica = topology.data_replica();
    launch_.replicas = topology.replicas / topology.context;
    launch_.context = topology.context;
  }

  /// Ends every rank of a multi-process job (MPI_Abort); nothing when run alone.
  void abort_job() {
#if CUPIPE_HAS_MPI
    int size = 1;
    if (mpi_ && MPI_Comm_size(MPI_COMM_WORLD, &size) == MPI_SUCCESS && size > 1) MPI_Abort(MPI_COMM_WORLD, 1);
#endif
  }

 private:
  bool mpi_up() const {
#if CUPIPE_HAS_MPI
    return mpi_ != nullptr;
#else
    return false;
#endif
  }

  Launch launch_;
#if CUPIPE_HAS_MPI
  std::unique_ptr<comm::MpiSession> mpi_;
  double timeout_ = 0;
  comm::RankOrder order_ = comm::RankOrder::stages_outermost;
  int cp_ = 1;
  int ep_ = 1;  ///< expert-parallel ranks per group (among the replicas)
#endif
};

}  // namespace cupipe::examples
