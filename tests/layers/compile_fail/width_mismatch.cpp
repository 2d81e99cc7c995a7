// SPDX-License-Identifier: Apache-2.0
// Must not compile: Linear<10, 50> feeds 50 features (through ReLU) into Linear<20, 2>, which takes 20.
#include "cupipe/layers/layers.hpp"

using Model = cupipe::Sequential<cupipe::Linear<10, 50>, cupipe::ReLU, cupipe::Linear<20, 2>>;

int main() { return static_cast<int>(Model::param_count); }
