// SPDX-License-Identifier: Apache-2.0
// Main for GPU tests. Without a usable device it returns 77, which ctest reports as "Skipped"
// (SKIP_RETURN_CODE 77). Listing never touches CUDA: catch_discover_tests runs the binary at build
// time, on machines that may have no driver at all.
#define CATCH_CONFIG_RUNNER
#include <catch2/catch.hpp>
#include <cuda_runtime_api.h>

#include <cstdio>

int main(int argc, char* argv[]) {
  Catch::Session session;
  if (const int rc = session.applyCommandLine(argc, argv); rc != 0) return rc;
  const auto& config = session.configData();
  const bool listing = config.listTestNamesOnly || config.listTests || config.listTags || config.listReporters;
  if (!listing) {
    int count = 0;
    const cudaError_t status = cudaGetDeviceCount(&count);
    if (status != cudaSuccess || count == 0) {
      std::printf("skipped: no CUDA device (%s)\n",
                  status != cudaSuccess ? cudaGetErrorString(status) : "0 devices");
      return 77;
    }
  }
  return session.run();
}
