// SPDX-License-Identifier: Apache-2.0
// backend::HostFp8<Recipe>: backend::Host<bfloat16, float> whose layer GEMMs run in FP8 under Recipe
// (fp8::Blockwise or fp8::PerTensorDelayed, fp8/recipe.hpp), emulated on the CPU: the oracle of the
// CUDA FP8 path and a way to see what FP8 does to a model's training without a GPU.
//
// Everything but the GEMMs is Host<bfloat16, float>'s: bf16 weights in use, activations and
// messages; fp32 master weights, gradients, optimizer state, LayerNorm, attention and the loss. Each
// GEMM of a layer (Linear's and attention's projections) quantises its two operands from their bf16
// values, multiplies the codes block by block with fp32 accumulation (fp8::gemm_nt), and writes its
// output as the bf16 op does: rounded once to bf16, or added in fp32 into a weight gradient.
// The role of a GEMM is read from its transposes, the convention every layer follows:
// (no, yes) y = x W^T; (no, no) dx = dy W; (yes, no) dW = dy^T x.
#pragma once

#include <string_view>
#include <vector>

#include "cupipe/backend/host/ops_bf16.hpp"
#include "cupipe/fp8/recipe.hpp"

namespace cupipe::backend {

template <class Recipe>
struct HostFp8 : Host<bfloat16, float> {
  using recipe = Recipe;
  static constexpr std::string_view name = Recipe::name;

  /// The recipe's state (the amax histories of delayed scaling), one per stage as the context is.
  fp8::GemmEmulator<Recipe> fp8;

  /// Closes a step where the recipe keeps state (backend::end_step): delayed scaling records the
  /// step's amaxes, taken over the context's tensor-parallel group.
  void end_step()
    requires requires(fp8::GemmEmulator<Recipe>& e, TensorGroup* g) { e.end_step(g); }
  {
    fp8.end_step(tensor_group);
  }
  /// Inference (backend::Inference) leaves delayed scaling's step amaxes alone.
  void inference(bool on)
    requires requires(fp8::GemmEmulator<Recipe>& e) { e.scales().recording; }
  {
    fp8.scales().recording = !on;
  }
};

}  // namespace cupipe::backend

namespace cupipe::ops {

namespace detail {

/// op(v) as a row-major float matrix: v itself, or its transpose copied.
inline std::vector<float> as_rows(TensorView<float> v, Transpose t, index_t& rows, index_t& cols) {
  rows = t == Transpose::no ? v.rows() : v.cols();
  cols = t == Transpose::no ? v.cols() : v.rows();
  std::vector<float> out(std::size_t(rows * cols));
  for (index_t r = 0; r < rows; ++r)
    for (index_t c = 0; c < cols; ++c)
      out[std::size_t(r * cols + c)] = t == Transpose::no ? v[r * cols + c] : v[c * rows + r];
  return out;
}

/// The m x n product of an FP8 GEMM, in fp32.
struct Fp8Product {
  index_t m = 0, n = 0;
  std::vector<float> values;
};

/// op(a) op(b) in FP8 under be's recipe, the role read from the transposes; c (m x n) checked.
template <class R, class C>
Fp8Product fp8_product(backend::HostFp8<R>& be, Transpose ta, Transpose tb, ConstView<bfloat16> a,
                               ConstView<bfloat16> b, const TensorView<C>& c, std::string_view op) {
  CUPIPE_REQUIRE(tb == Transpose::no || ta == Transpose::no,
                 op, " on an FP8 backend: a layer's GEMMs are x W^T, dy W or dy^T x; op(a) op(b) with both transposed is "
                     "none of them");
  const fp8::GemmRole role = ta == Transpose::yes   ? fp8::GemmRole::weight_grad
                             : tb == Transpose::yes ? fp8::GemmRole::forward
                                                    : fp8::GemmRole::input_grad;
  auto wa = in(a, op, "a"), wb = in(b, op, "b");
  index_t m = 0, k = 0, n = 0, kb = 0;
  // A is op(a); B, stored n x k, is op(b) transposed: b itself when tb is yes.
  const std::vector<float> am = as_rows(wa.view(), ta, m, k);
  const std::vector<float> bm = as_rows(wb.view(), tb == Transpose::yes ? Transpose::no : Transpose::yes, n, kb);
  CUPIPE_REQUIRE(k == kb, op, ": op(a) is (", m, ", ", k, ") and op(b) (", kb, ", ", n, "): the inner sizes differ");
  check_view(c, Shape{m, n}, op, "c");
  Fp8Product p{m, n, std::vector<float>(std::size_t(m * n))};
  const void* key = role == fp8::GemmRole::weight_grad ? static_cast<const void*>(c.data()) : static_cast<const void*>(b.data());
  be.fp8.run(role, key, ConstView<float>{am.data(), Shape{m, k}}, ConstView<float>{bm.data(), Shape{n, k}},
             TensorView<float>{p.values.data(), Shape{m, n}});
  return p;
}

}  // namespace detail

/// c = alpha op(a) op(b) + beta c, the product in FP8 (backend/host/fp8.hpp); c rounded once to bf16.
template <class R>
void gemm(backend::HostFp8<R>& be, Transpose ta, Transpose tb, ComputeScalar alpha, ConstView<bfloat16> a,
          ConstView<bfloat16> b, ComputeScalar beta, TensorView<bfloat16> c) {
  const std::vector<float> p = detail::fp8_product(be, ta, tb, a, b, c, "gemm").values;
  auto wc = beta.value != 0.0f ? detail::inout(c, "gemm", "c") : detail::out(c, "gemm", "c");
  const TensorView<float> v = wc.view();
  for (index_t i = 0; i < v.numel(); ++i) v[i] = alpha.value * p[std::size_t(i)] + (beta.value != 0.0f ? beta.value * v[i] : 0.0f);
  wc.store(c);
}

/// c = alpha op(a) op(b) + beta c into a float c (a weight gradient, accumulated in fp32).
template <class R>
void gemm(backend::HostFp8<R>& be, Transpose ta, Transpose tb, ComputeScalar alpha, ConstView<bfloat16> a,
          ConstView<bfloat16> b, ComputeScalar beta, TensorView<float> c) {
  const std::vector<float> p = detail::fp8_product(be, ta, tb, a, b, c, "gemm").values;
  for (index_t i = 0; i < c.numel(); ++i) c[i] = alpha.value * p[std::size_t(i)] + (beta.value != 0.0f ? beta.value * c[i] : 0.0f);
}

/// y = alpha op(a) op(b) + bias, the product in FP8, the bias added in fp32 and y rounded once.
template <class R>
void gemm_bias(backend::HostFp8<R>& be, Transpose ta, Transpose tb, ComputeScalar alpha, ConstView<bfloat16> a,
               ConstView<bfloat16> b, ConstView<bfloat16> bias, TensorView<bfloat16> y) {
  check_view(bias, Shape{y.cols()}, "gemm_bias", "bias");
  const std::vector<float> p = detail::fp8_product(be, ta, tb, a, b, y, "gemm_bias").values;
  const index_t cols = y.cols();
  for (index_t i = 0; i < y.numel(); ++i)
    y[i] = bfloat16(alpha.value * p[std::size_t(i)] + float(bias[i % cols]));
}

}  // namespace cupipe::ops
