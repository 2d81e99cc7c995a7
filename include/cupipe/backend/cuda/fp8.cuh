// SPDX-License-Identifier: Apache-2.0
// backend::CudaFp8<fp8::Blockwise>: Cuda<bfloat16, float> whose layer GEMMs run in FP8 with
// DeepSeek-V3's block scaling on Hopper's tensor cores, through cuBLASLt's block-scaled FP8 GEMM
// (cuBLAS 12.9+, sm_90 only: E4M3 operands, fp32 scales per 1 x 128 tile or 128 x 128 block, fp32
// accumulation). backend::HostFp8<fp8::Blockwise> (backend/host/fp8.hpp) is its oracle: the same
// quantisation, code for code and scale for scale (kernels/fp8_quantize.cuh), and the same product
// up to the order of fp32 sums.
//
// As on the host, the role of a GEMM is read from its transposes: (no, yes) y = x W^T; (no, no)
// dx = dy W; (yes, no) dW = dy^T x. Each GEMM quantises its operands into the context's scratch,
// k-contiguous (x and dy as they are; W in blocks as it is for the forward and transposed for the
// input gradient; dy^T and x^T transposed for the weight gradient), then runs one cuBLASLt call in
// its "TN" form. The fused epilogues are not offered (gemm_bias_grad and gemm_dgelu are deleted
// here), so a Linear takes its unfused path: the GEMM in FP8, then the bias or GELU kernels.
// cuBLASLt needs the product's rows and columns to be multiples of 4 and k a multiple of 16: other
// shapes are refused, naming them. A value that is not finite quantises to NaN (the host refuses
// it), so the loss check sees it.
//
// Roofline (H200: 1,979 dense FP8 TFLOP/s against 989 for bf16): a GPT-2 124M MLP GEMM (8192 x
// 3072 x 768) is 38.7 GFLOP, 20 us at the FP8 peak and 39 us at bf16's; quantising its operands
// adds about 5 us (fp8_quantize.cuh), so the FP8 forward GEMM is predicted near 1.5x faster than
// bf16's, and smaller GEMMs gain less. Predictions, not yet measured: no GPU has run this file.
#pragma once

#include <cuda_runtime_api.h>

#include <string_view>
#include <type_traits>

#include "cupipe/backend/cuda/cuda.cuh"
#include "cupipe/backend/cuda/device_guard.cuh"
#include "cupipe/backend/cuda/gemm.cuh"
#include "cupipe/backend/cuda/gemm_plan.cuh"
#include "cupipe/backend/cuda/kernels/elementwise.cuh"
#include "cupipe/backend/cuda/kernels/fp8_quantize.cuh"
#include "cupipe/backend/cuda/nvtx.cuh"
#include "cupipe/backend/op_checks.hpp"
#include "cupipe/core/dtype.hpp"
#include "cupipe/fp8/recipe.hpp"

namespace cupipe::backend {

template <class Recipe>
class CudaFp8 : public Cuda<bfloat16, float> {
  static_assert(std::is_same_v<Recipe, fp8::Blockwise>,
                "backend::CudaFp8: the CUDA path has the block recipe (fp8::Blockwise); delayed scaling is on the host "
                "only (backend::HostFp8<fp8::PerTensorDelayed>)");

 public:
  using recipe = Recipe;
  static constexpr std::string_view name = "cuda-fp8-block";
  using Cuda<bfloat16, float>::Cuda;
};

}  // namespace cupipe::backend

namespace cupipe::backend::cuda::detail {

inline index_t round_up_4(index_t v) { return (v + 3) / 4 * 4; }
inline std::size_t aligned_16(std::size_t bytes) { return (bytes + 15) / 16 * 16; }

/// c (m, n) = alpha op(a) op(b) + beta c in FP8 under the block recipe; c bf16 (rounded once) or
/// float (a weight gradient, accumulated).
template <class R, class C>
void fp8_gemm(backend::CudaFp8<R>& be, std::string_view op, ops::Transpose ta, ops::Transpose tb, float alpha,
              DeviceConstView<bfloat16> a, DeviceConstView<bfloat16> b, float beta, DeviceView<C> c) {
  const auto [m, n, k] = ops::checks::gemm<bfloat16, C>(op, ta, tb, a, b, c);
  CUPIPE_REQUIRE(tb == ops::Transpose::no || ta == ops::Transpose::no,
                 op, " on an FP8 backend: a layer's GEMMs are x W^T, dy W or dy^T x; op(a) op(b) with both transposed is "
                     "none of them");
  if (m == 0 || n == 0) return;
  CUPIPE_REQUIRE(m % 4 == 0 && n % 4 == 0 && k % 16 == 0, op, " in FP8 on CUDA: cuBLASLt's block-scaled GEMM needs (m, n, k) = (",
                 m, ", ", n, ", ", k, ") with m and n multiples of 4 and k of 16");
  const DeviceGuard guard(be.device());
  Context& ctx = be.context();
  const bool weight_grad = ta == ops::Transpose::yes;
  const index_t blocks = (k + 127) / 128, l4 = round_up_4(blocks);
  // Scratch: A's codes (m x k), B's codes (n x k), A's scales (m per k block), B's scales (one per
  // tile, n per k block, or per block, l4 per 128 rows).
  const std::size_t b_scales = weight_grad ? std::size_t(n * blocks) : std::size_t(l4 * ((n + 127) / 128));
  const std::size_t at_b = aligned_16(std::size_t(m * k)), at_sa = at_b + aligned_16(std::size_t(n * k)),
                    at_sb = at_sa + aligned_16(sizeof(float) * std::size_t(m * blocks)),
                    bytes = at_sb + aligned_16(sizeof(float) * b_scales);
  auto* base = static_cast<unsigned char*>(ctx.scratch(bytes));
  unsigned char *codes_a = base, *codes_b = base + at_b;
  auto *scales_a = reinterpret_cast<float*>(base + at_sa), *scales_b = reinterpret_cast<float*>(base + at_sb);
  const auto* da = kernels::device_ptr(a.data());
  const auto* db = kernels::device_ptr(b.data());
  // A: x or dy as they are (tiles along k), or dy^T from dy (k, m).
  if (weight_grad) kernels::quantize_tiles_transposed(ctx, da, k, m, codes_a, scales_a);
  else kernels::quantize_tiles(ctx, da, m, k, codes_a, scales_a);
  // B, n x k: x^T from x (k, n) in tiles; W (n, k) in blocks; W^T from W (k, n) in blocks.
  std::uint8_t b_mode = CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F;
  if (weight_grad) {
    kernels::quantize_tiles_transposed(ctx, db, k, n, codes_b, scales_b);
    b_mode = CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F;
  } else {
    CUPIPE_CHECK_CUDA(cudaMemsetAsync(scales_b, 0, sizeof(float) * b_scales, ctx.stream()));  // the padding to l4
    if (tb == ops::Transpose::yes)
      kernels::quantize_blocks(ctx, db, n, k, codes_b, scales_b, l4, static_cast<unsigned char*>(nullptr), nullptr, 0);
    else  // b is W (k, n): its transpose's codes and scales only (index l4_t over W^T's k blocks)
      kernels::quantize_blocks(ctx, db, k, n, static_cast<unsigned char*>(nullptr), nullptr, 0, codes_b, scales_b, l4);
  }
  GemmKey key;
  key.m = m, key.n = n, key.k = k;
  key.lda = k, key.ldb = k, key.ldc = n;
  key.ta = ops::Transpose::no, key.tb = ops::Transpose::yes;
  key.ab_type = CUDA_R_8F_E4M3;
  key.c_type = cuda_type<C>;
  key.compute = CUBLAS_COMPUTE_32F;
  key.scale_type = CUDA_R_32F;
  key.align_a = alignment_of(codes_a);
  key.align_b = alignment_of(codes_b);
  key.align_c = alignment_of(c.data());
  key.a_scale_mode = CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F;
  key.b_scale_mode = b_mode;
  GemmArgs args{codes_a, codes_b, c.data(), nullptr, nullptr, &alpha, &beta};
  args.a_scale = scales_a;
  args.b_scale = scales_b;
  void* workspace = ctx.gemm_workspace();
  GemmPlan& plan = ctx.gemm_plans().get(ctx.cublas_lt(), key, args, Context::gemm_workspace_bytes);
  plan.run(ctx.cublas_lt(), key, args, workspace, Context::gemm_workspace_bytes, ctx.stream());
}

}  // namespace cupipe::backend::cuda::detail

namespace cupipe::ops {

/// c = alpha op(a) op(b) + beta c, the product in FP8 with block scales; c rounded once to bf16, or
/// accumulated in fp32.
template <class R, class C>
  requires(std::is_same_v<C, float> || std::is_same_v<C, bfloat16>)
void gemm(backend::CudaFp8<R>& be, Transpose ta, Transpose tb, ComputeScalar alpha, DeviceConstView<bfloat16> a,
          DeviceConstView<bfloat16> b, ComputeScalar beta, DeviceView<C> c) {
  backend::cuda::NvtxRange range("cupipe::gemm_fp8");
  backend::cuda::detail::fp8_gemm(be, "gemm", ta, tb, alpha.value, a, b, beta.value, c);
}

/// y = alpha op(a) op(b) + bias: the FP8 product, then the bias kernel (y rounded twice, not once
/// as on the host and in the bf16 epilogue: within a bf16 ulp of the host).
template <class R>
void gemm_bias(backend::CudaFp8<R>& be, Transpose ta, Transpose tb, ComputeScalar alpha, DeviceConstView<bfloat16> a,
               DeviceConstView<bfloat16> b, DeviceConstView<bfloat16> bias, DeviceView<bfloat16> y) {
  backend::cuda::NvtxRange range("cupipe::gemm_bias_fp8");
  check_view(bias, Shape{y.cols()}, "gemm_bias", "bias");
  backend::cuda::detail::fp8_gemm(be, "gemm_bias", ta, tb, alpha.value, a, b, 0.0f, y);
  backend::cuda::kernels::bias_add(be.context(), backend::cuda::kernels::device_ptr(y.data()),
                                   backend::cuda::kernels::device_ptr(bias.data()), y.rows(), y.cols());
}

// No fused epilogue on FP8: a Linear asks (layers/linear.hpp's concepts), finds these deleted, and
// runs the FP8 GEMM and then its bias-gradient and GELU kernels.
template <class R>
void gemm_bias_grad(backend::CudaFp8<R>&, ComputeScalar, DeviceConstView<bfloat16>, DeviceConstView<bfloat16>, ComputeScalar,
                    DeviceView<float>, DeviceView<float>) = delete;
template <class R>
void gemm_dgelu(backend::CudaFp8<R>&, Transpose, Transpose, ComputeScalar, DeviceConstView<bfloat16>,
                DeviceConstView<bfloat16>, DeviceConstView<bfloat16>, DeviceView<bfloat16>) = delete;

}  // namespace cupipe::ops
