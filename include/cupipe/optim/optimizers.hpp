// SPDX-License-Identifier: Apache-2.0
// Optimizers: hyper-parameters, a learning-rate schedule and global-norm clipping. The arithmetic is
// an op (ops::sgd_update, ops::adamw_update), so every backend runs its own fused update. State
// tensors ("slots") are owned by whoever owns the parameters (a Network, a pipeline stage), one
// flat array per slot, named like torch.optim's state ("momentum_buffer", "exp_avg", "exp_avg_sq").
// Weight decay applies to every parameter, or (DecayOn::matrices) to the tensors of two or more
// dimensions only; update_runs applies an optimizer to a flat array tensor run by tensor run.
#pragma once

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <span>
#include <string_view>
#include <vector>

#include "cupipe/backend/op_types.hpp"
#include "cupipe/core/error.hpp"
#include "cupipe/core/tensor.hpp"
#include "cupipe/optim/lr_schedule.hpp"

namespace cupipe::optim {

/// PyTorch's clip_grad_norm_ factor: min(1, max_norm / (norm + 1e-6)); 1 when clipping is off.
inline double clip_factor(double global_norm, double max_norm) noexcept {
  if (max_norm <= 0 || !std::isfinite(global_norm)) return 1.0;
  return std::min(1.0, max_norm / (global_norm + 1e-6));
}

/// Which parameters weight decay applies to.
enum class DecayOn {
  all,       ///< every parameter, as torch.optim with one parameter group
  matrices,  ///< tensors of two or more dimensions (products' weights, embeddings), not biases or
             ///< LayerNorm's gain and shift: GPT-2's and nanoGPT's two parameter groups
};

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
  DecayOn decay_on = DecayOn::all;  ///< with update_runs: which tensors weight_decay applies to
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
  DecayOn decay_on = DecayOn::all;  ///< with update_runs: which tensors weight_decay applies to
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

/// [begin, end) of a flat parameter array, whose tensors weight decay treats alike.
struct DecayRun {
  index_t begin = 0, end = 0;
  bool decays = true;
};

/// The runs of the flat array whose tensors `table` lists in flat order (entries with offset, numel
/// and shape, as Sequential's parameter_table() gives them): tensors of two or more dimensions decay
/// under DecayOn::matrices, the others not; neighbours of one kind merge.
template <class Table>
std::vector<DecayRun> decay_runs(const Table& table) {
  std::vector<DecayRun> runs;
  for (const auto& p : table) {
    const bool decays = p.shape.rank() >= 2;
    if (!runs.empty() && runs.back().end == p.offset && runs.back().decays == decays) runs.back().end = p.offset + p.numel;
    else runs.push_back({p.offset, p.offset + p.numel, decays});
  }
  return runs;
}

/// One update of [begin, begin + n) of a flat parameter array (`param`, `grad` and `slots` its n
/// values) whose tensors `runs` covers: one call of optimizer.update with DecayOn::all (or no decay),
/// else one per run inside the range, with weight decay 0 where a run does not decay. The updates are
/// element-wise, so the decayed values are bitwise those of one call over the whole array.
template <class O, class B, class T>
void update_runs(const O& optimizer, std::span<const DecayRun> runs, index_t begin, B& be, ViewOn<B, T> param,
                 ConstViewOn<B, T> grad, std::span<const ViewOn<B, T>> slots, std::int64_t step, double grad_scale) {
  if (optimizer.options.decay_on == DecayOn::all || optimizer.options.weight_decay == 0) {
    optimizer.update(be, param, grad, slots, step, grad_scale);
    return;
  }
  O without = optimizer;
  without.options.weight_decay = 0;
  const index_t end = begin + param.numel();
  std::vector<ViewOn<B, T>> part(slots.size());
  index_t done = begin;
  for (const DecayRun& run : runs) {
    const index_t from = std::max(run.begin, begin), to = std::min(run.end, end);
    if (to <= from) continue;
    CUPIPE_REQUIRE(from == done, "update_runs: no tensor covers parameters [", done, ", ", from, ")");
    const index_t at = from - begin;
    for (std::size_t k = 0; k < slots.size(); ++k) part[k] = {slots[k].data() + at, Shape{to - from}};
    (run.decays ? optimizer : without)
        .update(be, ViewOn<B, T>{param.data() + at, Shape{to - from}}, ConstViewOn<B, T>{grad.data() + at, Shape{to - from}},
                std::span<const ViewOn<B, T>>(part), step, grad_scale);
    done = to;
  }
  CUPIPE_REQUIRE(done == end, "update_runs: no tensor covers parameters [", done, ", ", end, ")");
}

}  // namespace cupipe::optim
