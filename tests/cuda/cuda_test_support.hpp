// SPDX-License-Identifier: Apache-2.0
// Helpers for the CUDA tests: random host data, device copies of it, and the relative error
// ||out - ref|| / ||ref|| that every comparison uses (NaN anywhere makes it infinite, so NaN never passes).
#pragma once

#include <cmath>
#include <cstdint>
#include <limits>
#include <span>
#include <vector>

#include "cupipe/cupipe.cuh"

namespace cupipe::testing {

/// The CUDA tests compare with the host backend to fp32 accuracy, so their contexts compute float
/// GEMMs in exact fp32 unless a test asks for TF32 (the library's default) by name.
inline const bool exact_fp32_gemms = [] {
  backend::cuda::set_default_math(backend::cuda::MathMode::fp32);
  return true;
}();

/// Tolerances on ||out - ref|| / ||ref|| by arithmetic.
inline constexpr double fp32_tolerance = 1e-5;
inline constexpr double tf32_tolerance = 1e-3;
inline constexpr double bf16_tolerance = 1e-2;

inline std::vector<float> random_floats(Rng& rng, index_t n, double low = -1.0, double high = 1.0) {
  std::vector<float> out(static_cast<std::size_t>(n));
  for (float& v : out) v = float(rng.uniform(low, high));
  return out;
}

/// Document starts (core/documents.hpp) of sequences cut into documents: `lengths[s]` are sequence
/// s's documents in order, summing to its length.
inline std::vector<std::int32_t> document_starts_of(const std::vector<std::vector<index_t>>& lengths) {
  std::vector<std::int32_t> start;
  for (const auto& sequence : lengths) {
    index_t at = 0;
    for (const index_t length : sequence) {
      for (index_t t = 0; t < length; ++t) start.push_back(std::int32_t(at));
      at += length;
    }
  }
  return start;
}

inline std::vector<std::int32_t> random_ints(Rng& rng, index_t n, index_t below) {
  std::vector<std::int32_t> out(static_cast<std::size_t>(n));
  for (auto& v : out) v = std::int32_t(rng.below(std::uint64_t(below)));
  return out;
}

template <class To, class From>
std::vector<To> cast(const std::vector<From>& from) {
  std::vector<To> out;
  out.reserve(from.size());
  for (const From& v : from) out.push_back(To(v));
  return out;
}

template <class Out, class Ref>
double relative_error(const std::vector<Out>& out, const std::vector<Ref>& ref) {
  if (out.size() != ref.size()) return std::numeric_limits<double>::infinity();
  double diff = 0, norm = 0;
  for (std::size_t i = 0; i < out.size(); ++i) {
    const double o = double(out[i]), r = double(ref[i]);
    if (!std::isfinite(o)) return std::numeric_limits<double>::infinity();
    diff += (o - r) * (o - r);
    norm += r * r;
  }
  return norm == 0 ? std::sqrt(diff) : std::sqrt(diff / norm);
}

/// A device array holding a copy of host data, viewable with any shape of its size.
template <class U, class B>
struct DeviceArray {
  DeviceArray(B& be, const std::vector<U>& host, MemoryTag tag = MemoryTag::activations)
      : be_(&be), buffer(be.template allocate<U>(index_t(host.size()), tag)) {
    be.upload(std::span<const U>(host), buffer.data());
  }
  DeviceArray(B& be, index_t n, MemoryTag tag = MemoryTag::activations)
      : be_(&be), buffer(be.template allocate<U>(n, tag)) {}

  ViewOn<B, U> view(Shape shape) { return buffer.view(shape); }
  ConstViewOn<B, U> cview(Shape shape) { return buffer.view(shape); }
  std::vector<U> download() {
    std::vector<U> out(static_cast<std::size_t>(buffer.size()));
    be_->download(buffer.data(), std::span<U>(out));
    return out;
  }

  B* be_;
  typename B::template buffer<U> buffer;
};

/// A device array of n elements filled with NaN, so unwritten outputs show.
template <class U, class B>
DeviceArray<U, B> poisoned(B& be, index_t n) {
  DeviceArray<U, B> out(be, n);
  ops::poison(be, out.view(Shape{n}));
  return out;
}

}  // namespace cupipe::testing
