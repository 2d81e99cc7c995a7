// SPDX-License-Identifier: Apache-2.0
// StepPlan: what one training step does to a batch, computed before any thread starts and without
// touching a backend: how the batch's rows split into microbatches, by what each microbatch's loss
// is divided, and which weight version each runs on. Pure data, tested on its own.
#pragma once

#include <cstdint>
#include <vector>

#include "cupipe/core/error.hpp"
#include "cupipe/core/shape.hpp"
#include "cupipe/schedule/action.hpp"
#include "cupipe/schedule/weights.hpp"

namespace cupipe::pipeline {

struct StepPlan {
  std::vector<index_t> first;       ///< [microbatch] first row in the batch
  std::vector<index_t> rows;        ///< [microbatch] rows, never 0
  std::vector<index_t> normalizer;  ///< [microbatch] the loss is a sum over its rows divided by this
  std::vector<int> version;         ///< [microbatch] weight version it runs on, on every stage

  int microbatches() const noexcept { return int(rows.size()); }
};

/// Splits n rows, whole samples of `rows_per_sample` rows each (a sequence of T tokens for a
/// transformer), into `parts` contiguous, non-empty microbatches whose sample counts differ by at most
/// one (the first (samples mod parts) hold one more): 13 samples into 8 are 2,2,2,2,2,1,1,1.
inline void split_rows(StepPlan& out, index_t n, int parts, index_t rows_per_sample = 1) {
  CUPIPE_REQUIRE(rows_per_sample >= 1, "Pipeline: rows per sample must be positive, got ", rows_per_sample);
  if (n % rows_per_sample != 0)
    CUPIPE_THROW("Pipeline: a batch of ", n, " rows is not whole samples of ", rows_per_sample,
                 " rows (the model's sequences), so it cannot be split into microbatches");
  const index_t samples = n / rows_per_sample;
  if (samples < parts)
    CUPIPE_THROW("Pipeline: a batch of ", samples, " samples cannot be split into ", parts,
                 " microbatches (each needs at least one sample)");
  const index_t size = samples / parts, longer = samples % parts;
  out.first.resize(std::size_t(parts));
  out.rows.resize(std::size_t(parts));
  index_t at = 0;
  for (int j = 0; j < parts; ++j) {
    out.first[std::size_t(j)] = at;
    out.rows[std::size_t(j)] = (size + (j < longer ? 1 : 0)) * rows_per_sample;
    at += out.rows[std::size_t(j)];
  }
}

/// The plan of one step over n rows (whole samples of `rows_per_sample` rows). `offsets` is
/// schedule::detail::microbatch_versions(plan);
/// `base` the updates applied before the step; `batches_before` the batches finished before it.
/// Normalizers make every loss a share of the right mean: the whole batch's for flush schedules
/// (so the summed gradient is exactly the full batch's), each microbatch's own for PipeDream (each is
/// its own update), each batch's for 2BW.
inline StepPlan make_step_plan(const schedule::Plan& plan, const std::vector<int>& offsets, index_t n, int base,
                               std::int64_t batches_before, index_t rows_per_sample = 1) {
  const schedule::Config& c = plan.config;
  StepPlan out;
  split_rows(out, n, c.total_microbatches(), rows_per_sample);
  const int total = c.total_microbatches();
  out.normalizer.resize(std::size_t(total));
  out.version.resize(std::size_t(total));
  for (int j = 0; j < total; ++j) {
    const int batch = j / c.microbatches;
    index_t batch_rows = 0;
    for (int i = batch * c.microbatches; i < (batch + 1) * c.microbatches; ++i) batch_rows += out.rows[std::size_t(i)];
    switch (plan.update) {
      case schedule::UpdateRule::flush: out.normalizer[std::size_t(j)] = n; break;
      case schedule::UpdateRule::per_microbatch: out.normalizer[std::size_t(j)] = out.rows[std::size_t(j)]; break;
      case schedule::UpdateRule::double_buffered: out.normalizer[std::size_t(j)] = batch_rows; break;
    }
    out.version[std::size_t(j)] = schedule::version_of(plan, offsets, j, base, batches_before);
  }
  return out;
}

}  // namespace cupipe::pipeline
