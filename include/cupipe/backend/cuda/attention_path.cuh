// SPDX-License-Identifier: Apache-2.0
// Which kernels a CUDA context's causal attention runs, and why: the one place that decides.
//
//   automatic  cuDNN's fused SDPA (cudnn_attention.hpp) for bf16 storage where cupipe was built with
//              it (CUPIPE_HAS_CUDNN) and cuDNN builds both graphs for the call's sizes; otherwise the
//              simple kernels, the path a GPU has checked longest.
//   cudnn      cuDNN's, or an error that says why it cannot run (float storage, no cuDNN, a refusal).
//   mma        our flash attention on tensor cores (kernels/attention_mma.cuh): bf16 storage, heads of
//              32, 64 or 128 columns; other calls run the simple kernels. Opt in until a GPU has run it.
//   tiled      our 64-row tiles (kernels/attention_tiled.cuh), where the head fits (<= 64 columns);
//              other heads run the simple kernels.
//   simple     the reference kernels (kernels/attention.cuh): a warp per query or key.
//
// A context starts from backend::cuda::default_attention(): CUPIPE_ATTENTION in the environment (auto, cudnn,
// mma, tiled, simple or reference), automatic when unset. Set backend::Cuda::attention to change one.
// The forward and the backward of one call must take the same path only in that both read and write
// the op's own layouts (the cuDNN path transposes its statistics), so a context may switch between
// them; a trainer prints describe() of its first attention layer's choice.
#pragma once

#include <cstdint>
#include <cstdlib>
#include <memory>
#include <string>
#include <string_view>

#include "cupipe/backend/cuda/cudnn_attention.hpp"
#include "cupipe/backend/cuda/kernels/attention_mma.cuh"
#include "cupipe/core/error.hpp"

namespace cupipe::backend::cuda {

/// Which causal-attention kernels a context runs (see the top of this file).
enum class AttentionKernel : std::uint8_t {
  automatic,  ///< cuDNN's fused SDPA where it runs (bf16), else simple
  simple,     ///< a warp per query or key, K and V read from global memory per query; every head size
  tiled,      ///< 64-row tiles in shared memory (FlashAttention-2's blocking); heads of up to 64 columns
  cudnn,      ///< cuDNN's fused SDPA on tensor cores: bf16 storage, needs CUPIPE_HAS_CUDNN
  mma,        ///< our flash attention on tensor cores (mma.sync): bf16 storage, heads of 32, 64 or 128
};

inline std::string_view to_string(AttentionKernel kernel) noexcept {
  switch (kernel) {
    case AttentionKernel::automatic: return "auto";
    case AttentionKernel::simple: return "simple";
    case AttentionKernel::tiled: return "tiled";
    case AttentionKernel::cudnn: return "cudnn";
    case AttentionKernel::mma: return "mma";
  }
  return "?";
}

/// "auto", "cudnn", "mma", "tiled", "simple" or "reference" (the simple kernels); anything else throws,
/// naming `where` the text came from.
inline AttentionKernel parse_attention(std::string_view text, std::string_view where = "attention kernel") {
  if (text == "auto" || text == "automatic") return AttentionKernel::automatic;
  if (text == "cudnn") return AttentionKernel::cudnn;
  if (text == "mma") return AttentionKernel::mma;
  if (text == "tiled") return AttentionKernel::tiled;
  if (text == "simple" || text == "reference") return AttentionKernel::simple;
  CUPIPE_THROW(where, ": '", text, "' is not an attention path; use auto, cudnn, mma, tiled or simple (reference)");
}

/// CUPIPE_ATTENTION from the environment, read each time a context is made; automatic when unset.
inline AttentionKernel default_attention() {
  const char* text = std::getenv("CUPIPE_ATTENTION");
  return text == nullptr || *text == '\0' ? AttentionKernel::automatic : parse_attention(text, "CUPIPE_ATTENTION");
}

/// True where this program was built with cuDNN's attention (linked to cupipe::cudnn).
inline constexpr bool built_with_cudnn =
#if defined(CUPIPE_HAS_CUDNN) && CUPIPE_HAS_CUDNN
    true;
#else
    false;
#endif

/// The path one call takes: `kernel` is never automatic; `reason` says why automatic or a request
/// ended there (empty where the request was taken as is).
struct AttentionChoice {
  AttentionKernel kernel = AttentionKernel::simple;
  std::string reason;
  /// One line for a trainer's header: "cudnn (cuDNN 9.19.0, frontend 1.32.0)", "simple (no cuDNN: ...)".
  std::string describe() const;
};

/// One context's cuDNN attention state: the engine, made on first use on the context's device (the
/// caller's DeviceGuard). Layout and behaviour are the same in every build; without CUPIPE_HAS_CUDNN
/// it only refuses. shared_ptr, whose deleter lives where the engine is made, so a build without
/// cuDNN links nothing of it.
class CudnnAttention {
 public:
  /// Empty when cuDNN runs these sizes here; else why not.
  std::string refusal(cudnn_attention::Sizes sizes) {
    if constexpr (!built_with_cudnn) {
      (void)sizes;
      return "this program was built without cuDNN's frontend (link cupipe::cudnn; scripts/setup.sh installs it)";
    } else {
      if (!engine_ && broken_.empty()) {
        try {
          engine_ = std::shared_ptr<cudnn_attention::Engine>(cudnn_attention::make_engine().release(), cudnn_attention::EngineDeleter{});
        } catch (const std::exception& e) {
          broken_ = std::string("cuDNN did not start: ") + e.what();
        }
      }
      if (!broken_.empty()) return broken_;
      return cudnn_attention::refusal(*engine_, sizes);
    }
  }
  /// The engine; only after refusal() returned empty.
  cudnn_attention::Engine& engine() { return *engine_; }

 private:
  std::shared_ptr<cudnn_attention::Engine> engine_;
  std::string broken_;
};

/// The path for one call: `requested` as set on the context, `bf16` whether storage is bf16 (with
/// float compute), `tiled_takes` whether the tiled kernels take this head size.
inline AttentionChoice choose_attention(AttentionKernel requested, bool bf16, bool tiled_takes, cudnn_attention::Sizes sizes,
                                        CudnnAttention& cudnn) {
  switch (requested) {
    case AttentionKernel::simple: return {AttentionKernel::simple, {}};
    case AttentionKernel::mma: {
      if (bf16 && kernels::attention_mma::takes_head(sizes.head_dim)) return {AttentionKernel::mma, {}};
      return {AttentionKernel::simple, bf16 ? "the mma kernels take heads of 32, 64 or 128 columns, not " + std::to_string(sizes.head_dim)
                                            : std::string("the mma kernels take bf16 storage only")};
    }
    case AttentionKernel::tiled:
      if (tiled_takes) return {AttentionKernel::tiled, {}};
      return {AttentionKernel::simple, "the tiled kernels take heads of up to 64 columns, not " + std::to_string(sizes.head_dim)};
    case AttentionKernel::cudnn:
    case AttentionKernel::automatic: {
      std::string why = bf16 ? cudnn.refusal(sizes) : "cuDNN's fused attention takes bf16 storage only";
      if (why.empty()) return {AttentionKernel::cudnn, {}};
      if (requested == AttentionKernel::cudnn)
        CUPIPE_THROW("causal attention: the cuDNN path was asked for (CUPIPE_ATTENTION or backend.attention) but cannot run "
                     "B ", sizes.batch, ", T ", sizes.seq_len, ", H ", sizes.heads, ", D ", sizes.head_dim, ": ", why);
      return {AttentionKernel::simple, "cuDNN not used: " + why};
    }
  }
  return {AttentionKernel::simple, {}};
}

inline std::string AttentionChoice::describe() const {
  std::string line(to_string(kernel));
  if constexpr (built_with_cudnn) {
    if (kernel == AttentionKernel::cudnn) {
      const auto version = [](std::size_t v, std::size_t major_unit) {
        return std::to_string(v / major_unit) + "." + std::to_string(v % major_unit / 100) + "." + std::to_string(v % 100);
      };
      line += " (cuDNN " + version(cudnn_attention::library_version(), 10000) + ", frontend " +
              version(cudnn_attention::frontend_version(), 10000) + ")";
    }
  }
  if (!reason.empty()) line += " (" + reason + ")";
  return line;
}

}  // namespace cupipe::backend::cuda
