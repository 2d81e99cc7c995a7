// SPDX-License-Identifier: Apache-2.0
// Identity layers for the runtime's tests and benchmarks: y = x and dx = dy, with a hook before each
// pass, so a test can make a chosen layer sleep, log its actions or fail mid-step while the numbers
// stay those of the layers around it. They show how little a layer needs beside LayerDefaults.
#pragma once

#include <array>
#include <span>

#include "cupipe/layers/layer.hpp"

namespace cupipe::test {

/// Hooks that do nothing; a layer's own hooks derive from it and hide the ones they need. Each gets
/// the pass's input view: x for forward and backward_weight, dy for backward_input.
struct NoHooks {
  static void forward(const auto&) {}
  static void backward_input(const auto&) {}
  static void backward_weight(const auto&) {}
};

/// An identity without parameters, shape-preserving and free in the cost model unless the layer
/// deriving from it says otherwise (a fixed in_features, a forward_flops_per_sample).
template <class Hooks = NoHooks>
struct Identity : LayerDefaults {
  template <class B, class T>
  static void forward(B& be, const T*, ConstViewOn<B, T> x, ViewOn<B, T> y, ViewOn<B, T>) {
    Hooks::forward(x);
    copy(be, x, y);
  }
  template <class B, class T>
  static void backward_input(B& be, const T*, ConstViewOn<B, T>, ConstViewOn<B, T>, ConstViewOn<B, T> dy, ViewOn<B, T> dx) {
    Hooks::backward_input(dy);
    copy(be, dy, dx);
  }
};

/// An identity with one parameter ("scale", ones, never read) and one FLOP per value, so that its
/// weight gradient is an action of its own (W), which the zero-bubble schedules place apart from B.
template <class Hooks = NoHooks>
struct IdentityWithWeight : Identity<Hooks> {
  static constexpr std::array<ParamSpec, 1> params(index_t) { return {{{"scale", 1, 0}}}; }
  static constexpr double forward_flops_per_sample(index_t in) { return double(in); }
  template <class T>
  static void init(std::span<T> p, index_t, Rng&) {
    for (T& v : p) v = T(1);
  }
  template <class B, class T>
  static void backward_weight(B&, ConstViewOn<B, T> x, ConstViewOn<B, T>, ConstViewOn<B, T>, T*) {
    Hooks::backward_weight(x);
  }
};

}  // namespace cupipe::test
