// SPDX-License-Identifier: Apache-2.0
// The second translation unit of one_definition (see one_definition_a.cpp).
#include "cupipe/cupipe.hpp"

int one_definition_second_unit() { return 2; }
