// SPDX-License-Identifier: Apache-2.0
// Must not compile: a model starting with ReLU has no input width.
#include "cupipe/layers/layers.hpp"

using Model = cupipe::Sequential<cupipe::ReLU, cupipe::Linear<4, 2>>;

int main() { return static_cast<int>(Model::param_count); }
