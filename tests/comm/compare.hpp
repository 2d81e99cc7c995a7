// SPDX-License-Identifier: Apache-2.0
// What the MPI checks compare with: the largest difference relative to the reference's largest value,
// and a number printed with all the digits a double comparison needs.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

namespace cupipe::testing {

/// max |a - b| / max |b| (max |a - b| when b is all zeros); infinite when the sizes differ.
inline double relative(const std::vector<double>& a, const std::vector<double>& b) {
  if (a.size() != b.size()) return INFINITY;
  double diff = 0, norm = 0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    diff = std::max(diff, std::abs(a[i] - b[i]));
    norm = std::max(norm, std::abs(b[i]));
  }
  return norm > 0 ? diff / norm : diff;
}

/// `v` with 15 significant digits.
inline std::string number(double v) {
  char text[32];
  std::snprintf(text, sizeof text, "%.15g", v);
  return text;
}

}  // namespace cupipe::testing
