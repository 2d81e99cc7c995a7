// SPDX-License-Identifier: Apache-2.0
// What a stage's context carries for one action on a microbatch, set when the action starts and
// taken off when it ends (thrown or not), so no later work on the context (a prediction, a
// calibration) sees it: the microbatch's document borders (packed sequences, core/documents.hpp),
// which attention and the position embedding read, and the step's loss normalizer, by which a
// layer's own auxiliary loss is divided (the mixture-of-experts layer's balance and z-losses,
// layers/moe.hpp), as the cross-entropy is.
#pragma once

#include "cupipe/core/documents.hpp"
#include "cupipe/core/shape.hpp"

namespace cupipe::pipeline {

template <class B>
class MicrobatchScope {
 public:
  /// `normalizer`: the microbatch's loss normalizer in the step plan (0: none; a prediction).
  MicrobatchScope(B& be, DocumentStarts documents, index_t normalizer) : be_(be) {
    be_.documents = documents;
    be_.aux_loss_normalizer = normalizer;
  }
  ~MicrobatchScope() {
    be_.documents = {};
    be_.aux_loss_normalizer = 0;
  }
  MicrobatchScope(const MicrobatchScope&) = delete;
  MicrobatchScope& operator=(const MicrobatchScope&) = delete;

 private:
  B& be_;
};

}  // namespace cupipe::pipeline
