// SPDX-License-Identifier: Apache-2.0
// cuDNN's fused scaled-dot-product attention (flash attention on tensor cores, cuDNN 9) for the causal
// self-attention op, bf16 in and out with fp32 softmax statistics, through the cuDNN frontend's graph
// API. The op (ops::causal_attention_forward / _backward in backend/cuda/ops.cuh) picks this path,
// our kernels, or the reference ones (backend/cuda/attention_path.cuh); this header is what it calls.
//
// The code that includes the cuDNN frontend lives in one translation unit,
// src/backend/cuda/cudnn_attention.cpp, compiled once into the static library cupipe::cudnn: the
// frontend's headers take about half a minute to compile, and llm.c halved its build by keeping them
// in one file. Only programs built with CUPIPE_HAS_CUDNN (set by linking cupipe::cudnn) call it.
//
// Layouts: qkv (B * T, 3 C) rows [q | k | v], head h in columns [h D, (h + 1) D) of each part, read
// by strides with no permute; out (B * T, C) and dqkv (B * T, 3 C) written the same way. The softmax
// statistics (natural-log log-sum-exp of the scaled scores) are (B, H, T) here, as cuDNN before 9.26
// reads them in its backward whatever strides it is given; the op transposes them to and from its
// own (B * T, H).
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

namespace cupipe::backend::cuda::cudnn_attention {

/// One call's sizes: `batch` sequences of `seq_len` tokens, `heads` heads of `head_dim` columns.
struct Sizes {
  std::int64_t batch = 0, seq_len = 0, heads = 0, head_dim = 0;
  friend bool operator==(const Sizes&, const Sizes&) = default;
  friend auto operator<=>(const Sizes&, const Sizes&) = default;
};

/// One context's cuDNN state: a handle and the graphs built so far, a forward and a backward per
/// Sizes (building one takes tens to hundreds of milliseconds; running it, microseconds of host
/// time). Made for the device current when make_engine() runs; used by one thread at a time.
class Engine;
struct EngineDeleter {
  void operator()(Engine* engine) const noexcept;
};
using EnginePtr = std::unique_ptr<Engine, EngineDeleter>;

/// A new engine on the current device. Throws cupipe::error naming the cuDNN call that failed.
EnginePtr make_engine();

/// The cuDNN library's version at run time (cudnnGetVersion: 91900 for 9.19.0) and the frontend's
/// this was compiled with (13200 for 1.32.0), for the line a trainer prints.
std::size_t library_version() noexcept;
std::size_t frontend_version() noexcept;

/// Empty when cuDNN runs both the forward and the backward graph for these sizes on this device;
/// otherwise cuDNN's reason, one line. Builds and keeps both graphs the first time.
std::string refusal(Engine& engine, Sizes sizes);

/// Workspace bytes each graph needs (0 when refusal() is not empty).
std::size_t forward_workspace(Engine& engine, Sizes sizes);
std::size_t backward_workspace(Engine& engine, Sizes sizes);

/// out and the statistics (B, H, T) from qkv, causal, scale 1 / sqrt(head_dim), on `stream`.
/// Pointers are bf16 (__nv_bfloat16) but for the statistics. Throws where refusal() is not empty.
void forward(Engine& engine, cudaStream_t stream, Sizes sizes, const void* qkv, void* out, float* stats, void* workspace);

/// dqkv (overwritten) from dout, deterministically (cuDNN's deterministic backward).
void backward(Engine& engine, cudaStream_t stream, Sizes sizes, const void* qkv, const void* out, const float* stats,
              const void* dout, void* dqkv, void* workspace);

}  // namespace cupipe::backend::cuda::cudnn_attention
