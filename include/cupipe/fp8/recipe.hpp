// SPDX-License-Identifier: Apache-2.0
// The FP8 recipes a model trains with (issue #59), and the emulation of a layer's GEMM under each:
// what backend::HostFp8<Recipe> runs for every GEMM of a Linear or an attention projection, and the
// oracle of the CUDA path.
//
// A layer's GEMMs are of three kinds (GemmRole): the forward y = x W^T, the input gradient
// dx = dy W and the weight gradient dW = dy^T x. Written as A (m x k) times B (n x k) transposed:
//
//   | role        | A      | B     | k        |
//   |-------------|--------|-------|----------|
//   | forward     | x      | W     | features |
//   | input_grad  | dy     | W^T   | outputs  |
//   | weight_grad | dy^T   | x^T   | rows     |
//
// Each operand is quantised from its high-precision copy as it stands in that GEMM: the scales of
// a tensor and of its transpose are computed separately (DeepSeek-V3's recipe), so a tile of the
// weight gradient runs along the rows, not along the features.
// - Blockwise (DeepSeek-V3): E4M3 everywhere; A in 1 x 128 tiles, B in 128 x 128 blocks where it is
//   a weight and in 1 x 128 tiles where it is an activation (weight_grad). No state, no collective.
// - PerTensorDelayed (TransformerEngine's DelayedScaling, format HYBRID): E4M3 for x and W, E5M2 for
//   the gradient dy, one scale per tensor from the amax history of that operand (fp8/
//   delayed_scaling.hpp). The first use of an operand has no history: its own amax is recorded
//   first, so step 1 does not quantise at scale 1.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <map>
#include <string_view>
#include <tuple>

#include "cupipe/core/error.hpp"
#include "cupipe/core/float8.hpp"
#include "cupipe/core/tensor.hpp"
#include "cupipe/fp8/blocks.hpp"
#include "cupipe/fp8/delayed_scaling.hpp"

namespace cupipe::fp8 {

/// Which of a layer's GEMMs: y = x W^T, dx = dy W, or dW = dy^T x.
enum class GemmRole : std::uint8_t { forward, input_grad, weight_grad };

/// DeepSeek-V3's fine-grained recipe: E4M3, 1 x 128 activation tiles, 128 x 128 weight blocks.
struct Blockwise {
  static constexpr std::string_view name = "fp8-block";
};

/// TransformerEngine's delayed scaling: one scale per tensor from the last `history` amaxes, E4M3
/// forward and E5M2 gradients.
struct PerTensorDelayed {
  static constexpr std::string_view name = "fp8-delayed";
  static constexpr int history = 16, margin = 0;
};

/// The largest magnitude of x (0 for an empty x).
inline float amax_of(ConstView<float> x) {
  float seen = 0;
  for (index_t i = 0; i < x.numel(); ++i) seen = std::max(seen, std::abs(x[i]));
  return seen;
}

/// Runs a layer's GEMMs the way Recipe computes them, with any state the recipe keeps.
template <class Recipe>
class GemmEmulator;

template <>
class GemmEmulator<Blockwise> {
 public:
  /// acc (m x n) = A (m x k) B^T (B: n x k) from their FP8 codes and block scales. `key` names the
  /// layer's tensor (unused: block scaling keeps no state).
  void run(GemmRole role, const void* /*key*/, ConstView<float> a, ConstView<float> b, TensorView<float> acc) {
    const auto qa = quantize<ActivationTiles>(a);
    if (role == GemmRole::weight_grad) gemm_nt(qa, quantize<ActivationTiles>(b), acc);
    else gemm_nt(qa, quantize<WeightBlocks>(b), acc);
  }
};

template <>
class GemmEmulator<PerTensorDelayed> {
 public:
  /// acc (m x n) = A (m x k) B^T from their FP8 codes at the scales of their histories, then each
  /// operand's amax is recorded in its history. `key` names the layer's tensor (its weight for the
  /// forward and the input gradient, its weight gradient for the weight gradient): each (key, role,
  /// operand) has a history of its own.
  void run(GemmRole role, const void* key, ConstView<float> a, ConstView<float> b, TensorView<float> acc) {
    auto& hb = history(b_, key, role);
    if (role == GemmRole::forward) {
      gemm_nt(quantize(history(a4_, key, role), a), quantize(hb, b), acc);
    } else {
      gemm_nt(quantize(history(a5_, key, role), a), quantize(hb, b), acc);
    }
  }

  /// The scale the next GEMM of this (key, role) quantises operand A (`a`: true) or B with; 1 for one
  /// never run.
  float scale(const void* key, GemmRole role, bool a) const {
    const auto find = [&](const auto& map) {
      const auto it = map.find({key, role});
      return it == map.end() ? 1.0f : it->second.scale();
    };
    return a ? (role == GemmRole::forward ? find(a4_) : find(a5_)) : find(b_);
  }

 private:
  using Key = std::tuple<const void*, GemmRole>;
  template <class F>
  using Histories = std::map<Key, DelayedScaling<F>>;

  template <class F>
  static DelayedScaling<F>& history(Histories<F>& map, const void* key, GemmRole role) {
    return map.try_emplace({key, role}, PerTensorDelayed::history, PerTensorDelayed::margin).first->second;
  }
  /// x at its history's scale, its amax recorded after it (before it, on the operand's first use).
  template <class F>
  static Quantized<F> quantize(DelayedScaling<F>& h, ConstView<float> x) {
    const bool first = !h.recorded();
    if (first) h.record(amax_of(x));
    float amax = 0;
    Quantized<F> q = h.quantize(x, &amax);
    if (!first) h.record(amax);
    return q;
  }

  Histories<float8_e4m3> a4_, b_;
  Histories<float8_e5m2> a5_;
};

}  // namespace cupipe::fp8
