// SPDX-License-Identifier: Apache-2.0
// pipeline_throughput on the CUDA backend (backend::Cuda<float>, every stage on --device, fp32 GEMMs).
// Without a CUDA device it says so and exits non-zero. See pipeline_throughput.hpp.
#include <cuda_runtime_api.h>

#include <cstdio>
#include <exception>
#include <string>

#include "cupipe/cupipe.cuh"
#include "pipeline_throughput.hpp"

int main(int argc, char** argv) {
  try {
    cupipe::bench::Harness harness("pipeline_throughput (CUDA backend)");
    const cupipe::bench::Options options = cupipe::bench::parse(harness.parse(argc, argv));
    int count = 0;
    const cudaError_t status = cudaGetDeviceCount(&count);
    if (status != cudaSuccess || count == 0) {
      std::fprintf(stderr, "pipeline_throughput: no CUDA device (%s)\n",
                   status != cudaSuccess ? cudaGetErrorString(status) : "0 devices");
      return 2;
    }
    cudaDeviceProp prop{};
    if (cudaGetDeviceProperties(&prop, options.device) != cudaSuccess) {
      std::fprintf(stderr, "pipeline_throughput: CUDA device %d does not exist (%d present)\n", options.device, count);
      return 2;
    }
    // Exact fp32 GEMMs, as the figures in docs/benchmarks.md were measured (the library's default is TF32).
    cupipe::backend::cuda::set_default_math(cupipe::backend::cuda::MathMode::fp32);
    return cupipe::bench::run<cupipe::backend::Cuda<float>>(harness, options, std::string(prop.name));
  } catch (const std::exception& e) {
    std::fprintf(stderr, "pipeline_throughput: %s\n", e.what());
    return 1;
  }
}
