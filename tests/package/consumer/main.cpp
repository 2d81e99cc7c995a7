// SPDX-License-Identifier: Apache-2.0
// Trains two steps of a tiny pipeline: proof that a consumer project builds and links against cupipe.
#include <cupipe/cupipe.hpp>

#include <cmath>
#include <vector>

int main() {
  using Model = cupipe::Sequential<cupipe::Linear<4, 8>, cupipe::ReLU, cupipe::Linear<8, 2>>;
  cupipe::Pipeline<cupipe::partition<Model, 2>, cupipe::schedule::OneFOneB, cupipe::backend::Host<float>> pipe({.microbatches = 2});
  std::vector<float> x(16, 0.5f);
  std::vector<std::int32_t> y{0, 1, 0, 1};
  cupipe::optim::SGD sgd({.lr = 0.1});
  const cupipe::ConstView<float> xv{x.data(), cupipe::Shape{4, 4}};
  const cupipe::ConstView<std::int32_t> yv{y.data(), cupipe::Shape{4}};
  pipe.train_step(xv, yv, sgd);
  return std::isfinite(pipe.train_step(xv, yv, sgd).loss) ? 0 : 1;
}
