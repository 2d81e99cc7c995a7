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
//   delayed_scaling.hpp), kept in a fp8::DelayedScales book (fp8/delayed_scales.hpp). The scales
//   stay fixed through a step: each GEMM adds its operands' amaxes to the step's, and end_step (once
//   per update, backend/step_hooks.hpp) reduces them over the tensor-parallel group in one collective
//   and records them. So every synchronous schedule
//   quantises alike, and a sharded tensor is scaled as the whole tensor. The first step has no
//   history: each operand is then scaled by its own amax, so step 1 does not quantise at scale 1.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <string_view>

#include "cupipe/core/error.hpp"
#include "cupipe/core/float8.hpp"
#include "cupipe/core/tensor.hpp"
#include "cupipe/core/tensor_group.hpp"
#include "cupipe/fp8/blocks.hpp"
#include "cupipe/fp8/delayed_scales.hpp"
#include "cupipe/fp8/delayed_scaling.hpp"

namespace cupipe::fp8 {

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
  /// acc (m x n) = A (m x k) B^T from their FP8 codes at the scales of their histories; each
  /// operand's amax joins the step's. `key` names the layer's tensor (its weight for the forward and
  /// the input gradient, its weight gradient for the weight gradient): each (key, role, operand) has
  /// a history of its own (fp8/delayed_scales.hpp). An operand with no history yet (the first step)
  /// is scaled by its own amax.
  void run(GemmRole role, const void* key, ConstView<float> a, ConstView<float> b, TensorView<float> acc) {
    const std::size_t e = scales_.entry(key, role);
    const Quantized<float8_e4m3> qb = quantize(e, Operand::b, scales_.e4m3_history(e, Operand::b), b);
    if (role == GemmRole::forward) gemm_nt(quantize(e, Operand::a, scales_.e4m3_history(e, Operand::a), a), qb, acc);
    else gemm_nt(quantize(e, Operand::a, scales_.e5m2_history(e), a), qb, acc);
  }

  /// The scale the next GEMM of this (key, role) quantises operand A (`a`: true) or B with; 1 for one
  /// with no history yet.
  float scale(const void* key, GemmRole role, bool a) const {
    const std::size_t* e = scales_.find(key, role);
    return e ? scales_.scale(*e, a ? Operand::a : Operand::b) : 1.0f;
  }

  /// Closes a step (DelayedScales::end_step): the step's amaxes, over `group` if any, join the histories.
  void end_step(TensorGroup* group) { scales_.end_step(group); }

  /// The book: entries, scales, histories.
  DelayedScales& scales() noexcept { return scales_; }
  const DelayedScales& scales() const noexcept { return scales_; }

 private:
  /// x at its history's scale (at its own amax's where it has none); its amax joins the step's.
  template <class F>
  Quantized<F> quantize(std::size_t e, Operand o, const DelayedScaling<F>& h, ConstView<float> x) {
    float amax = 0;
    Quantized<F> q;
    if (h.recorded()) {
      q = h.quantize(x, &amax);
    } else {
      DelayedScaling<F> own(1, PerTensorDelayed::margin);
      own.record(amax_of(x));
      q = own.quantize(x, &amax);
    }
    scales_.add(e, o, amax);
    return q;
  }

  DelayedScales scales_{PerTensorDelayed::history, PerTensorDelayed::margin};
};

}  // namespace cupipe::fp8
