// SPDX-License-Identifier: Apache-2.0
// Run under mpirun with 2 ranks: does a send make progress while its sender makes no MPI call?
// Rank 0 sends a message of --bytes (default 4 MiB) to rank 1 through MpiCommunicator, then computes
// (sleeps) for --busy-ms (default 400) without calling MPI, then completes its sends. Rank 1 times
// its receive. Over shared memory without single-copy (CI's setting: the message moves in fragments
// that only the sender's MPI calls copy), a communicator without its own progress would deliver the
// message only when the sender calls MPI again, after its computation: the receive would take about
// --busy-ms. The check passes when the receive ends within half of --busy-ms and the data are intact.
//   mpirun -np 2 mpi_progress_check [--bytes N] [--busy-ms T]
// With --interrupt: rank 0 sends only after 3 s; rank 1 waits for it with a 60 s deadline while
// another of its threads calls interrupt_waits() after 200 ms. The receive must throw
// comm::Interrupted within a second of that, and after resume_waits() the same communicator must
// receive the message intact.
//   mpirun -np 2 mpi_progress_check --interrupt
// With --sum: a sum of --bytes (16 MiB here) over both ranks, blocking (sum_over_world) and started
// then finished (start_sum_over_replicas, finish_sums), each timed beside MPI_Allreduce, which waits
// inside MPI. The communicator's waits poll back to back while the data move (comm/wait.hpp's
// poll_window); a wait that slept after its first millisecond took 63-90 ms for 11 MB where
// MPI_Allreduce took 2.5 ms. The check passes when each sum is right and within 4 x MPI_Allreduce's
// time + 5 ms.
//   mpirun -np 2 mpi_progress_check --sum --bytes 16777216
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "cupipe/comm/mpi.hpp"

using namespace cupipe;

namespace {

using Clock = std::chrono::steady_clock;

double ms_since(Clock::time_point t0) { return std::chrono::duration<double, std::milli>(Clock::now() - t0).count(); }

int check_interrupt(comm::MpiCommunicator& comm, const comm::MessageKey& key, std::vector<unsigned char>& data) {
  const auto describe = [] { return std::string("the test message"); };
  for (std::size_t i = 0; i < data.size(); ++i) data[i] = static_cast<unsigned char>(i * 131 + 7);
  if (comm.topology().rank == 0) {
    std::this_thread::sleep_for(std::chrono::seconds(3));
    comm.send(1, key, data.data(), data.size(), describe);
    comm.complete_sends(60);
    comm.sum_over_world(0.0);
    return 0;
  }
  std::fill(data.begin(), data.end(), 0);
  const auto t0 = Clock::now();
  std::thread watchdog([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
    comm.interrupt_waits();
  });
  bool interrupted = false;
  try {
    comm.receive(0, key, data.data(), data.size(), 60, describe);
  } catch (const comm::Interrupted&) {
    interrupted = true;
  }
  const double stopped_ms = ms_since(t0);
  watchdog.join();
  comm.resume_waits();
  comm.receive(0, key, data.data(), data.size(), 60, describe);
  std::size_t wrong = 0;
  for (std::size_t i = 0; i < data.size(); ++i) wrong += data[i] != static_cast<unsigned char>(i * 131 + 7);
  comm.sum_over_world(0.0);
  std::printf("the receive %s after %.1f ms (interrupt_waits at 200 ms, deadline 60 s); then received %zu bytes "
              "(%zu wrong)\n", interrupted ? "threw Interrupted" : "did NOT throw", stopped_ms, data.size(), wrong);
  const bool pass = interrupted && stopped_ms < 1200 && wrong == 0;
  std::printf("%s\n", pass ? "PASS" : "FAIL: the wait was not interrupted in time, or the message was lost");
  return pass ? 0 : 1;
}

/// The fastest of 5 runs of `run` (both ranks start together), in ms.
template <class Run>
double fastest_ms(Run&& run) {
  double best = 1e300;
  for (int r = 0; r < 5; ++r) {
    MPI_Barrier(MPI_COMM_WORLD);
    const auto t0 = Clock::now();
    run();
    best = std::min(best, ms_since(t0));
  }
  return best;
}

int check_sum(comm::MpiCommunicator& comm, std::size_t bytes) {
  const int rank = comm.topology().rank;
  std::vector<double> data(bytes / sizeof(double));
  const auto fill = [&] {
    for (std::size_t i = 0; i < data.size(); ++i) data[i] = double(i % 1000) + rank;
  };
  const auto wrong = [&] {  // after one sum of fill()'s values: 2 (i % 1000) + 1
    std::size_t bad = 0;
    for (std::size_t i = 0; i < data.size(); ++i) bad += data[i] != 2.0 * double(i % 1000) + 1;
    return bad;
  };
  const int n = int(data.size());
  const double mpi_ms = fastest_ms([&] { MPI_Allreduce(MPI_IN_PLACE, data.data(), n, MPI_DOUBLE, MPI_SUM, MPI_COMM_WORLD); });
  const double blocking_ms = fastest_ms([&] { comm.sum_over_world(data.data(), data.size()); });
  const double started_ms = fastest_ms([&] {
    comm.start_sum_over_replicas(data.data(), data.size());
    comm.finish_sums();
  });
  fill();
  comm.sum_over_world(data.data(), data.size());
  std::size_t bad = wrong();
  fill();
  comm.start_sum_over_replicas(data.data(), data.size());
  comm.finish_sums();
  bad += wrong();
  const double limit = 4 * mpi_ms + 5;
  const bool pass = bad == 0 && blocking_ms < limit && started_ms < limit;
  if (rank == 0) {
    std::printf("a sum of %zu bytes over 2 ranks: MPI_Allreduce %.2f ms, sum_over_world %.2f ms, started and finished "
                "%.2f ms (fastest of 5 each; limit %.2f ms); %zu wrong values\n",
                bytes, mpi_ms, blocking_ms, started_ms, limit, bad);
    std::printf("%s\n", pass ? "PASS" : "FAIL: a sum's wait slept while its data moved, or a value is wrong");
  }
  return pass ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  comm::MpiSession session(&argc, &argv);
  try {
    std::size_t bytes = std::size_t(4) << 20;
    double busy_ms = 400;
    bool interrupt = false, sum = false;
    for (int i = 1; i < argc; ++i) {
      const std::string arg = argv[i];
      if (arg == "--bytes" && i + 1 < argc) bytes = std::stoull(argv[++i]);
      else if (arg == "--busy-ms" && i + 1 < argc) busy_ms = std::stod(argv[++i]);
      else if (arg == "--interrupt") interrupt = true;
      else if (arg == "--sum") sum = true;
      else CUPIPE_THROW("mpi_progress_check: unknown argument '", arg, "' (--bytes N, --busy-ms T, --interrupt, --sum)");
    }
    comm::MpiCommunicator comm(MPI_COMM_WORLD, sum ? 1 : 2);  // --sum: one stage, two replicas
    CUPIPE_REQUIRE(comm.topology().world == 2, "mpi_progress_check: run it with 2 ranks, not ", comm.topology().world);
    const comm::MessageKey key{comm::Flow::activation, 1, 0};
    std::vector<unsigned char> data(bytes);
    comm.sum_over_world(0.0);  // both ranks are up before the clock starts
    if (interrupt) return check_interrupt(comm, key, data);
    if (sum) return check_sum(comm, bytes);
    if (comm.topology().rank == 0) {
      for (std::size_t i = 0; i < bytes; ++i) data[i] = static_cast<unsigned char>(i * 131 + 7);
      comm.send(1, key, data.data(), bytes, [] { return std::string("the test message"); });
      std::this_thread::sleep_for(std::chrono::duration<double, std::milli>(busy_ms));  // no MPI call
      comm.complete_sends(60);
      comm.sum_over_world(0.0);
      return 0;
    }
    const auto t0 = std::chrono::steady_clock::now();
    comm.receive(0, key, data.data(), bytes, 60, [] { return std::string("the test message"); });
    const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    std::size_t wrong = 0;
    for (std::size_t i = 0; i < bytes; ++i) wrong += data[i] != static_cast<unsigned char>(i * 131 + 7);
    comm.sum_over_world(0.0);
    std::printf("received %zu bytes in %.2f ms while the sender computed for %.0f ms without calling MPI "
                "(%zu wrong bytes)\n", bytes, ms, busy_ms, wrong);
    const bool pass = wrong == 0 && ms < busy_ms / 2;
    std::printf("%s\n", pass ? "PASS" : "FAIL: the send waited for the sender's next MPI call");
    return pass ? 0 : 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "mpi_progress_check: %s\n", e.what());
    MPI_Abort(MPI_COMM_WORLD, 1);
    return 1;
  }
}
