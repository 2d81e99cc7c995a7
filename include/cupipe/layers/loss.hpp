// SPDX-License-Identifier: Apache-2.0
// SoftmaxCrossEntropy<Classes>: the loss at the end of a model. Logits (n, Classes) and int32 labels
// (n,) give the mean loss over the whole batch; the normalizer is the batch's sample count, so the
// microbatches of a split batch (ragged ones too) add up to exactly that mean.
#pragma once

#include <cmath>
#include <cstdint>
#include <string>

#include "cupipe/layers/layer.hpp"

namespace cupipe {

template <index_t Classes>
struct SoftmaxCrossEntropy : Stateless {
  static_assert(Classes > 1, "SoftmaxCrossEntropy<Classes> needs at least two classes");
  static constexpr index_t in_features = Classes;
  static constexpr index_t out_features_for(index_t) { return 1; }
  static constexpr bool is_loss = true;
  static constexpr double forward_flops_per_sample(index_t) { return 5.0 * Classes; }
  static std::string describe() { return "SoftmaxCrossEntropy<" + std::to_string(Classes) + ">"; }

  /// Writes the loss to `loss` (1,) in the backend's memory.
  template <class B, class T>
  static void forward(B& be, ConstView<T> logits, ConstView<std::int32_t> labels, TensorView<T> loss, index_t normalizer) {
    check<T>(logits, labels);
    softmax_cross_entropy_forward(be, logits, labels, loss, normalizer);
  }
  template <class B, class T>
  static void backward(B& be, ConstView<T> logits, ConstView<std::int32_t> labels, TensorView<T> dlogits,
                       index_t normalizer) {
    check<T>(logits, labels);
    softmax_cross_entropy_backward(be, logits, labels, dlogits, normalizer);
  }

  /// Throws when a loss computed from `logits` and `labels` is not finite.
  template <class T>
  static void check_finite(T loss, ConstView<T> logits, ConstView<std::int32_t> labels) {
    if (!std::isfinite(double(loss)))
      CUPIPE_THROW(describe(), ": the loss is not finite (", double(loss), ") for logits ", logits.shape(),
                   " and labels ", labels.shape());
  }

 private:
  template <class T>
  static void check(ConstView<T> logits, ConstView<std::int32_t> labels) {
    if (logits.cols() != Classes || labels.numel() != logits.rows())
      CUPIPE_THROW(describe(), ": expected logits (n, ", Classes, ") and labels (n,) but got logits ", logits.shape(),
                   " and labels ", labels.shape());
  }
};

}  // namespace cupipe
