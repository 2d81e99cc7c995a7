// SPDX-License-Identifier: Apache-2.0
// SoftmaxCrossEntropy<Classes>: the loss at the end of a model. Logits (n, Classes) and int32 labels
// (n,) give the mean loss over the whole batch; the normalizer is the batch's sample count, so the
// microbatches of a split batch (ragged ones too) add up to exactly that mean.
#pragma once

#include <cmath>
#include <cstdint>
#include <span>
#include <string>

#include "cupipe/core/memory.hpp"
#include "cupipe/layers/layer.hpp"

namespace cupipe {

namespace detail {
/// Throws, naming the loss layer (`loss_layer()`, called only then) and the shapes, when a loss is not finite.
template <class L, class T, class Space>
void check_loss_finite(std::string (*loss_layer)(), L loss, TensorView<const T, Space> logits,
                       TensorView<const std::int32_t, Space> labels) {
  if (!std::isfinite(double(loss)))
    CUPIPE_THROW(loss_layer(), ": the loss is not finite (", double(loss), ") for logits ", logits.shape(), " and labels ",
                 labels.shape());
}
}  // namespace detail

template <index_t Classes>
struct SoftmaxCrossEntropy : LayerDefaults {
  static_assert(Classes > 1, "SoftmaxCrossEntropy<Classes> needs at least two classes");
  static constexpr index_t classes = Classes;
  static constexpr index_t in_features = Classes;
  static constexpr index_t out_features_for(index_t) { return 1; }
  static constexpr bool is_loss = true;
  static constexpr double forward_flops_per_sample(index_t) { return 5.0 * Classes; }
  static std::string describe() { return "SoftmaxCrossEntropy<" + std::to_string(Classes) + ">"; }

  /// Writes the loss to `loss` (1,) in the backend's memory: logits in the storage precision, the
  /// loss in the compute precision (the same type, except for bf16 storage).
  template <class B, class L>
  static void forward(B& be, ConstViewOn<B, typename B::value_type> logits, ConstViewOn<B, std::int32_t> labels, ViewOn<B, L> loss,
                      index_t normalizer) {
    check<typename B::value_type>(logits, labels);
    softmax_cross_entropy_forward(be, logits, labels, loss, normalizer);
  }
  template <class B, class T>
  static void backward(B& be, ConstViewOn<B, T> logits, ConstViewOn<B, std::int32_t> labels, ViewOn<B, T> dlogits,
                       index_t normalizer) {
    check<T>(logits, labels);
    softmax_cross_entropy_backward(be, logits, labels, dlogits, normalizer);
  }

  /// Throws when a loss computed from `logits` and `labels` is not finite.
  template <class L, class T, class Space>
  static void check_finite(L loss, TensorView<const T, Space> logits, TensorView<const std::int32_t, Space> labels) {
    detail::check_loss_finite(&describe, loss, logits, labels);
  }

 private:
  template <class T, class Space>
  static void check(TensorView<const T, Space> logits, TensorView<const std::int32_t, Space> labels) {
    if (logits.cols() != Classes || labels.numel() != logits.rows())
      CUPIPE_THROW(describe(), ": expected logits (n, ", Classes, ") and labels (n,) but got logits ", logits.shape(),
                   " and labels ", labels.shape());
  }
};

/// The loss of `logits` against `labels`, divided by `normalizer`, as a host value in the backend's
/// compute precision: runs Loss::forward on `be` and reads the result back. With check_finite, a loss
/// that is not finite throws, naming the shapes. The one place a pipeline stage and Network evaluate
/// a loss.
template <class Loss, class B>
grad_t<B> loss_value(B& be, ConstViewOn<B, typename B::value_type> logits, ConstViewOn<B, std::int32_t> labels,
                     index_t normalizer, bool check_finite) {
  using T = grad_t<B>;
  auto loss = be.template allocate<T>(1, MemoryTag::workspace);
  Loss::forward(be, logits, labels, ViewOn<B, T>{loss.data(), Shape{1}}, normalizer);
  T value{};
  be.download(loss.data(), std::span<T>(&value, 1));
  if (check_finite) Loss::check_finite(value, logits, labels);
  return value;
}

}  // namespace cupipe
