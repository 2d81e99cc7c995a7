// SPDX-License-Identifier: Apache-2.0
// Which kernels the host BLAS runs, and what to do when they are slower than the CPU allows.
//
// OpenBLAS picks its GEMM kernels for the CPU when the library loads. A release older than the CPU
// does not know its model and falls back to the generic SSE3 kernels ("Prescott"): Debian 12's
// OpenBLAS 0.3.21 does so on Sapphire and Emerald Rapids (family 6, model 207), where the tiny GPT's
// step then takes 2.3 times as long (docs/benchmarks.md, "The host BLAS's kernels"). The choice is
// made before main() runs, so a process cannot change it: the remedy is OPENBLAS_CORETYPE in the
// environment of the next run. The tests' CMake sets it (tests/CMakeLists.txt) and the trainers say
// so (examples/common/launch.hpp).
#pragma once

#include <cblas.h>

#include <string>

namespace cupipe::backend::host {

/// OpenBLAS's name for the kernels it chose at load ("Cooperlake", "Haswell", "Prescott"), or ""
/// with another BLAS.
inline std::string blas_core() {
#ifdef OPENBLAS_VERSION
  const char* name = openblas_get_corename();
  return name ? std::string(name) : std::string();
#else
  return {};
#endif
}

/// The OPENBLAS_CORETYPE that gives this CPU its vector kernels when OpenBLAS fell back to the SSE3
/// ones ("SkylakeX" with AVX-512, "Haswell" with AVX2), or "" when the kernels in use are already
/// the CPU's (or the BLAS is not OpenBLAS, or the CPU not x86).
inline std::string better_blas_coretype() {
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
  std::string core = blas_core();
  for (char& c : core) c = char(c >= 'A' && c <= 'Z' ? c - 'A' + 'a' : c);
  if (core != "prescott") return {};
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f")) return "SkylakeX";
  if (__builtin_cpu_supports("avx2")) return "Haswell";
#endif
  return {};
}

/// A sentence for the user when better_blas_coretype() is not empty, else "".
inline std::string blas_core_advice() {
  const std::string better = better_blas_coretype();
  if (better.empty()) return {};
  return "OpenBLAS runs its generic SSE3 (Prescott) kernels on this CPU, which it does not know; run with "
         "OPENBLAS_CORETYPE=" + better + " in the environment for this CPU's vector kernels (about twice as fast)";
}

}  // namespace cupipe::backend::host
