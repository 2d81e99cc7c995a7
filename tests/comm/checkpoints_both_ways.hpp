// SPDX-License-Identifier: Apache-2.0
// What the split-model MPI checks (tensor and expert parallelism) share: checkpoints both ways
// between a distributed layout and one process. The distributed pipeline's checkpoint (a collective;
// rank 0 writes) loads into a one-stage single process of the whole model, and the single process's
// (the reference pipeline, saved by rank 0) into a fresh pipeline of the distributed layout; each
// must hold exactly the weights and AdamW's exp_avg_sq of the run it came from.
#pragma once

#include <mpi.h>

#include <string>
#include <vector>

#include "cupipe/cupipe.hpp"
#include "compare.hpp"

namespace cupipe::testing {

/// `Whole`: the whole model; `Layout`: the distributed pipeline's type, made with `options`;
/// `expect(what, ok, detail)` records each verdict.
template <class Whole, class Layout, class Distributed, class Reference, class Optimizer, class Expect>
void check_checkpoints_both_ways(const std::string& prefix, Distributed& distributed, Reference& reference,
                                 const Optimizer& adamw, const PipelineOptions& options, int rank, Expect&& expect) {
  using B = backend::Host<double>;
  const std::vector<double> weights = distributed.parameters(), exp_avg_sq = distributed.optimizer_state(1);
  const std::vector<double> want = reference.parameters(), want_exp_avg_sq = reference.optimizer_state(1);
  io::TrainingState state;
  state.updates = distributed.updates();
  io::save_checkpoint(prefix + ".split", distributed, adamw, state);  // collective; rank 0 writes
  if (rank == 0) io::save_checkpoint(prefix + ".single", reference, adamw, state);
  MPI_Barrier(MPI_COMM_WORLD);
  Pipeline<partition<Whole, 1>, schedule::GPipe, B> other({.microbatches = 2});
  io::load_checkpoint(prefix + ".split", other, adamw);
  const double c = relative(other.parameters(), weights), o = relative(other.optimizer_state(1), exp_avg_sq);
  expect("a one-stage single process loading this run's checkpoint", c == 0 && o == 0,
         "weights " + number(c) + ", exp_avg_sq " + number(o));
  Layout loaded(options);
  io::load_checkpoint(prefix + ".single", loaded, adamw);
  const double l = relative(loaded.parameters(), want), lo = relative(loaded.optimizer_state(1), want_exp_avg_sq);
  expect("this layout loading a single process's checkpoint", l == 0 && lo == 0,
         "weights " + number(l) + ", exp_avg_sq " + number(lo));
}

}  // namespace cupipe::testing
