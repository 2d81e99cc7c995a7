// SPDX-License-Identifier: Apache-2.0
// cupipe, host subset: everything that builds with a plain C++20 compiler. cupipe.cuh adds CUDA.
#pragma once

#include "cupipe/backend/host/host.hpp"
#include "cupipe/backend/host/ops.hpp"
#include "cupipe/core/core.hpp"
#include "cupipe/layers/layers.hpp"
