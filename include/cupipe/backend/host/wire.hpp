// SPDX-License-Identifier: Apache-2.0
// The host's hand-over round trip (ops::wire_round_trip, core/wire.hpp): the reference for the CUDA
// op (backend/cuda/ops.cuh), which must give the same bits in float.
#pragma once

#include <algorithm>
#include <cmath>
#include <type_traits>

#include "cupipe/backend/host/host.hpp"
#include "cupipe/backend/op_checks.hpp"
#include "cupipe/core/dtype.hpp"
#include "cupipe/core/float8.hpp"
#include "cupipe/core/tensor.hpp"
#include "cupipe/core/wire.hpp"

namespace cupipe::ops {

/// y = x as a hand-over of precision `wire` delivers it (core/wire.hpp): bf16 rounds each value to
/// bfloat16 (nearest even); e4m3 scales by 448 / max|x|, rounds each value to FP8 E4M3 (nearest even,
/// saturating) and divides by the scale, in T's arithmetic, as the CUDA op does. A tensor of zeros
/// or with a non-finite value passes unchanged, so a later finite check still sees it. y may alias x.
template <class T>
void wire_round_trip(backend::Host<T>&, ConstView<T> x, TensorView<T> y, Wire wire) {
  checks::wire_round_trip(x, y);
  const index_t n = x.numel();
  if (wire == Wire::bf16) {
    for (index_t i = 0; i < n; ++i) {
      if constexpr (std::is_same_v<T, float>) y[i] = float(bfloat16(x[i]));
      else y[i] = T(bfloat16_round_trip(double(x[i])));
    }
    return;
  }
  T amax = 0;
  bool finite = true;
  for (index_t i = 0; i < n; ++i) {
    finite = finite && std::isfinite(x[i]);
    amax = std::max(amax, std::abs(x[i]));
  }
  if (wire == Wire::full || !finite || amax == T(0)) {
    if (y.data() != x.data()) std::copy_n(x.data(), n, y.data());
    return;
  }
  const T scale = T(float8_e4m3::max) / amax;
  for (index_t i = 0; i < n; ++i) y[i] = T(float(float8_e4m3(double(x[i] * scale)))) / scale;
}

}  // namespace cupipe::ops
