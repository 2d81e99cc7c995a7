// SPDX-License-Identifier: Apache-2.0
// Every host header in two translation units of one program: a function a header defines without
// `inline` (and outside a template) is then defined twice, and this test fails to link, as a user's
// program with two .cpp files would. (Each other test is one translation unit, so nothing else here
// would notice; CUDA's test_cuda_ops, with two, once did.)
#include "cupipe/cupipe.hpp"

int one_definition_second_unit();

int main() { return one_definition_second_unit() == 2 ? 0 : 1; }
