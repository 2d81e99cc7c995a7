// SPDX-License-Identifier: Apache-2.0
// Shared by the training tests: a small MLP split several ways, seeded batches, bitwise
// comparisons and a scratch directory that cleans up after itself.
#pragma once

#include <catch2/catch.hpp>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <span>
#include <string>
#include <unistd.h>
#include <vector>

#include "cupipe/cupipe.hpp"

namespace cupipe::test {

// 6 -> 16 -> 12 -> 8 -> 3; PyTorch names 0.*, 2.*, 4.*, 6.* (the ReLUs hold no parameters).
using Mlp = Sequential<Linear<6, 16>, ReLU, Linear<16, 12>, ReLU, Linear<12, 8>, ReLU, Linear<8, 3>>;
inline constexpr index_t mlp_in = 6, mlp_classes = 3;

template <class T>
using OneFOneB4 = Pipeline<partition<Mlp, 4>, schedule::OneFOneB, backend::Host<T>>;
template <class T>
using GPipe2 = Pipeline<partition<Mlp, 2>, schedule::GPipe, backend::Host<T>>;
template <class T>
using MlpNetwork = Network<Mlp, backend::Host<T>>;

/// A seeded batch: x (rows, 6) uniform in [-1, 1), labels uniform in [0, 3).
template <class T>
struct Batch {
  index_t rows = 0;
  std::vector<T> x;
  std::vector<std::int32_t> labels;

  ConstView<T> inputs() const { return {x.data(), Shape{rows, mlp_in}}; }
  ConstView<std::int32_t> targets() const { return {labels.data(), Shape{rows}}; }
};

template <class T>
Batch<T> make_batch(index_t rows, std::uint64_t seed) {
  Rng rng(seed);
  Batch<T> b{rows, std::vector<T>(std::size_t(rows * mlp_in)), std::vector<std::int32_t>(std::size_t(rows))};
  for (T& v : b.x) v = T(rng.uniform(-1.0, 1.0));
  for (auto& l : b.labels) l = std::int32_t(rng.below(std::uint64_t(mlp_classes)));
  return b;
}

template <class T>
bool bitwise_equal(const std::vector<T>& a, const std::vector<T>& b) {
  return a.size() == b.size() && (a.empty() || std::memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0);
}

/// A fresh directory under the system temp folder, removed with everything in it.
class ScratchDir {
 public:
  ScratchDir() {
    static std::atomic<int> counter{0};
    path_ = std::filesystem::temp_directory_path() /
            ("cupipe_training_" + std::to_string(::getpid()) + "_" + std::to_string(counter++));
    std::filesystem::remove_all(path_);
    std::filesystem::create_directories(path_);
  }
  ~ScratchDir() {
    std::error_code ignored;
    std::filesystem::remove_all(path_, ignored);
  }
  ScratchDir(const ScratchDir&) = delete;
  ScratchDir& operator=(const ScratchDir&) = delete;

  std::filesystem::path operator/(const std::string& name) const { return path_ / name; }
  const std::filesystem::path& path() const noexcept { return path_; }

 private:
  std::filesystem::path path_;
};

/// The message of the cupipe::error that `f` throws; fails the test if it throws nothing or anything else.
template <class F>
std::string error_message(F&& f) {
  try {
    f();
  } catch (const cupipe::error& e) {
    return e.message();
  } catch (const std::exception& e) {
    FAIL("expected a cupipe::error but got another exception: " << e.what());
  } catch (...) {
    FAIL("expected a cupipe::error but got a non-standard exception");
  }
  FAIL("expected a cupipe::error but nothing was thrown");
  return {};
}

/// Whether a and b hold the same bytes.
template <class T>
bool same_bits(const std::vector<T>& a, const std::vector<T>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0;
}

/// The flush update of a pipeline, by hand on a Network: AdamW (no clipping) on the float master
/// weights, then the weights in use become their rounding (nothing to do in fp32).
template <class Net>
void network_adamw_step(Net& net, const optim::AdamW& adamw, std::vector<std::vector<float>>& slots, int step) {
  constexpr index_t count = Net::Body::param_count;
  if (slots.empty()) slots.assign(2, std::vector<float>(std::size_t(count)));
  std::vector<TensorView<float>> views{{slots[0].data(), Shape{count}}, {slots[1].data(), Shape{count}}};
  backend::end_step(net.backend());  // as the pipeline's update_stage does
  adamw.update(net.backend(), TensorView<float>{net.master_data(), Shape{count}},
               ConstView<float>{net.gradient_data(), Shape{count}}, std::span<const TensorView<float>>(views), step, 1.0);
  net.publish_master();
}

}  // namespace cupipe::test
