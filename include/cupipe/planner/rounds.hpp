// SPDX-License-Identifier: Apache-2.0
// How planner::calibrate repeats a measurement: in rounds, more of them where they disagree, and
// the median over them; and what it records of that (CostModel::calibration_spread, _rounds), which
// the report prints as the prediction's confidence.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdlib>
#include <string_view>
#include <vector>

namespace cupipe::planner {

namespace detail {
/// The median of `values` (the upper one of an even count); at least one value.
inline double median(std::vector<double> values) {
  std::nth_element(values.begin(), values.begin() + std::ptrdiff_t(values.size() / 2), values.end());
  return values[values.size() / 2];
}

/// The relative spread of repeated measurements: their median absolute deviation over their median
/// (0 for fewer than two, or a median of 0).
inline double relative_spread(const std::vector<double>& values) {
  if (values.size() < 2) return 0.0;
  const double mid = median(values);
  std::vector<double> deviations;
  for (const double v : values) deviations.push_back(std::abs(v - mid));
  return mid > 0 ? median(std::move(deviations)) / mid : 0.0;
}

/// How often a calibration repeats a measurement: at least `least` rounds, and more, up to `most`,
/// while the rounds' relative spread is above `tolerance`. A quiet machine stops at `least`; a busy
/// stretch buys more rounds, and the median over them (not the smallest, which a profile taken in a
/// quiet moment makes too fast for the steps that follow) is the figure.
struct Rounds {
  int least = 3;
  int most = 7;
  double tolerance = 0.02;
};

/// Whether CUPIPE_CALIBRATION=quick is set in the environment: then every measurement that
/// calibrate repeats in rounds takes one round, planner::calibrate times each action once (its
/// `repeats` 1), and the report says that the spread was not measured. For runs that check what
/// the planner does, not how well it predicts: CI's sanitizer stage, whose code runs about ten
/// times slower (scripts/test.sh).
inline bool quick_calibration() {
  const char* value = std::getenv("CUPIPE_CALIBRATION");
  return value != nullptr && std::string_view(value) == "quick";
}

/// `measure()` (one round's total) repeated as `rounds` says (once under quick_calibration());
/// returns every round's value.
template <class Measure>
std::vector<double> repeated(const Rounds& rounds, Measure&& measure) {
  std::vector<double> values;
  if (quick_calibration()) {
    values.push_back(measure());
    return values;
  }
  while (int(values.size()) < std::max(rounds.least, 1) ||
         (int(values.size()) < rounds.most && relative_spread(values) > rounds.tolerance))
    values.push_back(measure());
  return values;
}

/// What calibrate records of its repetitions (CostModel::calibration_spread and _rounds).
struct RoundsSeen {
  double spread = 0;
  int rounds = 0;
  void add(const std::vector<double>& values) {
    spread = std::max(spread, relative_spread(values));
    rounds = std::max(rounds, int(values.size()));
  }
};
}  // namespace detail

}  // namespace cupipe::planner
