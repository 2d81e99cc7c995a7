// SPDX-License-Identifier: Apache-2.0
// cupipe with the CUDA backend: the host subset plus backend::Cuda<T> and its ops. Include this from
// .cu files compiled by nvcc; cupipe.hpp stays the g++-only subset.
#pragma once

#include "cupipe/cupipe.hpp"

#include "cupipe/backend/cuda/check.cuh"
#include "cupipe/backend/cuda/context.cuh"
#include "cupipe/backend/cuda/cuda.cuh"
#include "cupipe/backend/cuda/fp8.cuh"
#include "cupipe/backend/cuda/gemm.cuh"
#include "cupipe/backend/cuda/memory_pool.cuh"
#include "cupipe/backend/cuda/nvtx.cuh"
#include "cupipe/backend/cuda/ops.cuh"
#include "cupipe/backend/cuda/stream.cuh"
