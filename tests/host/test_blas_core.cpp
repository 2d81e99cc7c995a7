// SPDX-License-Identifier: Apache-2.0
// backend/host/blas_core.hpp: the BLAS kernels the tests run are the CPU's own, which the configure
// probe and OPENBLAS_CORETYPE (tests/CMakeLists.txt) see to where OpenBLAS falls back to SSE3.
#include <catch2/catch.hpp>

#include <string>

#include "cupipe/backend/host/blas_core.hpp"

using namespace cupipe;

TEST_CASE("the tests run the CPU's own BLAS kernels: nothing is left to advise", "[cpu][host][blas]") {
#ifdef OPENBLAS_VERSION
  CHECK_FALSE(backend::host::blas_core().empty());
#endif
  CAPTURE(backend::host::blas_core());
  CHECK(backend::host::better_blas_coretype().empty());
  CHECK(backend::host::blas_core_advice().empty());
}
