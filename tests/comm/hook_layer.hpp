// SPDX-License-Identifier: Apache-2.0
// An identity layer that calls Hook() before each forward: the MPI checks make a rank stall or die
// there, in the middle of a step.
#pragma once

#include <string>

#include "../support/identity_layers.hpp"
#include "cupipe/cupipe.hpp"

template <void (*Hook)()>
struct HookBeforeForward : cupipe::test::NoHooks {
  static void forward(const auto&) { Hook(); }
};

template <void (*Hook)()>
struct HookLayer : cupipe::test::Identity<HookBeforeForward<Hook>> {
  static std::string describe() { return "HookLayer"; }
};
