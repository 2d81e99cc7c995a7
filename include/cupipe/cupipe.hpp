// SPDX-License-Identifier: Apache-2.0
// cupipe, host subset: everything that builds with a plain C++20 compiler. cupipe.cuh adds CUDA.
#pragma once

#include "cupipe/backend/host/fp8.hpp"
#include "cupipe/backend/host/host.hpp"
#include "cupipe/backend/host/ops.hpp"
#include "cupipe/core/core.hpp"
#include "cupipe/io/checkpoint.hpp"
#include "cupipe/io/io.hpp"
#include "cupipe/layers/layers.hpp"
#include "cupipe/optim/lr_schedule.hpp"
#include "cupipe/optim/optimizers.hpp"
#include "cupipe/pipeline/dispatch.hpp"
#include "cupipe/pipeline/memory_plan.hpp"
#include "cupipe/pipeline/pipeline.hpp"
#include "cupipe/pipeline/stage_list.hpp"
#include "cupipe/pipeline/trace.hpp"
#include "cupipe/schedule/schedule.hpp"
#include "cupipe/schedule/timeline.hpp"
