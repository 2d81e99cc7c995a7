// SPDX-License-Identifier: Apache-2.0
// Learning-rate schedules: linear warm-up, then cosine decay.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numbers>

namespace cupipe::optim {

/// Multiplies the base learning rate. Warm-up rises linearly from 1/warmup_steps to 1 over the first
/// warmup_steps updates; then, if total_steps > 0, a cosine decays it to min_factor at total_steps and
/// holds it there. total_steps == 0 means constant after warm-up.
struct LrSchedule {
  std::int64_t warmup_steps = 0;
  std::int64_t total_steps = 0;
  double min_factor = 0.0;

  /// Factor for the update with 0-based index `step`.
  double factor(std::int64_t step) const noexcept {
    if (step < warmup_steps) return double(step + 1) / double(warmup_steps);
    if (total_steps <= warmup_steps) return 1.0;
    const double progress =
        std::clamp(double(step - warmup_steps) / double(total_steps - warmup_steps), 0.0, 1.0);
    return min_factor + (1.0 - min_factor) * 0.5 * (1.0 + std::cos(std::numbers::pi * progress));
  }
};

}  // namespace cupipe::optim
