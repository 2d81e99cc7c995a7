// SPDX-License-Identifier: Apache-2.0
// The trainers' measured step time: the median of the wall times of a run's train_step calls.
#pragma once

#include <algorithm>
#include <cstddef>
#include <vector>

namespace cupipe::examples {

/// The median of `times`, the first left out when there are more (it allocates the optimizer's
/// slots); 0 when there are none. Leaves in `times` the ones it took the median of, reordered.
inline double median_step_seconds(std::vector<double>& times) {
  if (times.size() > 1) times.erase(times.begin());
  if (times.empty()) return 0;
  std::nth_element(times.begin(), times.begin() + std::ptrdiff_t(times.size() / 2), times.end());
  return times[times.size() / 2];
}

}  // namespace cupipe::examples
