// SPDX-License-Identifier: Apache-2.0
// Everything in io/: atomic file writes, safetensors, IDX and Fashion-MNIST, token data, plan files.
#pragma once

#include "cupipe/io/atomic_file.hpp"
#include "cupipe/io/fashion_mnist.hpp"
#include "cupipe/io/idx.hpp"
#include "cupipe/io/plan_file.hpp"
#include "cupipe/io/safetensors.hpp"
#include "cupipe/io/tokens.hpp"
