// SPDX-License-Identifier: Apache-2.0
// The values of a batch in host memory, checked on the caller's thread before a step runs: every label
// within the loss's classes, and every token id within the first layer's vocabulary. The error names
// the row in the batch the caller passed, and the microbatch that row falls in and its row there (the
// ops check again inside a step, but they see one microbatch, whose rows count from 0). A batch
// already in device memory is checked by the kernels (pipeline/deferred_checks.hpp).
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "cupipe/core/error.hpp"
#include "cupipe/core/tensor.hpp"
#include "cupipe/pipeline/step_plan.hpp"

namespace cupipe::pipeline {

/// "row 57 of the batch (microbatch 3, its row 7)": where a row of an n-row batch goes when it is
/// split into `parts` microbatches as a step splits it (split_rows).
inline std::string describe_batch_row(index_t row, index_t n, int parts, index_t rows_per_sample) {
  StepPlan split;
  split_rows(split, n, parts, rows_per_sample);
  int j = 0;
  while (j + 1 < split.microbatches() && split.first[std::size_t(j + 1)] <= row) ++j;
  return detail::str("row ", row, " of the batch (microbatch ", j, ", its row ", row - split.first[std::size_t(j)], ")");
}

/// Every value of `values` in [0, count); else throws naming the first that is not, by its batch row.
inline void check_batch_ids(std::string_view who, std::string_view what, std::string_view range, index_t count,
                            const std::int32_t* values, index_t n, int parts, index_t rows_per_sample) {
  for (index_t r = 0; r < n; ++r) {
    const std::int32_t v = values[r];
    if (v < 0 || v >= count)
      CUPIPE_THROW(who, ": ", what, " ", v, " at ", describe_batch_row(r, n, parts, rows_per_sample), " is outside ",
                   range, " [0, ", count, ")");
  }
}

/// The labels against the loss's classes, and token ids against the first layer's vocabulary, for a
/// batch split into `parts` microbatches. Layers that declare no `classes` or `vocabulary` are not
/// checked here.
template <class Stages, class In>
void check_batch_values(ConstView<In> x, ConstView<std::int32_t> labels, std::string_view who, int parts,
                        index_t rows_per_sample = Stages::model::body::rows_per_sample) {
  using Body = typename Stages::model::body;
  using Loss = typename Stages::loss;
  using First = typename Body::template layer<0>;
  const index_t n = labels.numel();
  if (n % rows_per_sample != 0 || n / rows_per_sample < parts) return;  // the step refuses the split itself
  if constexpr (requires { Loss::classes; })
    check_batch_ids(who, "label", Loss::describe() + "'s classes", Loss::classes, labels.data(), n, parts,
                    rows_per_sample);
  if constexpr (std::is_same_v<In, std::int32_t> && requires { First::vocabulary; })
    check_batch_ids(who, "token id", First::describe() + "'s vocabulary", First::vocabulary, x.data(), x.numel(), parts,
                    rows_per_sample);
}

}  // namespace cupipe::pipeline
