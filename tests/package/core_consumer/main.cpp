// SPDX-License-Identifier: Apache-2.0
// Proves at compile time that 1F1B on 4 stages and 8 microbatches is deadlock-free, with nothing but
// cupipe::core: the schedule layer needs no BLAS, zlib or json.
#include <cupipe/schedule/schedule.hpp>

static_assert(cupipe::schedule::verify<cupipe::schedule::OneFOneB>(4, 8));

int main() { return cupipe::schedule::verify<cupipe::schedule::OneFOneB>(4, 8) ? 0 : 1; }
