// SPDX-License-Identifier: Apache-2.0
// A ping-pong between two MPI ranks at 4 KB and 4 MB, waited for three ways: MPI_Wait (which spins),
// MPI_Test with a sleep after every test (cupipe's waits before 2026-11-25), and comm::wait_until
// (back to back for the first millisecond, then sleeping), and through MpiCommunicator's send and
// receive as the pipeline uses them. Prints one-way time and bandwidth, the median of 21 round trips.
//   mpirun -np 2 build/host/bench/comm/mpi_pingpong
#include <mpi.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <string>
#include <thread>
#include <vector>

#include "cupipe/comm/mpi.hpp"
#include "cupipe/comm/wait.hpp"

using namespace cupipe;

namespace {

enum class Mode { mpi_wait, sleep_each_test, wait_until };

void complete(MPI_Request& request, Mode mode) {
  if (mode == Mode::mpi_wait) {
    CUPIPE_CHECK_MPI(MPI_Wait(&request, MPI_STATUS_IGNORE));
    return;
  }
  const auto test = [&] {
    int flag = 0;
    CUPIPE_CHECK_MPI(MPI_Test(&request, &flag, MPI_STATUS_IGNORE));
    return flag != 0;
  };
  if (mode == Mode::wait_until) {
    (void)comm::wait_until(test, 60);
    return;
  }
  comm::Backoff backoff;  // every test followed by a sleep
  while (!test()) backoff.sleep();
}

double median(std::vector<double> v) {
  std::nth_element(v.begin(), v.begin() + std::ptrdiff_t(v.size() / 2), v.end());
  return v[v.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  comm::MpiSession session(&argc, &argv);
  int rank = 0, size = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  if (size != 2) {
    if (rank == 0) std::fprintf(stderr, "mpi_pingpong: run it with 2 ranks (mpirun -np 2), got %d\n", size);
    return 2;
  }
  comm::MpiCommunicator communicator(MPI_COMM_WORLD, 2, 60);
  const int peer = 1 - rank, repeats = 21;
  const char* names[] = {"MPI_Wait (spins)", "MPI_Test, sleep after each", "comm::wait_until", "MpiCommunicator"};
  if (rank == 0) std::printf("| wait | 4 KB one-way | 4 KB GB/s | 4 MB one-way | 4 MB GB/s |\n| --- | --- | --- | --- | --- |\n");
  for (int m = 0; m < 4; ++m) {
    std::string row = std::string("| ") + names[m] + " |";
    for (const int bytes : {4096, 4 << 20}) {
      std::vector<char> buffer(static_cast<std::size_t>(bytes), 1);
      std::vector<double> times;
      for (int r = 0; r <= repeats; ++r) {  // round 0 warms up
        const auto start = std::chrono::steady_clock::now();
        for (const bool sending : {rank == 0, rank != 0}) {
          if (m == 3) {
            const comm::MessageKey key{comm::Flow::activation, 1, r};
            const auto describe = [] { return std::string("ping-pong"); };
            if (sending) communicator.send(peer, key, buffer.data(), buffer.size(), describe);
            else communicator.receive(peer, key, buffer.data(), buffer.size(), 60, describe);
            continue;
          }
          MPI_Request request;
          if (sending) CUPIPE_CHECK_MPI(MPI_Isend(buffer.data(), bytes, MPI_BYTE, peer, r, MPI_COMM_WORLD, &request));
          else CUPIPE_CHECK_MPI(MPI_Irecv(buffer.data(), bytes, MPI_BYTE, peer, r, MPI_COMM_WORLD, &request));
          complete(request, Mode(m));
        }
        if (r > 0) times.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() / 2);
      }
      communicator.complete_sends(60);
      const double one_way = median(times);
      char cell[96];
      std::snprintf(cell, sizeof cell, " %.1f us | %.2f |", one_way * 1e6, bytes / one_way / 1e9);
      row += cell;
    }
    if (rank == 0) std::printf("%s\n", row.c_str());
  }
  return 0;
}
