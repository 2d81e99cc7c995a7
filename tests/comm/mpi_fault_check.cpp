// SPDX-License-Identifier: Apache-2.0
// Run under mpirun: a pipeline of one stage per rank trains, then the last rank fails on purpose in
// the second step, and every other rank must notice on its own, within the configured timeout,
// without spinning.
//   mpi_fault_check --fault stall-transfer|stall-collective|kill --timeout S --report DIR
// stall-transfer:   the last stage stops answering in its first forward of step 2 (the others wait
//                   on point-to-point transfers: the transfer timeout);
// stall-collective: the last rank finishes step 2 but never joins the sum over ranks after it (the
//                   others wait in MPI_Iallreduce: the collective timeout);
// kill:             the last rank kills itself (SIGKILL) in its first forward of step 2.
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
    const double wall = MPI_Wtime() - wall0, cpu = cpu_seconds() - cpu0;
    std::fprintf(stderr, "%s\n", e.what());  // the errors name the rank or the stage
    std::ofstream out(report + "/rank-" + std::to_string(rank) + ".txt");
    out << std::fixed << std::setprecision(3) << "wall " << wall << " cpu " << cpu << "\n" << e.what() << "\n";
    out.close();
    std::fflush(nullptr);
    std::_Exit(1);
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
  if (fault != "stall-transfer" && fault != "stall-collective" && fault != "kill") {
    std::fprintf(stderr, "usage: mpi_fault_check --fault stall-transfer|stall-collective|kill --timeout S --report DIR\n");
    return 2;
  }
  try {
    return run(report, rank);
  } catch (const std::exception& e) {  // a failure before the fault: the check itself is broken
    std::fprintf(stderr, "rank %d: before the fault: %s\n", rank, e.what());
    std::fflush(nullptr);
    MPI_Abort(MPI_COMM_WORLD, 3);
    return 3;
  }
}
