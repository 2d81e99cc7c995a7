// SPDX-License-Identifier: Apache-2.0
// GEMM ops on backend::Cuda<T>, through cuBLASLt with plans cached per problem (gemm_plan.cuh).
//   gemm            c = alpha op(a) op(b) + beta c                  (the host op's contract)
//   gemm_bias       y = alpha op(a) op(b) + bias                    (bias fused into the epilogue)
//   gemm_bias_gelu  y = gelu(alpha op(a) op(b) + bias), pre = the argument of gelu (optional)
//   gemm on bf16 a and b: fp32 accumulation, c in fp32 or bf16
// Where cuBLASLt cannot fuse an epilogue (double, k == 0, an unaligned auxiliary matrix), the same
// result comes from the plain product followed by the elementwise kernels.
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
#include "cupipe/backend/cuda/nvtx.cuh"
#include "cupipe/backend/cuda/stream.cuh"
#include "cupipe/backend/op_checks.hpp"
#include "cupipe/backend/op_types.hpp"
#include "cupipe/core/dtype.hpp"
#include "cupipe/core/error.hpp"
#include "cupipe/core/tensor.hpp"

namespace cupipe::ops {

namespace cuda_detail {

template <class X> inline constexpr cudaDataType_t cuda_type = CUDA_R_32F;
template <> inline constexpr cudaDataType_t cuda_type<double> = CUDA_R_64F;
template <> inline constexpr cudaDataType_t cuda_type<bfloat16> = CUDA_R_16BF;

/// One product through a cached plan: c = alpha op(a) op(b) + beta c, with `epilogue` applied.
template <class T, class BC, class AB, class C, class S>
void lt_matmul(backend::Cuda<T, BC>& be, Transpose ta, Transpose tb, S alpha, const AB* a, index_t lda, const AB* b,
               index_t ldb, S beta, C* c, index_t m, index_t n, index_t k, gpu::GemmEpilogue epilogue,
               const C* bias = nullptr, C* aux = nullptr) {
  gpu::Context& ctx = be.context();
  gpu::GemmKey key;
  key.m = m, key.n = n, key.k = k;
  key.lda = lda, key.ldb = ldb, key.ldc = n;
  key.ta = ta, key.tb = tb;
  key.ab_type = cuda_type<AB>;
  key.c_type = cuda_type<C>;
  if constexpr (std::is_same_v<AB, double>) {
    key.compute = CUBLAS_COMPUTE_64F;
    key.scale_type = CUDA_R_64F;
  } else {
    key.compute = std::is_same_v<AB, float> && be.math == gpu::MathMode::tf32 ? CUBLAS_COMPUTE_32F_FAST_TF32
                                                                               : CUBLAS_COMPUTE_32F;
    key.scale_type = CUDA_R_32F;
  }
  key.epilogue = epilogue;
  key.align_a = gpu::alignment_of(a);
  key.align_b = gpu::alignment_of(b);
  key.align_c = gpu::alignment_of(c);
  key.align_bias = bias ? gpu::alignment_of(bias) : std::uint8_t(16);
  const gpu::GemmArgs args{a, b, c, bias, aux, &alpha, &beta};
  void* workspace = ctx.gemm_workspace();
  gpu::GemmPlan& plan = ctx.gemm_plans().get(ctx.cublas_lt(), key, args, gpu::Context::gemm_workspace_bytes);
  plan.run(ctx.cublas_lt(), key, args, workspace, gpu::Context::gemm_workspace_bytes, ctx.stream());
}

/// The shared body of every GEMM entry point, after the host's shape checks; bias and pre may be null.
template <class T, class BC, class AB, class C, class S>
void gemm_impl(backend::Cuda<T, BC>& be, std::string_view op, Transpose ta, Transpose tb, S alpha, DeviceConstView<AB> a,
               DeviceConstView<AB> b, S beta, DeviceView<C> c, const C* bias, bool gelu, C* pre) {
  const auto [m, n, k] = checks::gemm<AB, C>(op, ta, tb, a, b, c);
  if (m == 0 || n == 0) return;
  const gpu::DeviceGuard guard(be.device());
  using DC = gpu::kernels::device_t<C>;
  auto* dc = gpu::kernels::device_ptr(c.data());
  const index_t lda = std::max<index_t>(a.cols(), 1), ldb = std::max<index_t>(b.cols(), 1);
  // cuBLASLt fuses bias (and GELU) for float scales; its auxiliary matrix needs a leading dimension
  // divisible by 8, and a bias under 16-byte alignment can fault in its epilogue (PyTorch falls back
  // there too). A Linear's bias sits unpadded in the stage's flat parameters, so it often is.
  // The auxiliary matrix (GELU's input) sits in a layer's saved area, at an offset that depends
  // on the rows and on the layers before it: it takes the same 16-byte alignment.
  const bool fusable = bias != nullptr && k > 0 && !std::is_same_v<S, double> &&
                       (pre == nullptr || (n % 8 == 0 && gpu::alignment_of(pre) >= 16)) && gpu::alignment_of(bias) >= 16;
  if (fusable) {
    const auto epilogue = !gelu ? gpu::GemmEpilogue::bias
                          : pre ? gpu::GemmEpilogue::bias_gelu_aux
                                : gpu::GemmEpilogue::bias_gelu;
    lt_matmul(be, ta, tb, alpha, a.data(), lda, b.data(), ldb, beta, c.data(), m, n, k, epilogue, bias, pre);
    return;
  }
  // Unfused: the product and bias into GELU's input (`pre` where asked for, else c), then GELU
  // from there into c; no copy between the two. (beta is 0 whenever gelu is set.)
  C* out = gelu && pre ? pre : c.data();
  auto* dout = gpu::kernels::device_ptr(out);
  if (k == 0)
    gpu::kernels::transform(be.context(), m * n, gpu::kernels::ScaleOp<DC>{gpu::kernels::acc_t<DC>(beta)}, dout);
  else
    lt_matmul(be, ta, tb, alpha, a.data(), lda, b.data(), ldb, beta, out, m, n, k, gpu::GemmEpilogue::none);
  if (bias) gpu::kernels::bias_add(be.context(), dout, gpu::kernels::device_ptr(bias), m, n);
  if (gelu) gpu::kernels::transform(be.context(), m * n, gpu::kernels::GeluForwardOp<DC>{}, static_cast<const DC*>(dout), dc);
}

}  // namespace cuda_detail

/// c = alpha * op(a) * op(b) + beta * c, with op(a) (m, k), op(b) (k, n), c (m, n). beta == 0 does
/// not read c. Float uses fp32 arithmetic unless be.math is MathMode::tf32.
template <class T>
void gemm(backend::Cuda<T>& be, Transpose ta, Transpose tb, Scalar<T> alpha, DeviceConstView<T> a, DeviceConstView<T> b,
          Scalar<T> beta, DeviceView<T> c) {
  gpu::NvtxRange range("cupipe::gemm");
  cuda_detail::gemm_impl<T, T, T, T, T>(be, "gemm", ta, tb, alpha, a, b, beta, c, nullptr, false, nullptr);
}

/// bf16 a and b with fp32 accumulation and fp32 scalars; c is float (a gradient accumulates there)
/// or bfloat16 (rounded once, to nearest even). On any context: Cuda<bfloat16, float>'s layers call
/// it with their storage type's scalars (bfloat16(1)).
template <class T, class BC, class C>
  requires(std::is_same_v<C, float> || std::is_same_v<C, bfloat16>)
void gemm(backend::Cuda<T, BC>& be, Transpose ta, Transpose tb, ComputeScalar alpha, DeviceConstView<bfloat16> a,
          DeviceConstView<bfloat16> b, ComputeScalar beta, DeviceView<C> c) {
  gpu::NvtxRange range("cupipe::gemm_bf16");
  cuda_detail::gemm_impl<T, BC, bfloat16, C, float>(be, "gemm", ta, tb, alpha.value, a, b, beta.value, c, nullptr, false, nullptr);
}

/// y (m, n) = alpha * op(a) * op(b) + bias (n): Linear's forward in one launch.
template <class T>
void gemm_bias(backend::Cuda<T>& be, Transpose ta, Transpose tb, Scalar<T> alpha, DeviceConstView<T> a, DeviceConstView<T> b,
               DeviceConstView<T> bias, DeviceView<T> y) {
  gpu::NvtxRange range("cupipe::gemm_bias");
  check_view(bias, Shape{y.cols()}, "gemm_bias", "bias");
  cuda_detail::gemm_impl<T, T, T, T, T>(be, "gemm_bias", ta, tb, alpha, a, b, T(0), y, bias.data(), false, nullptr);
}

/// The same on bf16: fp32 accumulation, the bias added in fp32 in the epilogue, y rounded once.
template <class BC>
void gemm_bias(backend::Cuda<bfloat16, BC>& be, Transpose ta, Transpose tb, ComputeScalar alpha, DeviceConstView<bfloat16> a,
               DeviceConstView<bfloat16> b, DeviceConstView<bfloat16> bias, DeviceView<bfloat16> y) {
  gpu::NvtxRange range("cupipe::gemm_bias_bf16");
  check_view(bias, Shape{y.cols()}, "gemm_bias", "bias");
  cuda_detail::gemm_impl<bfloat16, BC, bfloat16, bfloat16, float>(be, "gemm_bias", ta, tb, alpha.value, a, b, 0.0f, y,
                                                                  bias.data(), false, nullptr);
}

/// y = gelu(alpha * op(a) * op(b) + bias), tanh-form GELU. `pre` (same shape as y, or empty) receives
/// the argument of gelu, which gelu_backward needs as its x.
template <class T>
void gemm_bias_gelu(backend::Cuda<T>& be, Transpose ta, Transpose tb, Scalar<T> alpha, DeviceConstView<T> a, DeviceConstView<T> b,
                    DeviceConstView<T> bias, DeviceView<T> pre, DeviceView<T> y) {
  gpu::NvtxRange range("cupipe::gemm_bias_gelu");
  check_view(bias, Shape{y.cols()}, "gemm_bias_gelu", "bias");
  if (!pre.empty()) check_view(pre, y.shape(), "gemm_bias_gelu", "pre");
  cuda_detail::gemm_impl<T, T, T, T, T>(be, "gemm_bias_gelu", ta, tb, alpha, a, b, T(0), y, bias.data(), true,
                                     pre.empty() ? nullptr : pre.data());
}

}  // namespace cupipe::ops
