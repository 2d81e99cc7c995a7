// SPDX-License-Identifier: Apache-2.0
// An identity layer that calls Hook() before each forward: the MPI checks make a rank stall or die
// there, in the middle of a step.
#pragma once

#include <string>

#include "cupipe/cupipe.hpp"

template <void (*Hook)()>
struct HookLayer : cupipe::Stateless {
  static constexpr cupipe::index_t in_features = cupipe::any_features;
  static constexpr cupipe::index_t out_features_for(cupipe::index_t in) { return in; }
  static constexpr double forward_flops_per_sample(cupipe::index_t) { return 0; }
  static std::string describe() { return "HookLayer"; }
  template <class B, class T>
  static void forward(B& be, const T*, cupipe::ConstView<T> x, cupipe::TensorView<T> y, cupipe::TensorView<T>) {
    Hook();
    copy(be, x, y);
  }
  template <class B, class T>
  static void backward_input(B& be, const T*, cupipe::ConstView<T>, cupipe::ConstView<T>, cupipe::ConstView<T> dy,
                             cupipe::TensorView<T> dx) {
    copy(be, dy, dx);
  }
};
