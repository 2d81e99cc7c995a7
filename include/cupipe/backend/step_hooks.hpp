// SPDX-License-Identifier: Apache-2.0
// A backend context's hooks into the training step, for contexts whose ops keep state across a step
// (others ignore them):
// - backend::end_step: the point where such a context closes the step. Today that is FP8 delayed scaling (backend::HostFp8<fp8::PerTensorDelayed>): its GEMMs gather
// their operands' amaxes through the step, and end_step reduces them over the context's
// tensor-parallel group and records them (fp8/recipe.hpp). Every stage update calls it
// (pipeline::update_stage), so every rank of a tensor-parallel group calls it at the same point of
// the same step, whatever the schedule; a context without such state does nothing.
// - backend::Inference: while one lives, the context's forwards are inference (Pipeline::predict, an
//   evaluation between steps) and leave that state alone: an evaluation does not change training.
#pragma once

namespace cupipe::backend {

template <class B>
void end_step(B& be) {
  if constexpr (requires { be.end_step(); }) be.end_step();
}

/// Marks the context's work as inference while it lives (be.inference(true), then false).
template <class B>
class Inference {
 public:
  explicit Inference(B& be) : be_(be) {
    if constexpr (requires { be.inference(true); }) be.inference(true);
  }
  ~Inference() {
    if constexpr (requires { be_.inference(false); }) be_.inference(false);
  }
  Inference(const Inference&) = delete;
  Inference& operator=(const Inference&) = delete;

 private:
  B& be_;
};

}  // namespace cupipe::backend
