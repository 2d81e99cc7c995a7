// SPDX-License-Identifier: Apache-2.0
// GEMM ops on backend::Cuda<T>, through cuBLASLt with plans cached per problem (gemm_plan.cuh).
//   gemm            c = alpha op(a) op(b) + beta c                  (the host op's contract)
//   gemm_bias       y = alpha op(a) op(b) + bias                    (bias fused into the epilogue)
//   gemm_bias_gelu  y = gelu(alpha op(a) op(b) + bias), pre = the argument of gelu (optional)
//   gemm_bias_grad  dw = alpha dy^T x + beta dw, dbias += column sums of dy (Linear's weight
//                   gradient; the bias gradient from the GEMM's BGRADB epilogue)
//   gemm_dgelu      d = (alpha op(a) op(b)) * gelu'(pre) (a Linear's input gradient carried
//                   through the GELU before it: cuBLASLt's DGELU epilogue)
//   gemm on bf16 a and b: fp32 accumulation, c in fp32 or bf16
// Where cuBLASLt cannot fuse an epilogue (double, k == 0, an unaligned bias or auxiliary matrix, or
// no algorithm from the heuristic), the same result comes from the plain product followed by the
// elementwise and reduction kernels; so does a GELU epilogue on float in MathMode::fp32 (see
// gelu_epilogue_allowed).
#pragma once

#include <cublasLt.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <string_view>
#include <type_traits>

#include "cupipe/backend/cuda/check.cuh"
#include "cupipe/backend/cuda/cuda.cuh"
#include "cupipe/backend/cuda/device_guard.cuh"
#include "cupipe/backend/cuda/gemm_plan.cuh"
#include "cupipe/backend/cuda/kernels/elementwise.cuh"
#include "cupipe/backend/cuda/kernels/reduce.cuh"
#include "cupipe/backend/cuda/nvtx.cuh"
#include "cupipe/backend/cuda/stream.cuh"
#include "cupipe/backend/op_checks.hpp"
#include "cupipe/backend/op_types.hpp"
#include "cupipe/core/dtype.hpp"
#include "cupipe/core/error.hpp"
#include "cupipe/core/tensor.hpp"

namespace cupipe::backend::cuda::detail {

template <class X> inline constexpr cudaDataType_t cuda_type = CUDA_R_32F;
template <> inline constexpr cudaDataType_t cuda_type<double> = CUDA_R_64F;
template <> inline constexpr cudaDataType_t cuda_type<bfloat16> = CUDA_R_16BF;

/// One product through a cached plan: c = alpha op(a) op(b) + beta c, with `epilogue` applied.
/// Returns false, having launched nothing, when cuBLASLt has no algorithm for a fused epilogue.
template <class T, class BC, class AB, class C, class S>
[[nodiscard]] bool lt_matmul(backend::Cuda<T, BC>& be, ops::Transpose ta, ops::Transpose tb, S alpha, const AB* a, index_t lda,
                             const AB* b, index_t ldb, S beta, C* c, index_t m, index_t n, index_t k,
                             backend::cuda::GemmEpilogue epilogue, const C* bias = nullptr, const C* aux = nullptr) {
  backend::cuda::Context& ctx = be.context();
  backend::cuda::GemmKey key;
  key.m = m, key.n = n, key.k = k;
  key.lda = lda, key.ldb = ldb, key.ldc = n;
  key.ta = ta, key.tb = tb;
  key.ab_type = cuda_type<AB>;
  key.c_type = cuda_type<C>;
  if constexpr (std::is_same_v<AB, double>) {
    key.compute = CUBLAS_COMPUTE_64F;
    key.scale_type = CUDA_R_64F;
  } else {
    key.compute = std::is_same_v<AB, float> && be.math == backend::cuda::MathMode::tf32 ? CUBLAS_COMPUTE_32F_FAST_TF32
                                                                               : CUBLAS_COMPUTE_32F;
    key.scale_type = CUDA_R_32F;
  }
  key.epilogue = epilogue;
  key.align_a = backend::cuda::alignment_of(a);
  key.align_b = backend::cuda::alignment_of(b);
  key.align_c = backend::cuda::alignment_of(c);
  key.align_bias = bias ? backend::cuda::alignment_of(bias) : std::uint8_t(16);
  key.align_aux = aux ? backend::cuda::alignment_of(aux) : std::uint8_t(16);
  const backend::cuda::GemmArgs args{a, b, c, bias, const_cast<C*>(aux), &alpha, &beta};
  void* workspace = ctx.gemm_workspace();
  backend::cuda::GemmPlan& plan = ctx.gemm_plans().get(ctx.cublas_lt(), key, args, backend::cuda::Context::gemm_workspace_bytes);
  if (!plan.available()) return false;
  plan.run(ctx.cublas_lt(), key, args, workspace, backend::cuda::Context::gemm_workspace_bytes, ctx.stream());
  return true;
}

/// The plain product (no epilogue, so a plan always exists): c = alpha op(a) op(b) + beta c.
template <class T, class BC, class AB, class C, class S>
void lt_matmul_plain(backend::Cuda<T, BC>& be, ops::Transpose ta, ops::Transpose tb, S alpha, const AB* a, index_t lda, const AB* b,
                     index_t ldb, S beta, C* c, index_t m, index_t n, index_t k) {
  const bool ran = lt_matmul(be, ta, tb, alpha, a, lda, b, ldb, beta, c, m, n, k, backend::cuda::GemmEpilogue::none);
  CUPIPE_REQUIRE(ran, "gemm: a plan without an epilogue always has an algorithm (GemmPlan throws otherwise)");
}

/// Whether a GELU epilogue (GELU_AUX_BIAS, DGELU) may run: not for float operands in MathMode::fp32.
/// cuBLASLt does not document the accuracy of its GELU (it may use the hardware tanh approximation,
/// about 5e-4), and fp32 mode promises fp32 accuracy, so there the GELU kernels (libdevice tanhf)
/// run after the product. TF32's products are 1e-3 relative already, and bf16's outputs round at
/// 4e-3, so both keep the epilogue.
template <class AB, class T, class BC>
bool gelu_epilogue_allowed(const backend::Cuda<T, BC>& be) {
  return !std::is_same_v<AB, float> || be.math != backend::cuda::MathMode::fp32;
}

/// Whether cuBLASLt may fuse an epilogue for these operands: float scales (not double), a nonempty
/// k, a bias (or bias gradient) on 16 bytes (an unaligned one can fault in the epilogue; PyTorch
/// falls back there too), and an auxiliary matrix on 16 bytes with a leading dimension n divisible
/// by 8. A Linear's bias sits unpadded in the stage's flat parameters and an auxiliary matrix in a
/// layer's saved area at an offset that depends on the rows, so either is often off.
template <class S>
bool epilogue_fusable(index_t n, index_t k, const void* bias, const void* aux) {
  return k > 0 && !std::is_same_v<S, double> && (bias == nullptr || backend::cuda::alignment_of(bias) >= 16) &&
         (aux == nullptr || (n % 8 == 0 && backend::cuda::alignment_of(aux) >= 16));
}

/// The shared body of every GEMM entry point, after the host's shape checks; bias and pre may be null.
template <class T, class BC, class AB, class C, class S>
void gemm_impl(backend::Cuda<T, BC>& be, std::string_view op, ops::Transpose ta, ops::Transpose tb, S alpha, DeviceConstView<AB> a,
               DeviceConstView<AB> b, S beta, DeviceView<C> c, const C* bias, bool gelu, C* pre) {
  const auto [m, n, k] = ops::checks::gemm<AB, C>(op, ta, tb, a, b, c);
  if (m == 0 || n == 0) return;
  const backend::cuda::DeviceGuard guard(be.device());
  using DC = backend::cuda::kernels::device_t<C>;
  auto* dc = backend::cuda::kernels::device_ptr(c.data());
  const index_t lda = std::max<index_t>(a.cols(), 1), ldb = std::max<index_t>(b.cols(), 1);
  if (bias != nullptr && epilogue_fusable<S>(n, k, bias, pre) && (!gelu || gelu_epilogue_allowed<AB>(be))) {
    const auto epilogue = !gelu ? backend::cuda::GemmEpilogue::bias
                          : pre ? backend::cuda::GemmEpilogue::bias_gelu_aux
                                : backend::cuda::GemmEpilogue::bias_gelu;
    if (lt_matmul(be, ta, tb, alpha, a.data(), lda, b.data(), ldb, beta, c.data(), m, n, k, epilogue, bias, pre)) return;
  }
  // Unfused: the product and bias into GELU's input (`pre` where asked for, else c), then GELU
  // from there into c; no copy between the two. (beta is 0 whenever gelu is set.)
  C* out = gelu && pre ? pre : c.data();
  auto* dout = backend::cuda::kernels::device_ptr(out);
  if (k == 0)
    backend::cuda::kernels::transform(be.context(), m * n, backend::cuda::kernels::ScaleOp<DC>{backend::cuda::kernels::acc_t<DC>(beta)}, dout);
  else
    lt_matmul_plain(be, ta, tb, alpha, a.data(), lda, b.data(), ldb, beta, out, m, n, k);
  if (bias) backend::cuda::kernels::bias_add(be.context(), dout, backend::cuda::kernels::device_ptr(bias), m, n);
  if (gelu) backend::cuda::kernels::transform(be.context(), m * n, backend::cuda::kernels::GeluForwardOp<DC>{}, static_cast<const DC*>(dout), dc);
}

/// dw (n_out, n_in) = alpha dy^T x + beta dw and dbias (n_out) += column sums of dy, after the shape
/// checks. cuBLASLt's BGRADB epilogue writes the sums (it cannot add them), so they land in scratch
/// and one small kernel adds them to dbias: that replaces the unfused path's two-kernel column
/// reduction, which reads all of dy again.
template <class T, class BC, class AB, class C, class S>
void gemm_bias_grad_impl(backend::Cuda<T, BC>& be, S alpha, DeviceConstView<AB> dy, DeviceConstView<AB> x, S beta,
                         DeviceView<C> dw, DeviceView<C> dbias) {
  const auto [m, n, k] = ops::checks::gemm<AB, C>("gemm_bias_grad", ops::Transpose::yes, ops::Transpose::no, dy, x, dw);
  check_view(dbias, Shape{dw.rows()}, "gemm_bias_grad", "dbias");
  if (m == 0) return;  // (n == 0: no weight gradient, but the bias sums still count)
  const backend::cuda::DeviceGuard guard(be.device());
  backend::cuda::Context& ctx = be.context();
  const index_t lda = std::max<index_t>(dy.cols(), 1), ldb = std::max<index_t>(x.cols(), 1);
  // Only with alpha 1 (Linear's): cuBLASLt does not say whether alpha scales BGRADB's sums, and the
  // op's contract is the unscaled sums.
  if (n > 0 && alpha == S(1) && epilogue_fusable<S>(n, k, nullptr, nullptr)) {
    C* sums = static_cast<C*>(ctx.scratch(std::size_t(m) * sizeof(C)));  // the pool's blocks are 256-byte aligned
    if (lt_matmul(be, ops::Transpose::yes, ops::Transpose::no, alpha, dy.data(), lda, x.data(), ldb, beta, dw.data(), m, n, k,
                  backend::cuda::GemmEpilogue::bgradb, static_cast<const C*>(sums))) {
      using DC = backend::cuda::kernels::device_t<C>;
      backend::cuda::kernels::transform(ctx, m, backend::cuda::kernels::AxpyOp<DC, DC>{backend::cuda::kernels::acc_t<DC>(1)},
                              static_cast<const DC*>(backend::cuda::kernels::device_ptr(sums)), backend::cuda::kernels::device_ptr(dbias.data()));
      return;
    }
  }
  gemm_impl<T, BC, AB, C, S>(be, "gemm_bias_grad", ops::Transpose::yes, ops::Transpose::no, alpha, dy, x, beta, dw, nullptr, false, nullptr);
  using DA = backend::cuda::kernels::device_t<AB>;
  backend::cuda::kernels::column_sums<1, C>(ctx, dy.rows(), dy.cols(), backend::cuda::kernels::ColumnValue<DA>{backend::cuda::kernels::device_ptr(dy.data()), dy.cols()},
                                  dbias.data());
}

/// d (m, n) = (alpha op(a) op(b)) * gelu'(pre), after the shape checks: the GELU's gradient applied
/// in the GEMM's epilogue (DGELU), or by the GELU backward kernel in place after the product.
template <class T, class BC, class AB, class S>
void gemm_dgelu_impl(backend::Cuda<T, BC>& be, ops::Transpose ta, ops::Transpose tb, S alpha, DeviceConstView<AB> a, DeviceConstView<AB> b,
                     DeviceConstView<AB> pre, DeviceView<AB> d) {
  const auto [m, n, k] = ops::checks::gemm<AB, AB>("gemm_dgelu", ta, tb, a, b, d);
  check_view(pre, d.shape(), "gemm_dgelu", "pre");
  if (m == 0 || n == 0) return;
  const backend::cuda::DeviceGuard guard(be.device());
  const index_t lda = std::max<index_t>(a.cols(), 1), ldb = std::max<index_t>(b.cols(), 1);
  if (gelu_epilogue_allowed<AB>(be) && epilogue_fusable<S>(n, k, nullptr, pre.data()) &&
      lt_matmul(be, ta, tb, alpha, a.data(), lda, b.data(), ldb, S(0), d.data(), m, n, k, backend::cuda::GemmEpilogue::dgelu,
                static_cast<const AB*>(nullptr), pre.data()))
    return;
  gemm_impl<T, BC, AB, AB, S>(be, "gemm_dgelu", ta, tb, alpha, a, b, S(0), d, nullptr, false, nullptr);
  using DA = backend::cuda::kernels::device_t<AB>;
  auto* dd = backend::cuda::kernels::device_ptr(d.data());
  backend::cuda::kernels::transform(be.context(), m * n, backend::cuda::kernels::GeluBackwardOp<DA>{}, backend::cuda::kernels::device_ptr(pre.data()),
                          static_cast<const DA*>(dd), dd);
}

}  // namespace cupipe::backend::cuda::detail
namespace cupipe::ops {

/// c = alpha * op(a) * op(b) + beta * c, with op(a) (m, k), op(b) (k, n), c (m, n). beta == 0 does
/// not read c. Float uses fp32 arithmetic unless be.math is MathMode::tf32.
template <class T>
void gemm(backend::Cuda<T>& be, Transpose ta, Transpose tb, Scalar<T> alpha, DeviceConstView<T> a, DeviceConstView<T> b,
          Scalar<T> beta, DeviceView<T> c) {
  backend::cuda::NvtxRange range("cupipe::gemm");
  backend::cuda::detail::gemm_impl<T, T, T, T, T>(be, "gemm", ta, tb, alpha, a, b, beta, c, nullptr, false, nullptr);
}

/// bf16 a and b with fp32 accumulation and fp32 scalars; c is float (a gradient accumulates there)
/// or bfloat16 (rounded once, to nearest even). On any context: Cuda<bfloat16, float>'s layers call
/// it with their storage type's scalars (bfloat16(1)).
template <class T, class BC, class C>
  requires(std::is_same_v<C, float> || std::is_same_v<C, bfloat16>)
void gemm(backend::Cuda<T, BC>& be, Transpose ta, Transpose tb, ComputeScalar alpha, DeviceConstView<bfloat16> a,
          DeviceConstView<bfloat16> b, ComputeScalar beta, DeviceView<C> c) {
  backend::cuda::NvtxRange range("cupipe::gemm_bf16");
  backend::cuda::detail::gemm_impl<T, BC, bfloat16, C, float>(be, "gemm", ta, tb, alpha.value, a, b, beta.value, c, nullptr, false, nullptr);
}

/// y (m, n) = alpha * op(a) * op(b) + bias (n): Linear's forward in one launch.
template <class T>
void gemm_bias(backend::Cuda<T>& be, Transpose ta, Transpose tb, Scalar<T> alpha, DeviceConstView<T> a, DeviceConstView<T> b,
               DeviceConstView<T> bias, DeviceView<T> y) {
  backend::cuda::NvtxRange range("cupipe::gemm_bias");
  check_view(bias, Shape{y.cols()}, "gemm_bias", "bias");
  backend::cuda::detail::gemm_impl<T, T, T, T, T>(be, "gemm_bias", ta, tb, alpha, a, b, T(0), y, bias.data(), false, nullptr);
}

/// The same on bf16: fp32 accumulation, the bias added in fp32 in the epilogue, y rounded once.
template <class BC>
void gemm_bias(backend::Cuda<bfloat16, BC>& be, Transpose ta, Transpose tb, ComputeScalar alpha, DeviceConstView<bfloat16> a,
               DeviceConstView<bfloat16> b, DeviceConstView<bfloat16> bias, DeviceView<bfloat16> y) {
  backend::cuda::NvtxRange range("cupipe::gemm_bias_bf16");
  check_view(bias, Shape{y.cols()}, "gemm_bias", "bias");
  backend::cuda::detail::gemm_impl<bfloat16, BC, bfloat16, bfloat16, float>(be, "gemm_bias", ta, tb, alpha.value, a, b, 0.0f, y,
                                                                  bias.data(), false, nullptr);
}

/// y = gelu(alpha * op(a) * op(b) + bias), tanh-form GELU. `pre` (same shape as y, or empty) receives
/// the argument of gelu, which gelu_backward needs as its x.
template <class T>
void gemm_bias_gelu(backend::Cuda<T>& be, Transpose ta, Transpose tb, Scalar<T> alpha, DeviceConstView<T> a, DeviceConstView<T> b,
                    DeviceConstView<T> bias, DeviceView<T> pre, DeviceView<T> y) {
  backend::cuda::NvtxRange range("cupipe::gemm_bias_gelu");
  check_view(bias, Shape{y.cols()}, "gemm_bias_gelu", "bias");
  if (!pre.empty()) check_view(pre, y.shape(), "gemm_bias_gelu", "pre");
  backend::cuda::detail::gemm_impl<T, T, T, T, T>(be, "gemm_bias_gelu", ta, tb, alpha, a, b, T(0), y, bias.data(), true,
                                     pre.empty() ? nullptr : pre.data());
}

/// Linear's weight gradient in one GEMM: dw (n_out, n_in) = alpha dy^T x + beta dw (dy (rows, n_out),
/// x (rows, n_in)), and dbias (n_out) += the column sums of dy, taken in the GEMM's pass.
template <class T>
void gemm_bias_grad(backend::Cuda<T>& be, Scalar<T> alpha, DeviceConstView<T> dy, DeviceConstView<T> x, Scalar<T> beta,
                    DeviceView<T> dw, DeviceView<T> dbias) {
  backend::cuda::NvtxRange range("cupipe::gemm_bias_grad");
  backend::cuda::detail::gemm_bias_grad_impl<T, T, T, T, T>(be, alpha, dy, x, beta, dw, dbias);
}

/// The same on bf16 dy and x: fp32 accumulation into fp32 gradients.
template <class BC>
void gemm_bias_grad(backend::Cuda<bfloat16, BC>& be, ComputeScalar alpha, DeviceConstView<bfloat16> dy, DeviceConstView<bfloat16> x,
                    ComputeScalar beta, DeviceView<float> dw, DeviceView<float> dbias) {
  backend::cuda::NvtxRange range("cupipe::gemm_bias_grad_bf16");
  backend::cuda::detail::gemm_bias_grad_impl<bfloat16, BC, bfloat16, float, float>(be, alpha.value, dy, x, beta.value, dw, dbias);
}

/// d = (alpha op(a) op(b)) * gelu'(pre), tanh-form GELU: a Linear's input gradient carried through
/// the GELU that produced its input (pre: GELU's input, the shape of d). Equals gemm into d followed
/// by gelu_backward(pre, d, d).
template <class T>
void gemm_dgelu(backend::Cuda<T>& be, Transpose ta, Transpose tb, Scalar<T> alpha, DeviceConstView<T> a, DeviceConstView<T> b,
                DeviceConstView<T> pre, DeviceView<T> d) {
  backend::cuda::NvtxRange range("cupipe::gemm_dgelu");
  backend::cuda::detail::gemm_dgelu_impl<T, T, T, T>(be, ta, tb, alpha, a, b, pre, d);
}

/// The same on bf16: fp32 accumulation and GELU gradient, d rounded once.
template <class BC>
void gemm_dgelu(backend::Cuda<bfloat16, BC>& be, Transpose ta, Transpose tb, ComputeScalar alpha, DeviceConstView<bfloat16> a,
                DeviceConstView<bfloat16> b, DeviceConstView<bfloat16> pre, DeviceView<bfloat16> d) {
  backend::cuda::NvtxRange range("cupipe::gemm_dgelu_bf16");
  backend::cuda::detail::gemm_dgelu_impl<bfloat16, BC, bfloat16, float>(be, ta, tb, alpha.value, a, b, pre, d);
}

}  // namespace cupipe::ops
