// SPDX-License-Identifier: Apache-2.0
// Must not compile: an Embedding (which reads token ids) after another layer. The widths fit
// (Linear<4, 1> outputs the one value per row an Embedding takes), so its place is the only error.
#include "cupipe/layers/layers.hpp"

using Model = cupipe::Sequential<cupipe::Linear<4, 1>, cupipe::Embedding<10, 3>>;

int main() { return static_cast<int>(Model::param_count); }
