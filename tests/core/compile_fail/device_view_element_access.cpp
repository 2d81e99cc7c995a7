// SPDX-License-Identifier: Apache-2.0
// Must not compile: reading an element of a device view on the host. Element access exists only on
// views whose space the host can read.
#include "cupipe/core/tensor.hpp"

int main() {
  float* device_pointer = nullptr;  // stands for memory a CUDA backend allocated
  const cupipe::DeviceView<float> v{device_pointer, cupipe::Shape{4}};
  return int(v[0]);
}
