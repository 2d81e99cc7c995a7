// SPDX-License-Identifier: Apache-2.0
// Must not compile: a view of device memory handed to a host op. The memory space is part of the view
// type, so the mistake is a compile error at the call instead of a crash (or silent garbage) at run time.
#include <vector>

#include "cupipe/backend/host/ops.hpp"

int main() {
  cupipe::backend::Host<float> be;
  std::vector<float> y(4);
  float* device_pointer = nullptr;  // stands for memory a CUDA backend allocated
  const cupipe::DeviceConstView<float> x{device_pointer, cupipe::Shape{2, 2}};
  cupipe::ops::relu_forward(be, x, cupipe::TensorView<float>{y.data(), cupipe::Shape{2, 2}});
  return 0;
}
