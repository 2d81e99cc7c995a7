// SPDX-License-Identifier: Apache-2.0
// Must not compile: a layer with a forward but no backward_input. The model is run forward and
// backward, so the report must come from layer_is_complete<NoBackward>, in one sentence, and nothing
// from inside Sequential's passes.
#include "cupipe/backend/host/ops.hpp"
#include "cupipe/layers/layers.hpp"

struct NoBackward : cupipe::LayerDefaults {
  static std::string describe() { return "NoBackward"; }
  template <class B, class T>
  static void forward(B& be, const T*, cupipe::ConstView<T> x, cupipe::TensorView<T> y, cupipe::TensorView<T>) {
    copy(be, x, y);
  }
};

using Model = cupipe::Sequential<cupipe::Linear<4, 3>, NoBackward, cupipe::Linear<3, 2>>;

int main() {
  cupipe::backend::Host<float> be;
  std::vector<float> params(Model::param_count), grads(Model::param_count), x(8), dy(4);
  std::vector<float> record(Model::record_elements(2)), grad_record(Model::grad_record_elements(2));
  const cupipe::ConstView<float> xv{x.data(), cupipe::Shape{2, 4}};
  Model::init(std::span<float>(params), 1);
  Model::forward(be, params.data(), xv, record.data());
  Model::backward(be, params.data(), xv, record.data(), cupipe::ConstView<float>{dy.data(), cupipe::Shape{2, 2}},
                  cupipe::TensorView<float>{}, grads.data(), grad_record.data(), true);
  return 0;
}
