// SPDX-License-Identifier: Apache-2.0
// Types shared by every backend's ops: the contract that host ops define and CUDA ops mirror.
#pragma once

#include <cstdint>

#include "cupipe/core/dtype.hpp"

namespace cupipe::ops {

/// Every backend context derives from this empty type. That makes cupipe::ops an associated
/// namespace of every backend, so layers call ops unqualified (`gemm(be, ...)`) and argument-dependent
/// lookup finds the overload for their backend wherever it was declared, before or after the layer.
struct Dispatch {};

/// A scalar argument of a bf16 op (host or CUDA): layers pass their storage type (bfloat16(1)), callers in the
/// compute precision a float or double; the op computes with its float value.
struct ComputeScalar {
  float value;
  ComputeScalar(float v) : value(v) {}                          // NOLINT(google-explicit-constructor)
  ComputeScalar(double v) : value(static_cast<float>(v)) {}     // NOLINT(google-explicit-constructor)
  ComputeScalar(int v) : value(static_cast<float>(v)) {}        // NOLINT(google-explicit-constructor)
  ComputeScalar(bfloat16 v) : value(static_cast<float>(v)) {}   // NOLINT(google-explicit-constructor)
};

/// The tanh-form GELU (Hendrycks & Gimpel, as in GPT-2) of every backend:
///   gelu(x) = 0.5 x (1 + tanh(gelu_k (x + gelu_c x^3))).
inline constexpr double gelu_k = 0.7978845608028654;  // sqrt(2 / pi)
inline constexpr double gelu_c = 0.044715;

/// The part of a vocabulary one tensor-parallel rank holds (a vocabulary-parallel embedding table's
/// rows, a vocabulary-parallel head's logit columns): entries [first, first + count) of `whole`, where
/// count is the table's rows or the logits' columns. Token ids and labels are checked against the
/// whole vocabulary; those outside the part belong to another rank. A whole table is {0, its rows}.
struct VocabPart {
  std::int64_t first = 0;
  std::int64_t whole = 0;
};

/// Whether a GEMM operand is used as stored (row-major) or transposed.
enum class Transpose : std::uint8_t { no, yes };

/// SGD with momentum, PyTorch semantics (dampening 0):
///   g = grad * grad_scale + weight_decay * p;  v = momentum * v + g;
///   p -= lr * (nesterov ? g + momentum * v : v).
struct SgdHyper {
  double lr = 0.01;
  double momentum = 0.0;
  double weight_decay = 0.0;
  bool nesterov = false;
};

/// AdamW, PyTorch semantics (decoupled weight decay):
///   p *= 1 - lr * weight_decay;  m = b1 m + (1 - b1) g;  v = b2 v + (1 - b2) g^2;
///   p -= lr * (m / (1 - b1^step)) / (sqrt(v / (1 - b2^step)) + eps),  with g = grad * grad_scale.
struct AdamWHyper {
  double lr = 1e-3;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 0.01;
};

}  // namespace cupipe::ops
