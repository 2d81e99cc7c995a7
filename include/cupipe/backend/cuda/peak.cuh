// SPDX-License-Identifier: Apache-2.0
// The device's GEMM rate, measured: the denominator of MFU. A data-sheet peak is a constant that no
// kernel reaches (clocks, power, the math mode); the rate of a large square cuBLASLt product in the
// same math mode, timed on this device in this run, is what a training step's GEMMs could reach.
#pragma once

#include <algorithm>
#include <chrono>
#include <type_traits>
#include <vector>

#include "cupipe/backend/cuda/cuda.cuh"
#include "cupipe/backend/cuda/ops.cuh"

namespace cupipe::backend::cuda {

/// TFLOP/s of an n x n x n product on `device`: float inputs in `math` (fp32 or tf32), or with
/// `Storage` = bfloat16, bf16 inputs and output with fp32 accumulation (`math` is then unused). The
/// median of `timed` runs after 3 warm-ups, each bracketed by a device synchronisation. Allocates
/// 3 n^2 values (768 MiB of floats at 8192).
template <class Storage = float>
inline double measured_gemm_tflops(int device, MathMode math, index_t n = 8192, int timed = 10) {
  static_assert(std::is_same_v<Storage, float> || std::is_same_v<Storage, bfloat16>,
                "measured_gemm_tflops: float or bfloat16 products");
  CUPIPE_REQUIRE(n > 0 && timed > 0, "measured_gemm_tflops: n (", n, ") and timed (", timed, ") must be positive");
  using Backend = backend::Cuda<Storage, float>;
  Backend be(device);
  be.math = math;
  auto a = be.template allocate<Storage>(n * n, MemoryTag::workspace), b = be.template allocate<Storage>(n * n, MemoryTag::workspace),
       c = be.template allocate<Storage>(n * n, MemoryTag::workspace);
  const Shape s{n, n};
  ops::fill(be, DeviceView<Storage>{a.data(), s}, Storage(0.5f));
  ops::fill(be, DeviceView<Storage>{b.data(), s}, Storage(0.25f));
  std::vector<double> times;
  for (int i = 0; i < 3 + timed; ++i) {
    be.synchronize();
    const auto t0 = std::chrono::steady_clock::now();
    if constexpr (std::is_same_v<Storage, float>)
      ops::gemm(be, ops::Transpose::no, ops::Transpose::no, 1.0f, DeviceConstView<float>{a.data(), s},
                DeviceConstView<float>{b.data(), s}, 0.0f, DeviceView<float>{c.data(), s});
    else
      ops::gemm(be, ops::Transpose::no, ops::Transpose::no, ops::ComputeScalar{1.0f}, DeviceConstView<bfloat16>{a.data(), s},
                DeviceConstView<bfloat16>{b.data(), s}, ops::ComputeScalar{0.0f}, DeviceView<bfloat16>{c.data(), s});
    be.synchronize();
    if (i >= 3) times.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  std::sort(times.begin(), times.end());
  return 2.0 * double(n) * double(n) * double(n) / times[times.size() / 2] / 1e12;
}

}  // namespace cupipe::backend::cuda
