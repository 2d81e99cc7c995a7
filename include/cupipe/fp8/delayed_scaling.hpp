// SPDX-License-Identifier: Apache-2.0
// FP8 per-tensor delayed scaling (TransformerEngine's DelayedScaling), emulated on the host: the
// other recipe of issue #59, beside block scaling (fp8/blocks.hpp).
//
// One scale per tensor, taken from the amaxes of the steps before: the largest of the last `history`
// recorded, over the format's largest value, times 2^margin. A value larger than that amax
// saturates to the format's largest code. The scale is known before the tensor is, so a kernel can
// quantise in the producer's epilogue without a pass over the tensor first. The price is the amax
// history: under tensor parallelism each rank's amax must be reduced over its group before it is
// recorded, or the ranks' scales differ. That reduction is the collective that hangs FP8 with
// pipeline parallelism in other frameworks when some ranks skip it (issue #59); block scaling needs
// none. The reduction is the caller's: record() takes the amax the group agreed on.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <deque>

#include "cupipe/core/error.hpp"
#include "cupipe/core/float8.hpp"
#include "cupipe/core/tensor.hpp"
#include "cupipe/fp8/blocks.hpp"

namespace cupipe::fp8 {

template <class Format = float8_e4m3>
class DelayedScaling {
 public:
  /// `history`: how many steps' amaxes the scale looks back over (at least 1); `margin`: the scale
  /// is 2^margin times larger than the amax needs (headroom for growth between steps).
  explicit DelayedScaling(int history = 16, int margin = 0) : history_(history), margin_(margin) {
    CUPIPE_REQUIRE(history >= 1, "fp8::DelayedScaling: the amax history holds at least 1 step, got ", history);
    CUPIPE_REQUIRE(margin >= 0, "fp8::DelayedScaling: the margin is a non-negative power of two, got ", margin);
  }

  /// The scale the next tensor is quantised with: the history's largest amax over Format::max,
  /// times 2^margin; 1 before any amax is recorded, or while every recorded amax is 0.
  float scale() const {
    const float amax = amaxes_.empty() ? 0.0f : *std::max_element(amaxes_.begin(), amaxes_.end());
    return amax > 0 ? std::ldexp(amax / float(Format::max), margin_) : 1.0f;
  }

  /// x as one block (the whole tensor) at scale(), each code rounded to nearest even and saturating
  /// (a value beyond the history's amax becomes the largest code). x's own amax is returned for the
  /// caller to reduce over its tensor-parallel group, if any, and record(); it is not recorded here.
  Quantized<Format> quantize(ConstView<float> x, float* amax = nullptr) const {
    check_view(x, x.shape(), "fp8::DelayedScaling::quantize", "x");
    Quantized<Format> q;
    q.rows = x.rows();
    q.cols = x.cols();
    q.block_rows = std::max<index_t>(q.rows, 1);
    q.block_cols = std::max<index_t>(q.cols, 1);
    const float s = scale();
    q.scales.assign(1, s);
    q.codes.resize(std::size_t(x.numel()));
    float seen = 0;
    for (index_t i = 0; i < x.numel(); ++i) {
      const float v = x[i];
      if (!std::isfinite(v)) CUPIPE_THROW("fp8::DelayedScaling::quantize: element ", i, " of x is ", v, ", which FP8 cannot hold");
      seen = std::max(seen, std::abs(v));
      q.codes[std::size_t(i)] = Format::from_float(v / s);
    }
    if (amax) *amax = seen;
    return q;
  }

  /// Whether any amax has been recorded.
  bool recorded() const noexcept { return !amaxes_.empty(); }

  /// Adds one step's amax (after any reduction over the group); the oldest beyond `history` goes.
  void record(float amax) {
    CUPIPE_REQUIRE(std::isfinite(amax) && amax >= 0, "fp8::DelayedScaling::record: an amax is finite and >= 0, got ", amax);
    amaxes_.push_back(amax);
    if (amaxes_.size() > std::size_t(history_)) amaxes_.pop_front();
  }

 private:
  int history_, margin_;
  std::deque<float> amaxes_;
};

}  // namespace cupipe::fp8
