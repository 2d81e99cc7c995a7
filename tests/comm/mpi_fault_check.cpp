// SPDX-License-Identifier: Apache-2.0
// Run under mpirun: a pipeline of one stage per rank trains, then the last rank fails on purpose in
// the second step, and every other rank must notice on its own, within the configured timeout,
// without spinning.
//   mpi_fault_check --fault stall-transfer|stall-collective|kill|stall-amax --timeout S --report DIR
// stall-transfer:   the last stage stops answering in its first forward of step 2 (the others wait
//                   on point-to-point transfers: the transfer timeout);
// stall-collective: the last rank finishes step 2 but never joins the sum over ranks after it (the
//                   others wait in MPI_Iallreduce: the collective timeout);
// kill:             the last rank kills itself (SIGKILL) in its first forward of step 2.
// stall-amax:       FP8 delayed scaling over one tensor-parallel group of all 3 ranks (issue #59):
//                   each rank runs its GEMMs in backend::HostFp8<fp8::PerTensorDelayed> and closes
//                   step 1 (the amax reduction over the group); in step 2 the last rank runs its
//                   GEMMs but never closes the step (the others wait in the amax reduction: the
//                   collective timeout, the error naming the reduction and the group).
// Each healthy rank prints its error as one line on stderr, writes DIR/rank-R.txt ("wall W cpu C" =
// seconds from the start of step 2 to the error, of wall time and of this process's CPU time, then
// the error), and exits 1 without MPI_Finalize (which would wait for the failed rank). The stalled
// rank exits after 3 timeouts, so a launcher told not to end the job on the first failure
// (--mca orte_abort_on_non_zero_status 0) still ends. tests/comm/check_fault_reports.cmake checks.
// Every rank's flight recorder writes DIR/cupipe-flight-rank-R.json when a wait times out or on
// SIGUSR1; tests/comm/check_flight_report.py signals the job and checks the merged report.
#include <signal.h>
#include <time.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iomanip>
#include <string>
#include <thread>
#include <vector>

#include "cupipe/comm/mpi.hpp"
#include "cupipe/cupipe.hpp"
#include "hook_layer.hpp"

using namespace cupipe;

namespace {

std::string fault;
double timeout = 3;
bool armed = false;  ///< set on the faulty rank for step 2

double cpu_seconds() {
  timespec t{};
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &t);
  return double(t.tv_sec) + 1e-9 * double(t.tv_nsec);
}

/// Sleeps through three timeouts, then leaves (so that the job ends even when the launcher waits).
[[noreturn]] void stall() {
  std::this_thread::sleep_for(std::chrono::duration<double>(3 * timeout + 2));
  std::_Exit(2);
}

/// A healthy rank's end: its error on stderr and in DIR/rank-R.txt with the seconds it waited (wall
/// and CPU), then exit 1 without MPI_Finalize (which would wait for the failed rank).
[[noreturn]] void report_failure(const std::string& report, int rank, const std::exception& e, double wall, double cpu) {
  std::fprintf(stderr, "%s\n", e.what());  // the errors name the rank or the stage
  std::ofstream out(report + "/rank-" + std::to_string(rank) + ".txt");
  out << std::fixed << std::setprecision(3) << "wall " << wall << " cpu " << cpu << "\n" << e.what() << "\n";
  out.close();
  std::fflush(nullptr);
  std::_Exit(1);
}

/// On the armed rank, the first forward of the last stage stalls or kills the process.
void trap() {
  if (armed && fault == "stall-transfer") stall();
  if (armed && fault == "kill") raise(SIGKILL);
}
using Trap = HookLayer<trap>;

// The trap is the last layer, so it runs on the last stage: the last rank is the faulty one.
using Model = Sequential<Linear<4, 8>, ReLU, Linear<8, 8>, ReLU, Linear<8, 3>, Trap>;
using Stages = partition<Model, 3>;

int run(const std::string& report, int rank) {
  auto communicator = std::make_shared<comm::MpiCommunicator>(MPI_COMM_WORLD, int(Stages::size), timeout);
  const bool faulty = rank == communicator->topology().world - 1;
  Pipeline<Stages, schedule::OneFOneB, backend::Host<float>> pipe(
      {.microbatches = 4, .seed = 1, .transfer_timeout_seconds = timeout, .communicator = communicator, .flight_dir = report});
  optim::SGD sgd({.lr = 0.1});
  std::vector<float> x(16 * 4);
  std::vector<std::int32_t> y(16);
  Rng rng(5);
  for (float& v : x) v = float(rng.normal());
  for (auto& v : y) v = std::int32_t(rng.below(3));
  const ConstView<float> xs{x.data(), Shape{16, 4}};
  const ConstView<std::int32_t> ys{y.data(), Shape{16}};

  const StepStats first = pipe.train_step(xs, ys, sgd);  // a healthy step first
  if (rank == 0) std::printf("step 1 loss %.4f\n", first.loss);
  const double wall0 = MPI_Wtime(), cpu0 = cpu_seconds();
  try {
    armed = faulty;
    const StepStats second = pipe.train_step(xs, ys, sgd);
    if (faulty && fault == "stall-collective") stall();
    const double total = communicator->sum_over_world(second.loss);  // what a trainer does after a step
    if (rank == 0) std::printf("PASS: no fault, summed loss %.4f\n", total);
    return 0;
  } catch (const std::exception& e) {
    report_failure(report, rank, e, MPI_Wtime() - wall0, cpu_seconds() - cpu0);
  }
}

/// stall-amax: a layer's three GEMMs a step on each rank's part of the data, then the step closed
/// (backend::end_step, as the pipeline's update does); the last rank skips that in step 2.
int run_amax(const std::string& report, int rank) {
  auto communicator = std::make_shared<comm::MpiCommunicator>(MPI_COMM_WORLD, 1, timeout, 3);
  const bool faulty = rank == communicator->topology().world - 1;
  backend::HostFp8<fp8::PerTensorDelayed> be;
  be.tensor_group = communicator->tensor_group();
  using BF = cupipe::bfloat16;
  const index_t rows = 8, in = 16, out = 12;
  std::vector<BF> x(std::size_t(rows * in)), w(std::size_t(out * in)), dy(std::size_t(rows * out)), y(dy.size()), dx(x.size());
  std::vector<float> dw(w.size());
  Rng rng(std::uint64_t(7 + rank));
  for (BF& v : x) v = BF(float(rng.normal()));
  for (BF& v : w) v = BF(float(0.1 * rng.normal()));
  for (BF& v : dy) v = BF(float(1e-3 * rng.normal()));
  using ops::Transpose;
  const auto gemms = [&] {
    ops::gemm(be, Transpose::no, Transpose::yes, BF(1), ConstView<BF>{x.data(), Shape{rows, in}},
              ConstView<BF>{w.data(), Shape{out, in}}, BF(0), TensorView<BF>{y.data(), Shape{rows, out}});
    ops::gemm(be, Transpose::no, Transpose::no, BF(1), ConstView<BF>{dy.data(), Shape{rows, out}},
              ConstView<BF>{w.data(), Shape{out, in}}, BF(0), TensorView<BF>{dx.data(), Shape{rows, in}});
    ops::gemm(be, Transpose::yes, Transpose::no, 1.0f, ConstView<BF>{dy.data(), Shape{rows, out}},
              ConstView<BF>{x.data(), Shape{rows, in}}, 0.0f, TensorView<float>{dw.data(), Shape{out, in}});
  };
  gemms();
  backend::end_step(be);  // a healthy step first: every rank records the group's amaxes
  if (rank == 0) std::printf("step 1: forward scale of x %.6g over the group\n", double(be.fp8.scale(w.data(), fp8::GemmRole::forward, true)));
  const double wall0 = MPI_Wtime(), cpu0 = cpu_seconds();
  try {
    gemms();
    if (faulty) stall();
    backend::end_step(be);
    if (rank == 0) std::printf("PASS: no fault\n");
    return 0;
  } catch (const std::exception& e) {
    report_failure(report, rank, e, MPI_Wtime() - wall0, cpu_seconds() - cpu0);
  }
}

}  // namespace

int main(int argc, char** argv) {
  comm::MpiSession session(&argc, &argv);
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  std::string report = ".";
  for (int i = 1; i + 1 < argc; i += 2) {
    if (!std::strcmp(argv[i], "--fault")) fault = argv[i + 1];
    else if (!std::strcmp(argv[i], "--timeout")) timeout = std::atof(argv[i + 1]);
    else if (!std::strcmp(argv[i], "--report")) report = argv[i + 1];
  }
  if (fault != "stall-transfer" && fault != "stall-collective" && fault != "kill" && fault != "stall-amax") {
    std::fprintf(stderr, "usage: mpi_fault_check --fault stall-transfer|stall-collective|kill|stall-amax --timeout S --report DIR\n");
    return 2;
  }
  try {
    return fault == "stall-amax" ? run_amax(report, rank) : run(report, rank);
  } catch (const std::exception& e) {  // a failure before the fault: the check itself is broken
    std::fprintf(stderr, "rank %d: before the fault: %s\n", rank, e.what());
    std::fflush(nullptr);
    MPI_Abort(MPI_COMM_WORLD, 3);
    return 3;
  }
}
