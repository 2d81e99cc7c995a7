// SPDX-License-Identifier: Apache-2.0
// FP8 block scaling, DeepSeek-V3's recipe (issue #59), emulated on the host: the oracle for the
// CUDA path. A tensor is FP8 codes with one fp32 scale per block:
// - activations per 1 x 128 tile of a row (ActivationTiles);
// - weights per 128 x 128 block (WeightBlocks).
// Each block's scale maps its largest magnitude to the format's largest value. So an outlier costs
// precision only in its own block, and no scale needs a collective: there is no amax to reduce
// across ranks, which is what hangs FP8 under pipeline parallelism in other frameworks.
//
// gemm_nt multiplies the codes block by block along K. Within one block of 128 the products are
// summed in fp32 (by the host BLAS), as the tensor cores' accumulator does. Each block's sum is then
// multiplied by both blocks' scales and added into an fp32 accumulator: DeepSeek's promotion every
// 128 elements of K, which keeps the long sums of K out of the tensor cores' narrower accumulator.
#pragma once

#include <cblas.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <vector>

#include "cupipe/core/error.hpp"
#include "cupipe/core/float8.hpp"
#include "cupipe/core/shape.hpp"
#include "cupipe/core/tensor.hpp"

namespace cupipe::fp8 {

/// Blocks of R rows x C columns, each with its own scale.
template <index_t R, index_t C>
struct BlockScaled {
  static_assert(R >= 1 && C >= 1, "a block has at least one row and one column");
  static constexpr index_t rows = R, cols = C;
};
using ActivationTiles = BlockScaled<1, 128>;
using WeightBlocks = BlockScaled<128, 128>;

/// A block-scaled tensor in host memory: rows x cols codes, row-major, and one scale per block,
/// ceil(rows / block_rows) x ceil(cols / block_cols), row-major. Blocks at the right and bottom
/// edges may be smaller.
template <class Format = float8_e4m3>
struct Quantized {
  index_t rows = 0, cols = 0, block_rows = 1, block_cols = 1;
  std::vector<Format> codes;
  std::vector<float> scales;

  index_t scale_rows() const noexcept { return (rows + block_rows - 1) / block_rows; }
  index_t scale_cols() const noexcept { return (cols + block_cols - 1) / block_cols; }
  /// The scale of the block that holds element (r, c).
  float scale(index_t r, index_t c) const noexcept {
    return scales[std::size_t((r / block_rows) * scale_cols() + c / block_cols)];
  }
  /// Element (r, c) as the tensor stands for it: its code times its block's scale, in fp32.
  float value(index_t r, index_t c) const noexcept { return float(codes[std::size_t(r * cols + c)]) * scale(r, c); }
};

/// x in blocks of `Blocks`, in `Format` (float8_e4m3, or float8_e5m2 for gradients): each block's
/// scale is its largest magnitude over Format::max, in fp32 (1 for a block of zeros, whose codes keep
/// their signs); each code is the value over that scale, rounded to nearest even and saturating. A
/// value that is not finite has no FP8 code that keeps it: it is refused, naming the element.
template <class Blocks, class Format = float8_e4m3>
Quantized<Format> quantize(ConstView<float> x) {
  check_view(x, x.shape(), "fp8::quantize", "x");
  CUPIPE_REQUIRE(x.shape().rank() == 2, "fp8::quantize: x must be a matrix (rows, cols), got ", x.shape());
  Quantized<Format> q;
  q.rows = x.rows();
  q.cols = x.cols();
  q.block_rows = Blocks::rows;
  q.block_cols = Blocks::cols;
  q.codes.resize(std::size_t(q.rows * q.cols));
  q.scales.assign(std::size_t(q.scale_rows() * q.scale_cols()), 1.0f);
  for (index_t br = 0; br < q.scale_rows(); ++br)
    for (index_t bc = 0; bc < q.scale_cols(); ++bc) {
      const index_t r0 = br * q.block_rows, r1 = std::min(q.rows, r0 + q.block_rows);
      const index_t c0 = bc * q.block_cols, c1 = std::min(q.cols, c0 + q.block_cols);
      float amax = 0;
      for (index_t r = r0; r < r1; ++r)
        for (index_t c = c0; c < c1; ++c) {
          const float v = x[r * q.cols + c];
          if (!std::isfinite(v))
            CUPIPE_THROW("fp8::quantize: element (", r, ", ", c, ") of x is ", v, ", which FP8 cannot hold");
          amax = std::max(amax, std::abs(v));
        }
      const float scale = amax > 0 ? amax / float(Format::max) : 1.0f;
      q.scales[std::size_t(br * q.scale_cols() + bc)] = scale;
      for (index_t r = r0; r < r1; ++r)
        for (index_t c = c0; c < c1; ++c)
          q.codes[std::size_t(r * q.cols + c)] = Format::from_float(x[r * q.cols + c] / scale);
    }
  return q;
}

/// y = the values q stands for (Quantized::value), y of q's shape.
template <class Format>
void dequantize(const Quantized<Format>& q, TensorView<float> y) {
  check_view(y, Shape{q.rows, q.cols}, "fp8::dequantize", "y");
  for (index_t r = 0; r < q.rows; ++r)
    for (index_t c = 0; c < q.cols; ++c) y[r * q.cols + c] = q.value(r, c);
}

/// The 256 values of Format's codes in fp32, indexed by bits (a NaN code gives NaN).
template <class Format>
const std::array<float, 256>& code_values() {
  static const std::array<float, 256> values = [] {
    std::array<float, 256> v{};
    for (int b = 0; b < 256; ++b) v[std::size_t(b)] = float(Format::from_bits(std::uint8_t(b)));
    return v;
  }();
  return values;
}

/// y (m x n) = x (m x k) times w (n x k) transposed, from their codes, as the CUDA path must compute
/// it: for each block of k (the blocks of both must be as wide along k, 128 in the recipes), the
/// products of the codes summed in fp32 (each product of two FP8 values is exact in fp32; the order
/// of the sum is the BLAS's), then times x's scale and w's scale for that block, added into an fp32
/// accumulator in k's order: DeepSeek's promotion.
template <class FormatX, class FormatW>
void gemm_nt(const Quantized<FormatX>& x, const Quantized<FormatW>& w, TensorView<float> y) {
  CUPIPE_REQUIRE(x.cols == w.cols, "fp8::gemm_nt: x is (", x.rows, ", ", x.cols, ") and w (", w.rows, ", ", w.cols,
                 "): their columns (k) differ");
  CUPIPE_REQUIRE(x.block_cols == w.block_cols, "fp8::gemm_nt: x's blocks are ", x.block_cols, " wide along k and w's ",
                 w.block_cols, ": the scales must change at the same k");
  check_view(y, Shape{x.rows, w.rows}, "fp8::gemm_nt", "y");
  const index_t m = x.rows, n = w.rows, k = x.cols, step = x.block_cols;
  const auto& xv = code_values<FormatX>();
  const auto& wv = code_values<FormatW>();
  std::fill_n(y.data(), m * n, 0.0f);
  std::vector<float> a(std::size_t(m * std::min(step, k))), b(std::size_t(n * std::min(step, k))), part(std::size_t(m * n));
  for (index_t k0 = 0; k0 < k; k0 += step) {
    const index_t width = std::min(step, k - k0);
    for (index_t i = 0; i < m; ++i)
      for (index_t kk = 0; kk < width; ++kk) a[std::size_t(i * width + kk)] = xv[x.codes[std::size_t(i * k + k0 + kk)].bits];
    for (index_t j = 0; j < n; ++j)
      for (index_t kk = 0; kk < width; ++kk) b[std::size_t(j * width + kk)] = wv[w.codes[std::size_t(j * k + k0 + kk)].bits];
    if (m > 0 && n > 0)
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, int(m), int(n), int(width), 1.0f, a.data(), int(width), b.data(),
                  int(width), 0.0f, part.data(), int(n));
    for (index_t i = 0; i < m; ++i) {
      const float sx = x.scale(i, k0);
      for (index_t j = 0; j < n; ++j) y[i * n + j] += part[std::size_t(i * n + j)] * sx * w.scale(j, k0);
    }
  }
}

}  // namespace cupipe::fp8
