// SPDX-License-Identifier: Apache-2.0
// planner_check's MLP: the Fashion-MNIST trainer's 784-1024-512-256-10 MLP in float on the host
// backend (one BLAS thread per worker), on random inputs of the real shape (the times do not
// depend on the values).
#include "check.hpp"

namespace planner_check {
namespace {

using Model = Sequential<Linear<784, 1024>, ReLU, Linear<1024, 512>, ReLU, Linear<512, 256>, ReLU, Linear<256, 10>>;
using Host = backend::Host<float>;

struct Data {
  std::vector<float> x;
  std::vector<std::int32_t> labels;
  explicit Data(index_t rows) {
    Rng rng(5);
    for (index_t i = 0; i < rows * 784; ++i) x.push_back(float(rng.uniform()));
    for (index_t i = 0; i < rows; ++i) labels.push_back(std::int32_t(rng.below(10)));
  }
  ConstView<float> inputs() const { return {x.data(), Shape{index_t(labels.size()), 784}}; }
};

}  // namespace

ModelCheck mlp_check() {
  ModelCheck c;
  c.name = "mlp";
  c.description = "the Fashion-MNIST MLP 784-1024-512-256-10, float";
  c.default_batch = 256;
  c.stage_counts = {1, 2};
  c.calibrate = [](index_t samples, const std::vector<int>& counts) {
    const Data d(samples);
    return planner::calibrate<Model, Host>(d.inputs(), 5, 1, counts);
  };
  c.split = partition_cuts<Model, 1, 2, 4>;
  c.run = [](const planner::Layout& layout, index_t samples, const RunOptions& o) {
    const Data d(samples * layout.batches);
    return run_layout<Model, Host, 1, 2>(layout, d.inputs(), ConstView<std::int32_t>{d.labels.data(), Shape{index_t(d.labels.size())}}, o);
  };
  return c;
}

}  // namespace planner_check
