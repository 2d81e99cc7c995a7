// SPDX-License-Identifier: Apache-2.0
// Shape-preserving activations (LayerDefaults' widths). They save nothing beyond their input.
#pragma once

#include <string>

#include "cupipe/layers/layer.hpp"

namespace cupipe {

struct ReLU : LayerDefaults {
  static constexpr double forward_flops_per_sample(index_t in) { return double(in); }
  static std::string describe() { return "ReLU"; }

  template <class B, class T>
  static void forward(B& be, const T*, ConstViewOn<B, T> x, ViewOn<B, T> y, ViewOn<B, T>) { relu_forward(be, x, y); }
  template <class B, class T>
  static void backward_input(B& be, const T*, ConstViewOn<B, T> x, ConstViewOn<B, T>, ConstViewOn<B, T> dy, ViewOn<B, T> dx) {
    relu_backward(be, x, dy, dx);
  }
};

/// GELU, tanh approximation (torch.nn.GELU(approximate="tanh"), as in GPT-2).
struct GELU : LayerDefaults {
  static constexpr double forward_flops_per_sample(index_t in) { return 8.0 * double(in); }
  static std::string describe() { return "GELU"; }

  template <class B, class T>
  static void forward(B& be, const T*, ConstViewOn<B, T> x, ViewOn<B, T> y, ViewOn<B, T>) { gelu_forward(be, x, y); }
  template <class B, class T>
  static void backward_input(B& be, const T*, ConstViewOn<B, T> x, ConstViewOn<B, T>, ConstViewOn<B, T> dy, ViewOn<B, T> dx) {
    gelu_backward(be, x, dy, dx);
  }
};

}  // namespace cupipe
