// SPDX-License-Identifier: Apache-2.0
// Everything in core/: errors, shapes, dtypes, tensor views and buffers, memory accounting, RNG.
#pragma once

#include "cupipe/core/dtype.hpp"
#include "cupipe/core/error.hpp"
#include "cupipe/core/hash.hpp"
#include "cupipe/core/memory.hpp"
#include "cupipe/core/rng.hpp"
#include "cupipe/core/shape.hpp"
#include "cupipe/core/tensor.hpp"
#include "cupipe/core/version.hpp"
