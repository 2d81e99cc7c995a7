// SPDX-License-Identifier: Apache-2.0
// Must not compile: a loss layer in the middle of a model. The widths fit (the loss outputs one value
// per row, which Linear<1, 2> takes), so the loss's place is the only error.
#include "cupipe/layers/layers.hpp"

using Model = cupipe::Sequential<cupipe::Linear<4, 3>, cupipe::SoftmaxCrossEntropy<3>, cupipe::Linear<1, 2>>;

int main() { return static_cast<int>(Model::param_count); }
