// SPDX-License-Identifier: Apache-2.0
// StageState: everything one virtual stage keeps between actions and steps on its worker: weight
// versions, accumulated gradients, optimizer slots, and the microbatches it holds between F and B/W.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "cupipe/core/memory.hpp"
#include "cupipe/core/tensor.hpp"
#include "cupipe/pipeline/versioned_weights.hpp"

namespace cupipe::pipeline {

template <class Seq, class Backend, int MaxVersions>
struct StageState {
  using T = typename Backend::value_type;
  using buffer = typename Backend::template buffer<T>;
  static constexpr index_t param_count = Seq::param_count;

  /// What a microbatch leaves on the stage between its forward and its backward (or W).
  struct InFlight {
    index_t rows = 0;
    int version = 0;
    buffer input;        // received activation (empty on virtual stage 0: the batch rows are used)
    buffer record;       // what backward needs
    buffer grad_record;  // per-layer output gradients, kept for W
    buffer dy;           // incoming gradient, kept for W
  };

  StageState(Backend& backend, int allowed_versions, bool recompute_)
      : be(&backend),
        weights(backend, param_count, allowed_versions),
        grads(backend.template allocate<T>(param_count, MemoryTag::gradients)),
        recompute(recompute_) {
    zero_grads();
  }

  ViewOn<Backend, T> grad_view() { return {grads.data(), Shape{param_count}}; }
  void zero_grads() { fill(*be, grad_view(), T(0)); }

  Backend* be;
  VersionedWeights<Backend, MaxVersions> weights;
  buffer grads;
  std::vector<buffer> slots;  ///< optimizer state, one array per slot
  std::string slots_for;      ///< the optimizer the slots belong to
  std::int64_t updates = 0;
  /// Post-validation: weights, gradients and slots before the last update made without the global
  /// norm, and the update count then (pipeline::save_for_rollback); empty otherwise.
  std::vector<buffer> saved;
  std::int64_t saved_updates = 0;
  bool recompute = false;     ///< keep only the input after F; B recomputes the record
  std::map<int, InFlight> in_flight;
  std::vector<char> done;          ///< per microbatch of the running step
  std::vector<int> done_in_batch;  ///< per batch of the running step
};

}  // namespace cupipe::pipeline
