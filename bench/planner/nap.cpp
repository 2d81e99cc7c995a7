// SPDX-License-Identifier: Apache-2.0
// planner_check's fixed-duration model: eight layers whose F, B and W sleep a set time per row
// (different per layer, so the split matters), after an entry layer that fixes the width. Their
// times are known, so what the planner mispredicts here is the runtime's overhead, not the profile.
#include <array>
#include <chrono>
#include <thread>

#include "check.hpp"
#include "identity_layers.hpp"

namespace planner_check {
namespace {

constexpr index_t width = 8;

/// Microseconds per row of each layer's forward, input gradient and weight gradient.
struct PerRow {
  double forward, input_grad, weight_grad;
};
constexpr std::array<PerRow, 8> per_row{{{30, 30, 30},
                                         {60, 50, 40},
                                         {20, 30, 20},
                                         {40, 40, 40},
                                         {30, 20, 30},
                                         {50, 60, 50},
                                         {20, 20, 20},
                                         {40, 30, 40}}};

void nap(double us_per_row, index_t rows) {
  std::this_thread::sleep_for(std::chrono::duration<double, std::micro>(us_per_row * double(rows)));
}

/// An identity with one parameter (so its weight gradient is a real action) that sleeps.
template <int Id>
struct NapHooks {
  static void forward(const auto& x) { nap(per_row[Id].forward, x.rows()); }
  static void backward_input(const auto& dy) { nap(per_row[Id].input_grad, dy.rows()); }
  static void backward_weight(const auto& x) { nap(per_row[Id].weight_grad, x.rows()); }
};
template <int Id>
struct Nap : cupipe::test::IdentityWithWeight<NapHooks<Id>> {
  static std::string describe() { return "Nap<" + std::to_string(Id) + ">"; }
};

/// The model's fixed input width, ahead of the naps (a model's first layer has no input gradient).
struct Entry : cupipe::test::Identity<> {
  static constexpr index_t in_features = width;
  static std::string describe() { return "Entry<8>"; }
};

using Model = Sequential<Entry, Nap<0>, Nap<1>, Nap<2>, Nap<3>, Nap<4>, Nap<5>, Nap<6>, Nap<7>>;
using Host = backend::Host<double>;

struct Data {
  std::vector<double> x;
  std::vector<std::int32_t> labels;
  explicit Data(index_t rows) {
    Rng rng(5);
    for (index_t i = 0; i < rows * width; ++i) x.push_back(rng.uniform(-1.0, 1.0));
    for (index_t i = 0; i < rows; ++i) labels.push_back(std::int32_t(rng.below(width)));
  }
};

}  // namespace

ModelCheck nap_check() {
  ModelCheck c;
  c.name = "nap";
  c.description = "fixed-duration layers: 8 sleeping layers (20-60 us per row per action), double";
  c.default_batch = 32;
  c.stage_counts = {1, 2, 4};
  c.calibrate = [](index_t samples, const std::vector<int>& counts) {
    const Data d(samples);
    return planner::calibrate<Model, Host>(ConstView<double>{d.x.data(), Shape{samples, width}}, 3, 1, counts);
  };
  c.split = partition_cuts<Model, 1, 2, 4, 8>;
  c.run = [](const planner::Layout& layout, index_t samples, const RunOptions& o) {
    const index_t rows = samples * layout.batches;
    const Data d(rows);
    return run_layout<Model, Host, 1, 2, 4>(layout, ConstView<double>{d.x.data(), Shape{rows, width}},
                                            ConstView<std::int32_t>{d.labels.data(), Shape{rows}}, o);
  };
  return c;
}

}  // namespace planner_check
