// SPDX-License-Identifier: Apache-2.0
// Cached cuBLASLt plans. A plan (matmul descriptor, three layouts, the heuristic's algorithm) is built
// once per problem key: shape, transposes, leading dimensions, data and compute types, epilogue and
// pointer alignment classes; later calls with that key only set pointers and launch.
//
// Row-major problems map onto column-major cuBLASLt by the usual identity C^T = op(B)^T op(A)^T:
// cuBLASLt's A is our b, its B is our a, and its (m, n) are our (n, m). A bias epilogue then adds a
// vector along cuBLASLt's rows, which are our columns: exactly a row-major per-feature bias. BGRADB
// sums cuBLASLt's B (our a) over k, one value per column of its D (a row of ours): for a weight
// gradient dW (out, in) = dy^T x, that is the column sums of dy, the bias gradient.
// A fused epilogue the heuristic has no algorithm for leaves an unavailable plan in the cache (so
// the heuristic is asked once per key), and the op that asked runs its unfused form instead.
#pragma once

#include <cublasLt.h>
#include <cuda_runtime_api.h>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <unordered_map>
#include <utility>
#include <vector>

#include "cupipe/backend/cuda/check.cuh"
#include "cupipe/backend/op_types.hpp"
#include "cupipe/core/error.hpp"

namespace cupipe::backend::cuda {

/// What cuBLASLt applies after the product.
enum class GemmEpilogue : std::uint8_t {
  none,
  bias,           // d = alpha op(a) op(b) + beta c + bias
  bias_gelu,      // d = gelu(... + bias)
  bias_gelu_aux,  // the same, and the pre-activation written to an auxiliary matrix
  dgelu,          // d = (alpha op(a) op(b)) * gelu'(aux), aux the pre-activation (read)
  bgradb,         // d = alpha op(a) op(b) + beta c; bias (written, not added to) = sums of op(a) over k
};

/// Whether the epilogue reads or writes the auxiliary matrix (row-major (m, n), like d).
constexpr bool uses_aux(GemmEpilogue e) noexcept { return e == GemmEpilogue::bias_gelu_aux || e == GemmEpilogue::dgelu; }
/// Whether the epilogue reads or writes the bias pointer.
constexpr bool uses_bias(GemmEpilogue e) noexcept { return e != GemmEpilogue::none && e != GemmEpilogue::dgelu; }

/// Arithmetic of float GEMMs: exact fp32, or TF32 tensor cores (about 1e-3 relative error).
enum class MathMode : std::uint8_t { fp32, tf32 };

namespace detail {
inline std::atomic<MathMode>& default_math_mode() noexcept {
  static std::atomic<MathMode> mode{MathMode::tf32};
  return mode;
}
}  // namespace detail

/// The arithmetic a new backend::Cuda<float> context gives its float GEMMs: TF32 tensor cores unless
/// a program says otherwise (PyTorch's torch.backends.cuda.matmul.allow_tf32, for one process). A
/// context's own `math` member overrides it; contexts made before a change keep theirs. Work that
/// must match the host backend bit for bit, or to fp32 accuracy, sets MathMode::fp32.
inline void set_default_math(MathMode mode) noexcept { detail::default_math_mode().store(mode); }
inline MathMode default_math() noexcept { return detail::default_math_mode().load(); }

/// Largest power of two (at most 16) dividing the address: what cuBLASLt may assume for vector loads.
inline std::uint8_t alignment_of(const void* ptr) noexcept {
  const auto address = reinterpret_cast<std::uintptr_t>(ptr);
  std::uint8_t align = 16;
  while (align > 1 && address % align != 0) align = std::uint8_t(align / 2);
  return align;
}

/// Everything a cuBLASLt plan depends on, for a row-major c (m, n) = op(a) (m, k) op(b) (k, n).
struct GemmKey {
  std::int64_t m = 0, n = 0, k = 0;
  std::int64_t lda = 0, ldb = 0, ldc = 0;  // row-major leading dimensions: a.cols, b.cols, n
  ops::Transpose ta = ops::Transpose::no, tb = ops::Transpose::no;
  cudaDataType_t ab_type = CUDA_R_32F;  // a and b
  cudaDataType_t c_type = CUDA_R_32F;   // c, d and the bias
  cublasComputeType_t compute = CUBLAS_COMPUTE_32F;
  cudaDataType_t scale_type = CUDA_R_32F;
  GemmEpilogue epilogue = GemmEpilogue::none;
  std::uint8_t align_a = 16, align_b = 16, align_c = 16, align_bias = 16, align_aux = 16;
  /// FP8 operands' scaling (cublasLtMatmulMatrixScale_t) of our a and b: 0, one scalar each (the
  /// default); VEC128_32F or BLK128x128_32F for block-scaled FP8 (backend/cuda/fp8.cuh), the scales
  /// then passed in GemmArgs.
  std::uint8_t a_scale_mode = 0, b_scale_mode = 0;
  /// FP8 with one scale per operand (fp8::PerTensorDelayed): the scale modes stay scalar (0) and
  /// GemmArgs' a_scale and b_scale point at one float each; `a_e5m2`: our a is E5M2 (a gradient)
  /// while b is ab_type (E4M3). Hopper multiplies E5M2 by E4M3, not E5M2 by E5M2.
  bool tensor_scales = false, a_e5m2 = false;

  bool operator==(const GemmKey&) const = default;
};

struct GemmKeyHash {
  std::size_t operator()(const GemmKey& key) const noexcept {
    std::size_t h = 0;
    const auto mix = [&h](std::uint64_t v) { h ^= std::hash<std::uint64_t>{}(v) + 0x9e3779b97f4a7c15ull + (h << 6) + (h >> 2); };
    mix(std::uint64_t(key.m));
    mix(std::uint64_t(key.n));
    mix(std::uint64_t(key.k));
    mix(std::uint64_t(key.lda) << 32 ^ std::uint64_t(key.ldb));
    mix(std::uint64_t(key.ldc));
    mix(std::uint64_t(key.ta) | std::uint64_t(key.tb) << 8 | std::uint64_t(key.epilogue) << 16 |
        std::uint64_t(key.align_a) << 24 | std::uint64_t(key.align_b) << 32 | std::uint64_t(key.align_c) << 40 |
        std::uint64_t(key.align_bias) << 48 | std::uint64_t(key.align_aux) << 56);
    mix(std::uint64_t(key.ab_type) | std::uint64_t(key.c_type) << 16 | std::uint64_t(key.compute) << 32 |
        std::uint64_t(key.scale_type) << 48);
    mix(std::uint64_t(key.a_scale_mode) | std::uint64_t(key.b_scale_mode) << 8 | std::uint64_t(key.tensor_scales) << 16 |
        std::uint64_t(key.a_e5m2) << 17);
    return h;
  }
};

/// Pointers and scalars for one launch of a plan (alpha and beta in the key's scale type).
struct GemmArgs {
  const void* a = nullptr;
  const void* b = nullptr;
  void* c = nullptr;
  const void* bias = nullptr;
  void* aux = nullptr;
  const void* alpha = nullptr;
  const void* beta = nullptr;
  const float* a_scale = nullptr;  ///< our a's block scales (GemmKey::a_scale_mode not 0), or its one scale (tensor_scales)
  const float* b_scale = nullptr;  ///< our b's
};

/// One algorithm cuBLASLt proposes for a problem, with the workspace it needs.
struct GemmCandidate {
  cublasLtMatmulAlgo_t algo;
  std::size_t workspace_bytes;
  float waves;
};

/// The descriptors of one problem key and the algorithm picked for it. Move-only. A plan with a fused
/// epilogue that cuBLASLt has no algorithm for is unavailable (available() false, and run() refuses);
/// one without an epilogue throws instead, since there is nothing to fall back to.
class GemmPlan {
 public:
  GemmPlan(cublasLtHandle_t handle, const GemmKey& key, const GemmArgs& args, std::size_t workspace_bytes) {
    try {
      build(key, args);
      const auto found = heuristics(handle, key, workspace_bytes, 1);
      if (found.empty()) {
        if (key.epilogue != GemmEpilogue::none) {
          destroy();
          return;
        }
        CUPIPE_THROW("gemm: cuBLASLt has no algorithm for (m, n, k) = (", key.m, ", ", key.n, ", ", key.k,
                     ") with these types, transposes and alignments");
      }
      available_ = true;
      algo_ = found.front().algo;
      workspace_ = found.front().workspace_bytes;
    } catch (...) {
      destroy();
      throw;
    }
  }
  GemmPlan(GemmPlan&& other) noexcept
      : desc_(std::exchange(other.desc_, nullptr)),
        a_(std::exchange(other.a_, nullptr)),
        b_(std::exchange(other.b_, nullptr)),
        c_(std::exchange(other.c_, nullptr)),
        algo_(other.algo_),
        workspace_(other.workspace_),
        available_(std::exchange(other.available_, false)) {}
  GemmPlan& operator=(GemmPlan&&) = delete;
  GemmPlan(const GemmPlan&) = delete;
  GemmPlan& operator=(const GemmPlan&) = delete;
  ~GemmPlan() { destroy(); }

  /// Up to `count` algorithms cuBLASLt proposes for this plan's problem, best first.
  std::vector<GemmCandidate> heuristics(cublasLtHandle_t handle, const GemmKey& key, std::size_t workspace_bytes,
                                        int count) const {
    if (desc_ == nullptr) return {};  // an unavailable plan keeps no descriptors
    cublasLtMatmulPreference_t pref = nullptr;
    CUPIPE_CHECK_CUBLAS(cublasLtMatmulPreferenceCreate(&pref));
    // An array, not a std::vector: nvcc 13.0's front end fails on vector<T> of this unnamed struct.
    std::unique_ptr<cublasLtMatmulHeuristicResult_t[]> results(new cublasLtMatmulHeuristicResult_t[count]());
    int found = 0;
    try {
      const std::uint64_t ws = workspace_bytes;
      const std::uint32_t align_a = key.align_b, align_b = key.align_a, align_c = key.align_c;  // swapped roles
      set_preference(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, ws);
      set_preference(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, align_a);
      set_preference(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, align_b);
      set_preference(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, align_c);
      set_preference(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, align_c);
      const cublasStatus_t status =
          cublasLtMatmulAlgoGetHeuristic(handle, desc_, a_, b_, c_, c_, pref, count, results.get(), &found);
      // No algorithm: NOT_SUPPORTED; for an epilogue this cuBLASLt cannot combine with these types,
      // some versions answer INVALID_VALUE instead. Either way the caller falls back.
      const bool none_found = status == CUBLAS_STATUS_NOT_SUPPORTED ||
                              (key.epilogue != GemmEpilogue::none && status == CUBLAS_STATUS_INVALID_VALUE);
      if (none_found) found = 0;
      else CUPIPE_CHECK_CUBLAS(status);
    } catch (...) {
      cublasLtMatmulPreferenceDestroy(pref);
      throw;
    }
    cublasLtMatmulPreferenceDestroy(pref);
    std::vector<GemmCandidate> out;
    for (int i = 0; i < found; ++i)
      if (results[i].state == CUBLAS_STATUS_SUCCESS)
        out.push_back({results[i].algo, results[i].workspaceSize, results[i].wavesCount});
    return out;
  }

  /// Sets this launch's pointers and enqueues the product on `stream`, with `algo` (default: the plan's).
  void run(cublasLtHandle_t handle, const GemmKey& key, const GemmArgs& args, void* workspace,
           std::size_t workspace_bytes, cudaStream_t stream, const cublasLtMatmulAlgo_t* algo = nullptr) {
    CUPIPE_REQUIRE(available_, "gemm: cuBLASLt has no algorithm for this fused epilogue; the caller must fall back");
    set_pointers(key, args);
    // cuBLASLt's A is our b and its B our a (see the top of this file).
    CUPIPE_CHECK_CUBLAS(cublasLtMatmul(handle, desc_, args.alpha, args.b, a_, args.a, b_, args.beta, args.c, c_,
                                       args.c, c_, algo ? algo : &algo_, workspace, workspace_bytes, stream));
  }

  std::size_t workspace_bytes() const noexcept { return workspace_; }
  /// Whether cuBLASLt offered an algorithm (always, without an epilogue).
  bool available() const noexcept { return available_; }

 private:
  template <class V>
  static void set_preference(cublasLtMatmulPreference_t pref, cublasLtMatmulPreferenceAttributes_t attribute,
                             const V& value) {
    CUPIPE_CHECK_CUBLAS(cublasLtMatmulPreferenceSetAttribute(pref, attribute, &value, sizeof value));
  }

  static cublasOperation_t op(ops::Transpose t) noexcept { return t == ops::Transpose::yes ? CUBLAS_OP_T : CUBLAS_OP_N; }

  void build(const GemmKey& key, const GemmArgs& args) {
    CUPIPE_CHECK_CUBLAS(cublasLtMatmulDescCreate(&desc_, key.compute, key.scale_type));
    const cublasOperation_t transa = op(key.tb), transb = op(key.ta);
    CUPIPE_CHECK_CUBLAS(cublasLtMatmulDescSetAttribute(desc_, CUBLASLT_MATMUL_DESC_TRANSA, &transa, sizeof transa));
    CUPIPE_CHECK_CUBLAS(cublasLtMatmulDescSetAttribute(desc_, CUBLASLT_MATMUL_DESC_TRANSB, &transb, sizeof transb));
    cublasLtEpilogue_t epilogue = CUBLASLT_EPILOGUE_DEFAULT;
    switch (key.epilogue) {
      case GemmEpilogue::none: break;
      case GemmEpilogue::bias: epilogue = CUBLASLT_EPILOGUE_BIAS; break;
      case GemmEpilogue::bias_gelu: epilogue = CUBLASLT_EPILOGUE_GELU_BIAS; break;
      case GemmEpilogue::bias_gelu_aux: epilogue = CUBLASLT_EPILOGUE_GELU_AUX_BIAS; break;
      case GemmEpilogue::dgelu: epilogue = CUBLASLT_EPILOGUE_DGELU; break;
      case GemmEpilogue::bgradb: epilogue = CUBLASLT_EPILOGUE_BGRADB; break;
    }
    CUPIPE_CHECK_CUBLAS(cublasLtMatmulDescSetAttribute(desc_, CUBLASLT_MATMUL_DESC_EPILOGUE, &epilogue, sizeof epilogue));
    if (uses_bias(key.epilogue)) {
      const std::int32_t bias_type = key.c_type;
      CUPIPE_CHECK_CUBLAS(
          cublasLtMatmulDescSetAttribute(desc_, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, &bias_type, sizeof bias_type));
    }
    if (key.a_scale_mode != 0 || key.b_scale_mode != 0) {  // cuBLASLt's A is our b, its B our a
      const std::int32_t a_mode = key.b_scale_mode, b_mode = key.a_scale_mode;
      CUPIPE_CHECK_CUBLAS(cublasLtMatmulDescSetAttribute(desc_, CUBLASLT_MATMUL_DESC_A_SCALE_MODE, &a_mode, sizeof a_mode));
      CUPIPE_CHECK_CUBLAS(cublasLtMatmulDescSetAttribute(desc_, CUBLASLT_MATMUL_DESC_B_SCALE_MODE, &b_mode, sizeof b_mode));
    }
    if (uses_aux(key.epilogue)) {
      const std::int64_t aux_ld = key.n;  // the pre-activation is row-major (m, n), like d
      CUPIPE_CHECK_CUBLAS(
          cublasLtMatmulDescSetAttribute(desc_, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD, &aux_ld, sizeof aux_ld));
    }
    set_pointers(key, args);  // the heuristic reads their alignment
    // Column-major views of the row-major operands: rows and columns swap, the leading dimension stays.
    const auto a_rows = key.ta == ops::Transpose::yes ? key.k : key.m, a_cols = key.ta == ops::Transpose::yes ? key.m : key.k;
    const auto b_rows = key.tb == ops::Transpose::yes ? key.n : key.k, b_cols = key.tb == ops::Transpose::yes ? key.k : key.n;
    CUPIPE_CHECK_CUBLAS(cublasLtMatrixLayoutCreate(&a_, key.ab_type, std::uint64_t(b_cols), std::uint64_t(b_rows), key.ldb));
    CUPIPE_CHECK_CUBLAS(cublasLtMatrixLayoutCreate(&b_, key.a_e5m2 ? CUDA_R_8F_E5M2 : key.ab_type, std::uint64_t(a_cols),
                                                   std::uint64_t(a_rows), key.lda));
    CUPIPE_CHECK_CUBLAS(cublasLtMatrixLayoutCreate(&c_, key.c_type, std::uint64_t(key.n), std::uint64_t(key.m), key.ldc));
  }

  void set_pointers(const GemmKey& key, const GemmArgs& args) {
    if (key.a_scale_mode != 0 || key.b_scale_mode != 0 || key.tensor_scales) {
      CUPIPE_REQUIRE(args.a_scale && args.b_scale, "gemm: scaled FP8 needs both operands' scales");
      CUPIPE_CHECK_CUBLAS(
          cublasLtMatmulDescSetAttribute(desc_, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &args.b_scale, sizeof args.b_scale));
      CUPIPE_CHECK_CUBLAS(
          cublasLtMatmulDescSetAttribute(desc_, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &args.a_scale, sizeof args.a_scale));
    }
    if (uses_bias(key.epilogue))
      CUPIPE_CHECK_CUBLAS(
          cublasLtMatmulDescSetAttribute(desc_, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &args.bias, sizeof args.bias));
    if (uses_aux(key.epilogue))
      CUPIPE_CHECK_CUBLAS(
          cublasLtMatmulDescSetAttribute(desc_, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, &args.aux, sizeof args.aux));
  }

  void destroy() noexcept {
    if (c_) cublasLtMatrixLayoutDestroy(c_);
    if (b_) cublasLtMatrixLayoutDestroy(b_);
    if (a_) cublasLtMatrixLayoutDestroy(a_);
    if (desc_) cublasLtMatmulDescDestroy(desc_);
    c_ = b_ = a_ = nullptr;
    desc_ = nullptr;
  }

  cublasLtMatmulDesc_t desc_ = nullptr;
  cublasLtMatrixLayout_t a_ = nullptr, b_ = nullptr, c_ = nullptr;  // in cuBLASLt's roles
  cublasLtMatmulAlgo_t algo_{};
  std::size_t workspace_ = 0;
  bool available_ = false;
};

/// Plans by key, built on first use. Owned by one context, so used by one thread at a time.
class GemmPlanCache {
 public:
  GemmPlan& get(cublasLtHandle_t handle, const GemmKey& key, const GemmArgs& args, std::size_t workspace_bytes) {
    if (auto it = plans_.find(key); it != plans_.end()) {
      ++hits_;
      return it->second;
    }
    ++misses_;
    return plans_.try_emplace(key, handle, key, args, workspace_bytes).first->second;
  }
  std::size_t size() const noexcept { return plans_.size(); }
  std::size_t hits() const noexcept { return hits_; }
  std::size_t misses() const noexcept { return misses_; }
  void clear() noexcept { plans_.clear(); }

 private:
  std::unordered_map<GemmKey, GemmPlan, GemmKeyHash> plans_;
  std::size_t hits_ = 0, misses_ = 0;
};

}  // namespace cupipe::backend::cuda
