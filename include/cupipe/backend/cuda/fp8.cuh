// SPDX-License-Identifier: Apache-2.0
// backend::CudaFp8<Recipe>: Cuda<bfloat16, float> whose layer GEMMs run in FP8 on Hopper's tensor
// cores through cuBLASLt, one call per GEMM, fp32 accumulation:
// - fp8::Blockwise, DeepSeek-V3's block scaling: cuBLASLt's block-scaled FP8 GEMM (cuBLAS 12.9+,
//   sm_90 only: E4M3 operands, fp32 scales per 1 x 128 tile or 128 x 128 block);
// - fp8::PerTensorDelayed, TransformerEngine's delayed scaling: one fp32 scale per operand (the
//   scalar scale pointers), E4M3 x E4M3 forward and E5M2 x E4M3 gradients; the histories on the host
//   (fp8::DelayedScales), each step's amaxes gathered on the device and read back once per update.
// backend::HostFp8<Recipe> (backend/host/fp8.hpp) is the oracle: the same quantisation, code for
// code and scale for scale (kernels/fp8_quantize.cuh), and the same product up to the order of
// fp32 sums.
//
// As on the host, the role of a GEMM is read from its transposes: (no, yes) y = x W^T; (no, no)
// dx = dy W; (yes, no) dW = dy^T x. Each GEMM quantises its operands into the context's scratch,
// k-contiguous (x and dy as they are; W in blocks as it is for the forward and transposed for the
// input gradient; dy^T and x^T transposed for the weight gradient), then runs one cuBLASLt call in
// its "TN" form. The fused epilogues are not offered (gemm_bias_grad and gemm_dgelu are deleted
// here), so a Linear takes its unfused path: the GEMM in FP8, then the bias or GELU kernels.
// cuBLASLt needs the product's rows and columns to be multiples of 4 and k a multiple of 16: other
// shapes are refused, naming them. A value that is not finite quantises to NaN (the host refuses
// it), so the loss check sees it; delayed scaling leaves it out of the step's amax.
//
// Roofline (H200: 1,979 dense FP8 TFLOP/s against 989 for bf16): a GPT-2 124M MLP GEMM (8192 x
// 3072 x 768) is 38.7 GFLOP, 20 us at the FP8 peak and 39 us at bf16's; quantising its operands
// adds about 5 us (fp8_quantize.cuh), so the FP8 forward GEMM is predicted near 1.5x faster than
// bf16's, and smaller GEMMs gain less. Delayed scaling quantises in one pass per operand (no block
// amaxes to find first) and reads the step's amaxes back once per update: 8 bytes per GEMM, one
// stream synchronisation. Predictions, not yet measured: no GPU has run this file.
#pragma once

#include <cuda_runtime_api.h>

#include <array>
#include <bit>
#include <cstddef>
#include <span>
#include <string_view>
#include <type_traits>
#include <vector>

#include "cupipe/backend/cuda/cuda.cuh"
#include "cupipe/backend/cuda/device_guard.cuh"
#include "cupipe/backend/cuda/gemm.cuh"
#include "cupipe/backend/cuda/gemm_plan.cuh"
#include "cupipe/backend/cuda/kernels/elementwise.cuh"
#include "cupipe/backend/cuda/kernels/fp8_quantize.cuh"
#include "cupipe/backend/cuda/kernels/reduce.cuh"
#include "cupipe/backend/cuda/nvtx.cuh"
#include "cupipe/backend/op_checks.hpp"
#include "cupipe/core/dtype.hpp"
#include "cupipe/fp8/delayed_scales.hpp"
#include "cupipe/fp8/recipe.hpp"

namespace cupipe::backend {

template <class Recipe>
class CudaFp8 : public Cuda<bfloat16, float> {
  static_assert(std::is_same_v<Recipe, fp8::Blockwise>,
                "backend::CudaFp8: the recipes are fp8::Blockwise and fp8::PerTensorDelayed");

 public:
  using recipe = Recipe;
  static constexpr std::string_view name = "cuda-fp8-block";
  using Cuda<bfloat16, float>::Cuda;
};

/// Delayed scaling on CUDA: the scales and amax histories on the host (fp8::DelayedScales, as the
/// host emulation keeps them), each step's amaxes on the device, added by the quantise kernels.
/// end_step (backend::end_step, once per stage update) reads the step's amaxes back (one copy, which
/// waits for the stage's work), takes them over the tensor-parallel group and records them; the
/// next step's scales are then known on the host before its kernels launch.
template <>
class CudaFp8<fp8::PerTensorDelayed> : public Cuda<bfloat16, float> {
 public:
  using recipe = fp8::PerTensorDelayed;
  static constexpr std::string_view name = "cuda-fp8-delayed";
  using Cuda<bfloat16, float>::Cuda;

  /// How many GEMMs (entries) one context may scale: a GPT-2 XL stage has under 600.
  static constexpr std::size_t max_entries = 4096;
  static_assert(fp8::PerTensorDelayed::margin == 0,
                "kernels::tensor_scale computes a first use's scale without a margin, as the host's does at margin 0");

  fp8::DelayedScales scales{fp8::PerTensorDelayed::history, fp8::PerTensorDelayed::margin};

  /// Refuses more entries than the device slots hold, naming the limit.
  void check_entries() const {
    CUPIPE_REQUIRE(scales.size() <= max_entries, "backend::CudaFp8<fp8::PerTensorDelayed>: ", scales.size(),
                   " FP8 GEMMs in one context, more than its ", max_entries, " amax slots");
  }
  /// The device slot of the step's amax of `entry`'s operand (float bits as int; -1.0f: none yet).
  int* step_amax(std::size_t entry, fp8::Operand o) {
    check_entries();
    if (step_.size() == 0) {
      step_ = allocate<int>(index_t(2 * max_entries), MemoryTag::workspace);
      reset_step();
    }
    return step_.data() + 2 * entry + (o == fp8::Operand::b ? 1 : 0);
  }

  /// Inference (backend::Inference) adds no amaxes to the step's.
  void inference(bool on) { scales.recording = !on; }

  /// Closes the step: the step's amaxes from the device, over the tensor-parallel group, into the
  /// histories; the device slots start again.
  void end_step() {
    check_entries();
    std::vector<float> amax(2 * scales.size(), fp8::DelayedScales::unused);
    if (!amax.empty() && step_.size() != 0) {
      std::vector<int> bits(amax.size());
      download(static_cast<const int*>(step_.data()), std::span<int>(bits));
      for (std::size_t i = 0; i < bits.size(); ++i) amax[i] = std::bit_cast<float>(bits[i]);
    }
    scales.end_step(tensor_group, std::move(amax));
    if (step_.size() != 0) reset_step();
  }

 private:
  void reset_step() {
    const backend::cuda::DeviceGuard guard(device());
    backend::cuda::kernels::reset_step_amax(context(), step_.data(), index_t(2 * max_entries));
  }
  buffer<int> step_;
};

}  // namespace cupipe::backend

namespace cupipe::backend::cuda::detail {

inline index_t round_up_4(index_t v) { return (v + 3) / 4 * 4; }
inline std::size_t aligned_16(std::size_t bytes) { return (bytes + 15) / 16 * 16; }

/// (m, n, k) of an FP8 GEMM, checked: a layer's GEMM (not both transposed) in shapes cuBLASLt's FP8
/// GEMM takes (m and n multiples of 4, k of 16).
template <class C>
std::array<index_t, 3> fp8_shape(std::string_view op, ops::Transpose ta, ops::Transpose tb, DeviceConstView<bfloat16> a,
                                 DeviceConstView<bfloat16> b, DeviceView<C> c) {
  const auto [m, n, k] = ops::checks::gemm<bfloat16, C>(op, ta, tb, a, b, c);
  CUPIPE_REQUIRE(tb == ops::Transpose::no || ta == ops::Transpose::no,
                 op, " on an FP8 backend: a layer's GEMMs are x W^T, dy W or dy^T x; op(a) op(b) with both transposed is "
                     "none of them");
  CUPIPE_REQUIRE((m == 0 || n == 0) || (m % 4 == 0 && n % 4 == 0 && k % 16 == 0 && k > 0), op,
                 " in FP8 on CUDA: cuBLASLt's FP8 GEMM needs (m, n, k) = (", m, ", ", n, ", ", k,
                 ") with m and n multiples of 4 and k a positive multiple of 16");
  return {m, n, k};
}

/// The cuBLASLt call of an FP8 GEMM whose operands are quantised, k-contiguous ("TN"), into codes_a
/// (m x k) and codes_b (n x k); `key` carries the types and scale modes.
template <class C>
void fp8_matmul(Context& ctx, GemmKey key, GemmArgs args, DeviceView<C> c) {
  key.lda = key.k, key.ldb = key.k, key.ldc = key.n;
  key.ta = ops::Transpose::no, key.tb = ops::Transpose::yes;
  key.c_type = cuda_type<C>;
  key.compute = CUBLAS_COMPUTE_32F;
  key.scale_type = CUDA_R_32F;
  key.align_a = alignment_of(args.a);
  key.align_b = alignment_of(args.b);
  key.align_c = alignment_of(c.data());
  args.c = c.data();
  void* workspace = ctx.gemm_workspace();
  GemmPlan& plan = ctx.gemm_plans().get(ctx.cublas_lt(), key, args, Context::gemm_workspace_bytes);
  plan.run(ctx.cublas_lt(), key, args, workspace, Context::gemm_workspace_bytes, ctx.stream());
}

/// c (m, n) = alpha op(a) op(b) + beta c in FP8 under the block recipe; c bf16 (rounded once) or
/// float (a weight gradient, accumulated).
template <class C>
void fp8_gemm(backend::CudaFp8<fp8::Blockwise>& be, std::string_view op, ops::Transpose ta, ops::Transpose tb, float alpha,
              DeviceConstView<bfloat16> a, DeviceConstView<bfloat16> b, float beta, DeviceView<C> c) {
  const auto [m, n, k] = fp8_shape(op, ta, tb, a, b, c);
  if (m == 0 || n == 0) return;
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
  key.ab_type = CUDA_R_8F_E4M3;
  key.a_scale_mode = CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F;
  key.b_scale_mode = b_mode;
  GemmArgs args{codes_a, codes_b, c.data(), nullptr, nullptr, &alpha, &beta};
  args.a_scale = scales_a;
  args.b_scale = scales_b;
  fp8_matmul(ctx, key, args, c);
}

/// c (m, n) = alpha op(a) op(b) + beta c in FP8 under delayed scaling: A (x, or dy in E5M2) and B
/// (W, W^T or x^T) each at one scale, the history's, or on an operand's first use its own amax's
/// (one more pass, amax_kernel); each quantise kernel adds its operand's amax to the step's.
template <class C>
void fp8_gemm(backend::CudaFp8<fp8::PerTensorDelayed>& be, std::string_view op, ops::Transpose ta, ops::Transpose tb,
              float alpha, DeviceConstView<bfloat16> a, DeviceConstView<bfloat16> b, float beta, DeviceView<C> c) {
  const auto [m, n, k] = fp8_shape(op, ta, tb, a, b, c);
  const DeviceGuard guard(be.device());
  Context& ctx = be.context();
  const fp8::GemmRole role = ta == ops::Transpose::yes   ? fp8::GemmRole::weight_grad
                             : tb == ops::Transpose::yes ? fp8::GemmRole::forward
                                                         : fp8::GemmRole::input_grad;
  // The same keys as the host emulation (backend/host/fp8.hpp): the weight, or the weight gradient.
  const void* name = role == fp8::GemmRole::weight_grad ? static_cast<const void*>(c.data()) : static_cast<const void*>(b.data());
  const std::size_t entry = be.scales.entry(name, role);
  be.check_entries();
  if (m == 0 || n == 0) {  // no product; the operands count as used with amax 0, as on the host
    if (be.scales.recording) kernels::mark_used(ctx, be.step_amax(entry, fp8::Operand::a), be.step_amax(entry, fp8::Operand::b));
    return;
  }
  // Scratch: A's codes (m x k), B's codes (n x k), the two scales used, two amax states.
  const std::size_t at_b = aligned_16(std::size_t(m * k)), at_s = at_b + aligned_16(std::size_t(n * k)),
                    at_own = at_s + aligned_16(2 * sizeof(float)), bytes = at_own + aligned_16(4 * sizeof(unsigned));
  auto* base = static_cast<unsigned char*>(ctx.scratch(bytes));
  unsigned char *codes_a = base, *codes_b = base + at_b;
  auto* used = reinterpret_cast<float*>(base + at_s);
  auto* own = reinterpret_cast<unsigned*>(base + at_own);
  // A: x or dy (m, k) as they are, or dy^T from dy (k, m). B, n x k: W as it is, W^T from W (k, n),
  // x^T from x (k, n).
  const bool a_t = role == fp8::GemmRole::weight_grad, b_t = role != fp8::GemmRole::forward;
  const auto quantize = [&]<__nv_fp8_interpretation_t Format>(fp8::Operand o, const bfloat16* x, index_t rows, index_t cols,
                                                               bool transposed, unsigned char* codes, float* scale_out,
                                                               unsigned* state) {
    const bool first = !be.scales.recorded(entry, o);
    if (first) kernels::amax(ctx, kernels::device_ptr(x), rows * cols, state);
    kernels::quantize_tensor<Format>(ctx, kernels::device_ptr(x), rows, cols, transposed, be.scales.scale(entry, o),
                                     first ? state : nullptr, codes, scale_out,
                                     be.scales.recording ? be.step_amax(entry, o) : nullptr);
  };
  if (role == fp8::GemmRole::forward)
    quantize.template operator()<__NV_E4M3>(fp8::Operand::a, a.data(), m, k, false, codes_a, used, own);
  else
    quantize.template operator()<__NV_E5M2>(fp8::Operand::a, a.data(), a_t ? k : m, a_t ? m : k, a_t, codes_a, used, own);
  quantize.template operator()<__NV_E4M3>(fp8::Operand::b, b.data(), b_t ? k : n, b_t ? n : k, b_t, codes_b, used + 1,
                                          own + 2);
  GemmKey key;
  key.m = m, key.n = n, key.k = k;
  key.ab_type = CUDA_R_8F_E4M3;
  key.tensor_scales = true;
  key.a_e5m2 = role != fp8::GemmRole::forward;
  GemmArgs args{codes_a, codes_b, c.data(), nullptr, nullptr, &alpha, &beta};
  args.a_scale = used;
  args.b_scale = used + 1;
  fp8_matmul(ctx, key, args, c);
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
