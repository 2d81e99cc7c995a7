// SPDX-License-Identifier: Apache-2.0
// Test support: a central finite-difference gradient checker (float64) and small helpers shared by
// the host op tests and the layer tests.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "cupipe/core/rng.hpp"
#include "cupipe/core/shape.hpp"

namespace cupipe::testing {

/// ‖a − b‖ / max(‖a‖, ‖b‖, tiny): one number for a whole gradient, so a few tiny entries with a
/// large relative error do not dominate, while any real mistake does.
inline double relative_error(std::span<const double> a, std::span<const double> b) {
  if (a.size() != b.size()) return INFINITY;
  double diff = 0, na = 0, nb = 0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    diff += (a[i] - b[i]) * (a[i] - b[i]);
    na += a[i] * a[i];
    nb += b[i] * b[i];
  }
  return std::sqrt(diff) / std::max({std::sqrt(na), std::sqrt(nb), 1e-300});
}

/// Central differences of the scalar `loss()` with respect to every element of `x`, which it
/// perturbs in place and restores exactly. O(h²) truncation, O(ε/h) rounding: h = 1e-6 balances both.
template <class Loss>
std::vector<double> numeric_gradient(std::span<double> x, Loss&& loss, double h = 1e-6) {
  std::vector<double> grad(x.size());
  for (std::size_t i = 0; i < x.size(); ++i) {
    const double saved = x[i];
    x[i] = saved + h;
    const double plus = loss();
    x[i] = saved - h;
    const double minus = loss();
    x[i] = saved;
    grad[i] = (plus - minus) / (2 * h);
  }
  return grad;
}

/// Random parameters of a LayerSeq: the layers' own init, shifted, so that no gradient is special
/// (LayerNorm's gamma of ones and beta of zeros would hide a swapped dgamma and dbeta). Never empty,
/// even with no parameters, so its data() is never null.
template <class Seq>
std::vector<double> random_params(std::uint64_t seed, Rng& rng) {
  std::vector<double> p(std::size_t(std::max<index_t>(Seq::param_count, 1)));
  Seq::init(std::span<double>(p.data(), std::size_t(Seq::param_count)), seed);
  for (double& x : p) x += rng.uniform(-0.5, 0.5);
  return p;
}

/// n values uniform in [low, high).
inline std::vector<double> uniform_values(std::size_t n, Rng& rng, double low = -1, double high = 1) {
  std::vector<double> v(n);
  for (double& x : v) x = rng.uniform(low, high);
  return v;
}

/// n values uniform in ±[low, high): bounded away from zero (for ReLU's kink).
inline std::vector<double> values_away_from_zero(std::size_t n, Rng& rng, double low = 0.1, double high = 1) {
  std::vector<double> v(n);
  for (double& x : v) x = (rng.below(2) ? 1 : -1) * rng.uniform(low, high);
  return v;
}

/// n integers uniform in [0, bound), as int32 (labels, token ids).
inline std::vector<std::int32_t> uniform_ints(std::size_t n, Rng& rng, std::int64_t bound) {
  std::vector<std::int32_t> v(n);
  for (auto& x : v) x = static_cast<std::int32_t>(rng.below(static_cast<std::uint64_t>(bound)));
  return v;
}

/// sum(weights * values): the scalar whose gradient with respect to `values` is `weights`. A random
/// projection makes every backward see a generic upstream gradient instead of all ones.
inline double dot(std::span<const double> weights, std::span<const double> values) {
  double s = 0;
  for (std::size_t i = 0; i < weights.size(); ++i) s += weights[i] * values[i];
  return s;
}

/// Element-wise conversion (float copies of double test data, and back).
template <class To, class From>
std::vector<To> cast_all(std::span<const From> from) {
  return std::vector<To>(from.begin(), from.end());
}
template <class To, class From>
std::vector<To> cast_all(const std::vector<From>& from) {
  return std::vector<To>(from.begin(), from.end());
}

}  // namespace cupipe::testing
