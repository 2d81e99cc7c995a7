// SPDX-License-Identifier: Apache-2.0
// pipeline_throughput on the host backend (backend::Host<float>, OpenBLAS GEMMs): real CPU figures
// on machines without a GPU. See pipeline_throughput.hpp for what is measured.
#include <cstdio>
#include <exception>

#include "pipeline_throughput.hpp"

int main(int argc, char** argv) {
  try {
    // The pipelines' workers share the cores: one OpenBLAS thread per call (a process-wide setting).
    cupipe::backend::Host<float>::set_blas_threads(1);
    cupipe::bench::Harness harness("pipeline_throughput (host backend, CPU)");
    const cupipe::bench::Options options = cupipe::bench::parse(harness.parse(argc, argv));
    return cupipe::bench::run<cupipe::backend::Host<float>>(harness, options, "CPU");
  } catch (const std::exception& e) {
    std::fprintf(stderr, "pipeline_throughput_host: %s\n", e.what());
    return 1;
  }
}
