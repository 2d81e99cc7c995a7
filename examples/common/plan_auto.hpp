// SPDX-License-Identifier: Apache-2.0
// --plan auto, shared by the trainers' main.cpp (host code only: trainer.hpp, which nvcc also
// compiles, does not include it): plan a run from a cost model measured here, print the report, and
// hand back the best layout. In one process the planner chooses the stages too; under mpirun the
// launch fixes stages x replicas and the planner chooses the schedule and microbatches.
#pragma once

#include <algorithm>
#include <cstdio>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "cupipe/backend/host/host.hpp"
#include "cupipe/comm/agreement.hpp"
#include "cupipe/planner/calibrate.hpp"
#include "cupipe/planner/cost_json.hpp"
#include "cupipe/planner/planner.hpp"
#include "trainer_schedules.hpp"

namespace cupipe::examples {

/// Workers for --plan auto: `requested`, or the cores (at most 4) when 0.
inline int plan_workers(int requested) {
  return requested > 0 ? requested : int(std::clamp(std::thread::hardware_concurrency(), 1u, 4u));
}

/// Plans one process on `workers` workers (one core each) for `batch` samples, with the stage counts
/// and splits the program compiles (`split`: a virtual stage count's cuts, empty where it has none)
/// and the schedules it compiles (`schedules`; empty: every one), prints the report, and returns the
/// best layout (throws, naming the refusals, when none fits).
template <class Split>
planner::Layout plan_in_process(planner::CostModel model, int workers, index_t batch, std::vector<int> stage_counts,
                                Split split, std::vector<std::string> schedules = {}) {
  planner::Request request;
  request.schedules = std::move(schedules);
  request.model = std::move(model);
  request.devices = workers;
  request.batch = batch;
  request.stage_counts = std::move(stage_counts);
  request.max_replicas = 1;
  request.all_devices = false;
  request.one_process = true;
  request.max_microbatches = int(std::min<index_t>(64, batch));
  request.split = std::move(split);
  const planner::Report report = plan(request);
  const planner::Layout best = report.best();
  std::printf("--plan auto on %d workers (one core each), predicted from a profile of this machine:\n%s", workers,
              planner::describe(report, request.model).c_str());
  return best;
}

/// --plan auto under mpirun or srun: the launch fixes the stages and the replicas (the processes are
/// stages x replicas; the stage count must be one of `stage_counts`, the trainer's), and the planner
/// chooses the schedule, the microbatch count and, among the splits the trainer compiles (`split`),
/// the one for that stage count and schedule, for `batch` samples per step over all replicas.
/// - Every rank takes part in measuring the hand-over between stages and the gradient sum over
///   replicas (planner::rank_link, replica_sum_bandwidth).
/// - The first rank alone profiles the model (`calibrate()` returns its cost model). It hands the
///   model to the others as JSON, so every rank plans from the same numbers and chooses the same
///   layout; the ranks check that they did.
/// - The first rank prints the report.
template <class Calibrate, class Split>
planner::Layout plan_across_ranks(comm::Communicator& comm, Calibrate&& calibrate, index_t batch,
                                  const std::vector<int>& stage_counts, Split split, std::vector<std::string> schedules = {}) {
  const comm::Topology& topology = comm.topology();
  CUPIPE_REQUIRE(topology.tensor == 1, "--plan auto plans pipeline stages and replicas; leave out --tp");
  if (std::find(stage_counts.begin(), stage_counts.end(), topology.stages) == stage_counts.end()) {
    std::string counts;
    for (const int p : stage_counts) counts += (counts.empty() ? "" : ", ") + std::to_string(p);
    CUPIPE_THROW("--plan auto: ", topology.world, " processes over --dp ", topology.replicas, " are ", topology.stages,
                 " stages, but this trainer runs ", counts, " stages");
  }
  planner::LinkCost link;
  if (topology.stages >= 2) {
    backend::Host<float> host;  // the hand-over's buffers, in host memory as CommTransport stages them
    link = planner::rank_link(comm, host);
  }
  const double sum_bandwidth = topology.replicas >= 2 ? planner::replica_sum_bandwidth(comm) : 0.0;
  std::string measured;
  if (topology.rank == 0) {
    planner::CostModel model = calibrate();
    model.link_latency = link.latency;
    model.link_bytes_per_second = link.bytes_per_second;
    model.allreduce_bytes_per_second = sum_bandwidth;
    measured = planner::to_json(model).dump();
  }
  // The other ranks wait here while the first profiles (seconds for these models, more for larger
  // ones): the collectives' deadline is raised to at least 15 minutes for this one exchange.
  const double collective_timeout = comm.collective_timeout();
  if (collective_timeout > 0) comm.set_collective_timeout(std::max(collective_timeout, 900.0));
  std::string shared;
  try {
    shared = comm::share_from_first(comm, measured);
  } catch (...) {
    comm.set_collective_timeout(collective_timeout);
    throw;
  }
  comm.set_collective_timeout(collective_timeout);
  planner::Request request;
  request.model = planner::cost_model_from_json(nlohmann::json::parse(shared), "--plan auto: the first rank's cost model");
  request.devices = topology.world;
  request.batch = batch;
  request.stage_counts = {topology.stages};
  request.max_replicas = topology.replicas;
  request.all_devices = true;
  request.one_process = false;
  request.max_microbatches = int(std::clamp<index_t>(batch / topology.replicas, 1, 64));
  request.split = std::move(split);
  request.schedules = std::move(schedules);
  const planner::Report report = plan(request);
  const planner::Layout best = report.best();
  std::string chosen = best.schedule + " m=" + std::to_string(best.microbatches) + " cuts=";
  for (const std::size_t cut : best.cuts) chosen += std::to_string(cut) + ",";
  comm::require_same_settings(comm, {{"plan", chosen}});  // a guard: its first 55 bytes are compared
  if (topology.rank == 0)
    std::printf("--plan auto over %d processes (stages x replicas: %d x %d), predicted from a profile of the first rank and "
                "the links measured between the ranks (hand-over %.1f us + %.2f GB/s, gradient sum %.2f GB/s):\n%s",
                topology.world, topology.stages, topology.replicas, link.latency * 1e6, link.bytes_per_second / 1e9,
                sum_bandwidth / 1e9, planner::describe(report, request.model).c_str());
  return best;
}

/// A trainer's --plan auto: across the ranks of `comm` when there is one (plan_across_ranks), else
/// in this process on `workers` workers (0: plan_workers' default, written back) with
/// `stage_counts`, for `batch` samples; the schedules are `schedules`, or (empty) those this build
/// compiles.
template <class Calibrate, class Split>
planner::Layout plan_auto(comm::Communicator* comm, Calibrate&& calibrate, int& workers, index_t batch,
                          std::vector<int> stage_counts, Split split, std::vector<std::string> schedules = {}) {
  if (schedules.empty()) schedules = built_schedule_names();
  // Under a launcher even one process has a communicator, whose topology fixes the stages.
  if (comm) return plan_across_ranks(*comm, calibrate, batch, stage_counts, std::move(split), std::move(schedules));
  workers = plan_workers(workers);
  return plan_in_process(calibrate(), workers, batch, std::move(stage_counts), std::move(split), std::move(schedules));
}

}  // namespace cupipe::examples
