// SPDX-License-Identifier: Apache-2.0
// backend::PerWorker<B0, B1, ...>: one backend per pipeline worker, in worker order, for stages of
// different precisions and memory spaces in one pipeline. The pipeline's Workers (pipeline/workers.hpp)
// own and reach each worker's context; hand-overs between them convert and copy
// (pipeline/hand_over.hpp).
#pragma once

#include "cupipe/backend/capabilities.hpp"

namespace cupipe::backend {

/// One backend per worker (physical stage), in worker order. With a multi-chunk schedule a worker's
/// virtual stages share its backend. Naming the same backend for every worker is the same pipeline
/// as naming it once.
template <Backend... Bs>
struct PerWorker {
  static_assert(sizeof...(Bs) > 0, "backend::PerWorker<>: name one backend per worker");
};

}  // namespace cupipe::backend
