// SPDX-License-Identifier: Apache-2.0
// Run at configure time by tests/CMakeLists.txt: prints the OPENBLAS_CORETYPE the tests need for this
// CPU's vector kernels, or nothing when OpenBLAS already chose them (backend/host/blas_core.hpp).
#include <cstdio>

#include "cupipe/backend/host/blas_core.hpp"

int main() {
  std::printf("%s", cupipe::backend::host::better_blas_coretype().c_str());
  return 0;
}
