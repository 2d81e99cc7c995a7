// SPDX-License-Identifier: Apache-2.0
// PipeDream and PipeDream-2BW: 1F1B across batches without a flush, with versioned weights.
#pragma once

#include <string_view>

#include "cupipe/schedule/policies/one_f_one_b.hpp"

namespace cupipe::schedule {

/// PipeDream (Narayanan et al., "PipeDream: Generalized Pipeline Parallelism for DNN Training",
/// SOSP'19): 1F1B without any flush, across batches. Every stage updates its weights after each
/// of its backwards; weight stashing with vertical sync keeps each microbatch on one version.
struct PipeDream : detail::OneChunkPolicy {
  static constexpr std::string_view name = "pipedream";
  static constexpr std::string_view summary = "1F1B without a flush; an update after every backward, weight stashing";
  static constexpr bool split_backward = false;
  static constexpr UpdateRule update = UpdateRule::per_microbatch;
  static constexpr int default_batches = 2;
  static constexpr std::vector<std::vector<Action>> actions(const Config& c) { return detail::one_f_one_b_actions(c); }
};

/// PipeDream-2BW (Narayanan et al., "Memory-Efficient Pipeline-Parallel DNN Training", ICML 2021):
/// 1F1B without a flush across batches, with double-buffered weights. Batch t runs on version
/// max(t-1, 0); a stage creates version t+1 right after its last backward of batch t.
struct PipeDream2BW : PipeDream {
  static constexpr std::string_view name = "2bw";
  static constexpr std::string_view summary = "1F1B without a flush; one update per batch into a second weight buffer";
  static constexpr UpdateRule update = UpdateRule::double_buffered;
  static constexpr std::string_view check(const Config& c) {
    if (c.chunks != 1) return one_chunk_reason;
    if (c.batches > 1 && c.microbatches < c.stages - 1)
      return "PipeDream2BW needs microbatches >= stages - 1 when batches > 1: batch t enters stage 0 on weight "
             "version t-1, which exists only once batch t-2 has drained from that stage";
    return "";
  }
};

}  // namespace cupipe::schedule
