// SPDX-License-Identifier: Apache-2.0
// NcclCommunicator between device ranks, under mpirun (one GPU per rank, rank r on device r % count):
//   --stages 2: stage 0 sends three activations to stage 1, stage 1 sends three gradients back; both
//               check every value and the header order; sends complete within the timeout;
//   --stages 1: two data-parallel replicas sum device gradients, host counts and scalars.
// Prints PASS, or "SKIPPED:" when there are fewer GPUs than ranks (ctest reports it as skipped).
#include <cuda_runtime_api.h>
#include <mpi.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <string>
#include <vector>

#include "cupipe/comm/nccl.hpp"

namespace {

using cupipe::comm::Flow;
using cupipe::comm::MessageKey;

std::vector<float> pattern(int microbatch, Flow flow, std::size_t n) {
  std::vector<float> v(n);
  for (std::size_t i = 0; i < n; ++i) v[i] = float(microbatch * 1000 + int(i)) * (flow == Flow::activation ? 1.0f : -1.0f);
  return v;
}

struct Device {
  explicit Device(std::size_t n) : count(n) { CUPIPE_CHECK_CUDA(cudaMalloc(&data, n * sizeof(float))); }
  ~Device() { cudaFree(data); }
  void upload(const std::vector<float>& v) {
    CUPIPE_CHECK_CUDA(cudaMemcpy(data, v.data(), v.size() * sizeof(float), cudaMemcpyHostToDevice));
  }
  std::vector<float> download() const {
    std::vector<float> v(count);
    CUPIPE_CHECK_CUDA(cudaMemcpy(v.data(), data, count * sizeof(float), cudaMemcpyDeviceToHost));
    return v;
  }
  float* data = nullptr;
  std::size_t count;
};

bool point_to_point(cupipe::comm::NcclCommunicator& comm) {
  constexpr std::size_t n = 1000;
  const int stage = comm.topology().stage();
  const auto describe = [] { return std::string("nccl_check message"); };
  bool ok = true;
  Device buffer(n);
  if (stage == 0) {
    for (int j = 0; j < 3; ++j) {
      buffer.upload(pattern(j, Flow::activation, n));
      comm.send(1, MessageKey{Flow::activation, 1, j}, buffer.data, n * sizeof(float), describe);
    }
    for (int j = 0; j < 3; ++j) {
      comm.receive(1, MessageKey{Flow::gradient, 0, j}, buffer.data, n * sizeof(float), 30, describe);
      ok = ok && buffer.download() == pattern(j, Flow::gradient, n);
    }
  } else {
    for (int j = 0; j < 3; ++j) {
      comm.receive(0, MessageKey{Flow::activation, 1, j}, buffer.data, n * sizeof(float), 30, describe);
      ok = ok && buffer.download() == pattern(j, Flow::activation, n);
      buffer.upload(pattern(j, Flow::gradient, n));
      comm.send(0, MessageKey{Flow::gradient, 0, j}, buffer.data, n * sizeof(float), describe);
    }
  }
  comm.complete_sends(30);
  return ok;
}

bool replicas(cupipe::comm::NcclCommunicator& comm) {
  constexpr std::size_t n = 4096;
  const int replica = comm.topology().replica();
  Device grads(n);
  grads.upload(std::vector<float>(n, float(replica + 1)));
  comm.sum_over_replicas(grads.data, n);
  const std::vector<float> summed = grads.download();
  bool ok = summed == std::vector<float>(n, 3.0f);  // 1 + 2
  std::vector<double> counts{double(replica), 10.0};  // host memory goes through a device buffer
  comm.sum_over_replicas(counts.data(), counts.size());
  ok = ok && counts[0] == 1.0 && counts[1] == 20.0;
  ok = ok && comm.sum_over_world(0.5) == 1.0;
  return ok;
}

}  // namespace

int main(int argc, char** argv) {
  int provided = 0;
  MPI_Init_thread(&argc, &argv, MPI_THREAD_SERIALIZED, &provided);
  int rank = 0, world = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &world);
  int stages = world;
  for (int i = 1; i + 1 < argc; ++i)
    if (std::strcmp(argv[i], "--stages") == 0) stages = std::atoi(argv[i + 1]);
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess) devices = 0;
  if (devices < world) {
    if (rank == 0) std::printf("SKIPPED: %d CUDA device(s) for %d ranks\n", devices, world);
    MPI_Finalize();
    return 0;
  }
  int status = 0;
  try {
    auto comm = cupipe::comm::NcclCommunicator::from_mpi(MPI_COMM_WORLD, stages, rank % devices);
    const bool ok = stages > 1 ? point_to_point(*comm) : replicas(*comm);
    int all = ok ? 1 : 0;
    MPI_Allreduce(MPI_IN_PLACE, &all, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
    if (rank == 0) std::printf("%s\n", all ? "PASS" : "FAIL: values differ");
    status = all ? 0 : 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "rank %d: FAIL: %s\n", rank, e.what());
    MPI_Abort(MPI_COMM_WORLD, 1);
  }
  MPI_Finalize();
  return status;
}
