// SPDX-License-Identifier: Apache-2.0
// Optimizers: hyper-parameters, a learning-rate schedule and global-norm clipping. The arithmetic is
// an op (ops::sgd_update, ops::adamw_update), so every backend runs its own fused update. State
// tensors ("slots") are owned by whoever owns the parameters (a Network, a pipeline stage), one
// flat array per slot, named like torch.optim's state ("momentum_buffer", "exp_avg", "exp_avg_sq").
#pragma once

#include <array>
#include <cmath>
#include <cstdint>
#include <span>
#include <string_view>

#include "cupipe/backend/op_types.hpp"
#include "cupipe/core/tensor.hpp"
#include "cupipe/optim/lr_schedule.hpp"

namespace cupipe::optim {

/// PyTorch's clip_grad_norm_ factor: min(1, max_norm / (norm + 1e-6)); 1 when clipping is off.
inline double clip_factor(double global_norm, double max_norm) noexcept {
  if (max_norm <= 0 || !std::isfinite(global_norm)) return 1.0;
  return std::min(1.0, max_norm / (global_norm + 1e-6));
}

namespace detail {
/// What every optimizer does alike with its options: keeps them, and reads the learning rate of a step
/// (lr times the schedule's factor) and the global gradient-norm clip from them.
template <class O>
struct WithOptions {
  using Options = O;
  Options options;

  WithOptions() = default;
  explicit WithOptions(Options o) : options(o) {}

  double lr(std::int64_t step) const noexcept { return options.lr * options.schedule.factor(step); }
  double clip_norm() const noexcept { return options.clip_norm; }
};
}  // namespace detail

/// SGD's hyper-parameters (SGD::Options).
struct SgdOptions {
  double lr = 0.01;
  double momentum = 0.0;
  double weight_decay = 0.0;
  bool nesterov = false;
  double clip_norm = 0.0;  ///< global gradient-norm clip; 0 = off
  LrSchedule schedule{};
};

/// SGD with momentum (PyTorch semantics, dampening 0).
struct SGD : detail::WithOptions<SgdOptions> {
  using WithOptions::WithOptions;
  static constexpr std::string_view name = "sgd";
  static constexpr std::array<std::string_view, 1> slot_names{"momentum_buffer"};

  /// One update of `param` from `grad` (times grad_scale); `step` is the 0-based update index.
  template <class B, class T>
  void update(B& be, ViewOn<B, T> param, ConstViewOn<B, T> grad, std::span<const ViewOn<B, T>> slots,
              std::int64_t step, double grad_scale) const {
    const ops::SgdHyper h{lr(step), options.momentum, options.weight_decay, options.nesterov};
    sgd_update(be, param, grad, slots[0], h, T(grad_scale));
  }
};

/// AdamW's hyper-parameters (AdamW::Options).
struct AdamWOptions {
  double lr = 1e-3;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 0.01;
  double clip_norm = 0.0;  ///< global gradient-norm clip; 0 = off
  LrSchedule schedule{};
};

/// AdamW (Loshchilov & Hutter, ICLR 2019), PyTorch semantics: decoupled weight decay.
struct AdamW : detail::WithOptions<AdamWOptions> {
  using WithOptions::WithOptions;
  static constexpr std::string_view name = "adamw";
  static constexpr std::array<std::string_view, 2> slot_names{"exp_avg", "exp_avg_sq"};

  template <class B, class T>
  void update(B& be, ViewOn<B, T> param, ConstViewOn<B, T> grad, std::span<const ViewOn<B, T>> slots,
              std::int64_t step, double grad_scale) const {
    const ops::AdamWHyper h{lr(step), options.beta1, options.beta2, options.eps, options.weight_decay};
    adamw_update(be, param, grad, slots[0], slots[1], h, step + 1, T(grad_scale));
  }
};

template <class O>
concept Optimizer = requires(const O& o) {
  { O::slot_names.size() } -> std::convertible_to<std::size_t>;
  { o.lr(std::int64_t{0}) } -> std::convertible_to<double>;
  { o.clip_norm() } -> std::convertible_to<double>;
};

}  // namespace cupipe::optim
