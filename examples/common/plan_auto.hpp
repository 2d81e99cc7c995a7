// SPDX-License-Identifier: Apache-2.0
// --plan auto, shared by the trainers' main.cpp (host code only: trainer.hpp, which nvcc also
// compiles, does not include it): plan a run from a cost model measured here, print the report, and
// hand back the best layout. In one process the planner chooses the stages too; under mpirun the
// launch fixes the replicas, and the planner chooses the tensor-parallel degree and the
// context-parallel ring (where the trainer builds them; the stages follow), the schedule and the
// microbatches.
#pragma once

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <string>
#include <string_view>
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

/// The microbatch counts --plan auto profiles (planner::calibrate): those the planner tries on 1 to
/// 4 stages of `samples` samples (one replica's), up to 64 microbatches, so their times are measured,
/// not interpolated.
inline std::vector<int> profiled_microbatch_counts(index_t samples) {
  return planner::planned_microbatch_counts({1, 2, 3, 4}, samples, 64);
}

/// Plans one process on `workers` workers (one BLAS thread each) for `batch` samples, with the stage counts
/// and splits the program compiles (`split`: a virtual stage count's cuts, empty where it has none)
/// and the schedules it compiles (`schedules`; empty: every one), leaving out what it `refuses`
/// (planner::Request::refuses), prints the report, and returns the best layout (throws, naming the
/// refusals, when none fits).
template <class Split>
planner::Layout plan_in_process(planner::CostModel model, int workers, index_t batch, std::vector<int> stage_counts,
                                Split split, std::vector<std::string> schedules = {},
                                planner::Refusal refuses = {}) {
  planner::Request request;
  request.refuses = std::move(refuses);
  request.schedules = std::move(schedules);
  request.model = std::move(model);
  request.devices = workers;
  request.batch = batch;
  request.stage_counts = std::move(stage_counts);
  request.max_replicas = 1;
  request.all_devices = false;
  request.one_process = true;
  request.cores = int(std::thread::hardware_concurrency());
  request.max_microbatches = int(std::min<index_t>(64, batch));
  request.split = std::move(split);
  const planner::Report report = plan(request);
  const planner::Layout best = report.best();
  std::printf("--plan auto on %d workers (one BLAS thread each, %u cores), predicted from a profile of this machine:\n%s", workers,
              unsigned(request.cores), planner::describe(report, request.model).c_str());
  return best;
}

/// What --plan auto may choose across processes besides the schedule, the microbatches and the
/// split: how a replica's processes divide into stages, tensor-parallel ranks and context-parallel
/// rings, for a trainer that builds those models.
struct RankChoice {
  /// The tensor-parallel degrees to consider, among those the trainer runs; a degree that does not
  /// divide the processes per replica is left out.
  std::vector<int> tensor_degrees{1};
  /// The context-parallel ring sizes to consider, likewise.
  std::vector<int> context_degrees{1};
  /// The trainer runs tensor-parallel ranks and context-parallel rings in one layout; false: a
  /// layout has one or the other.
  bool tensor_with_context = false;
  /// Times a sum over a tensor-parallel pair (planner::tensor_sum_cost over the world in pairs);
  /// called on every rank when a degree above 1 is a candidate.
  std::function<planner::LinkCost()> measure_sum{};
  /// Times the gradient sum with every process a replica (planner::replica_sum_bandwidth over the
  /// world); called on every rank when the launch has one replica and a ring above 1 is a
  /// candidate, since a ring's ranks sum their gradients as replicas do. Empty function: such a
  /// sum is planned as free.
  std::function<double()> measure_replica_sum{};
  /// The layouts the trainer cannot run (planner::Request::refuses); empty function: none.
  planner::Refusal refuses{};
};

/// --plan auto under mpirun or srun: the launch fixes the replicas (--dp), and the processes of a
/// replica are its stages x tensor-parallel ranks x context-parallel ring: the planner chooses the
/// tensor degree and the ring size among `ranks`' (the stage count follows; it must be one of
/// `stage_counts`, the trainer's), the schedule, the microbatch count and, among the splits the
/// trainer compiles (`split`), the one for that stage count and schedule, for `batch` samples per
/// step over all replicas. `comm` is the launch's communicator, with every process of a replica a
/// stage (no tensor or context parallelism); the caller re-forms it when the chosen layout has a
/// tensor degree or a ring above 1.
/// - Every rank takes part in measuring the hand-over between stages (which also prices a ring's
///   passes of keys and values), the gradient sum over replicas (planner::rank_link,
///   replica_sum_bandwidth; over the world, ranks.measure_replica_sum, where one replica's ring
///   would sum) and, where a degree above 1 is a candidate, a sum over a tensor-parallel pair
///   (ranks.measure_sum).
/// - The first rank alone profiles the model (`calibrate()` returns its cost model, with the
///   tensor variants of the candidate degrees). It hands the model to the others as JSON, so every
///   rank plans from the same numbers and chooses the same layout; the ranks check that they did.
/// - The first rank prints the report.
template <class Calibrate, class Split>
planner::Layout plan_across_ranks(comm::Communicator& comm, Calibrate&& calibrate, index_t batch,
                                  const std::vector<int>& stage_counts, Split split, std::vector<std::string> schedules = {},
                                  const RankChoice& ranks = {}, std::vector<int> zero_stages = {}) {
  const comm::Topology& topology = comm.topology();
  CUPIPE_REQUIRE(topology.tensor == 1 && topology.context == 1,
                 "--plan auto plans the tensor-parallel degree and the context-parallel ring itself; leave out --tp and --cp");
  const int per_replica = topology.stages;  // a replica's processes: stages x tensor ranks x ring ranks
  // The (tensor degree, ring size) pairs that leave a stage count the trainer runs.
  std::vector<std::pair<int, int>> shapes;
  std::vector<int> degrees, rings, counts;
  const auto add = [](std::vector<int>& to, int x) {
    if (std::find(to.begin(), to.end(), x) == to.end()) to.push_back(x);
  };
  for (const int t : ranks.tensor_degrees)
    for (const int cp : ranks.context_degrees) {
      if (t < 1 || cp < 1 || per_replica % (t * cp) != 0) continue;
      if (t > 1 && cp > 1 && !ranks.tensor_with_context) continue;
      const int p = per_replica / (t * cp);
      if (std::find(stage_counts.begin(), stage_counts.end(), p) == stage_counts.end()) continue;
      if (std::find(shapes.begin(), shapes.end(), std::pair{t, cp}) != shapes.end()) continue;
      shapes.emplace_back(t, cp);
      add(degrees, t);
      add(rings, cp);
      add(counts, p);
    }
  if (shapes.empty()) {
    std::string built;
    for (const int p : stage_counts) built += (built.empty() ? "" : ", ") + std::to_string(p);
    CUPIPE_THROW("--plan auto: ", topology.world, " processes over --dp ", topology.replicas, " are ", per_replica,
                 " per replica, but this trainer runs ", built, " stages",
                 ranks.tensor_degrees.size() > 1 || ranks.context_degrees.size() > 1
                     ? " (times a tensor-parallel degree or a context-parallel ring it builds)"
                     : "");
  }
  const bool tensor_candidates = std::any_of(degrees.begin(), degrees.end(), [](int t) { return t > 1; });
  const bool ring_candidates = std::any_of(rings.begin(), rings.end(), [](int cp) { return cp > 1; });
  planner::LinkCost link, tensor_sum;
  if (per_replica >= 2) {
    backend::Host<float> host;  // the hand-over's buffers, in host memory as CommTransport stages them
    link = planner::rank_link(comm, host);
  }
  double sum_bandwidth = topology.replicas >= 2 ? planner::replica_sum_bandwidth(comm) : 0.0;
  if (topology.replicas < 2 && ring_candidates && ranks.measure_replica_sum) sum_bandwidth = ranks.measure_replica_sum();
  if (tensor_candidates) {
    CUPIPE_REQUIRE(bool(ranks.measure_sum), "--plan auto: tensor-parallel degrees without a way to time their sums");
    tensor_sum = ranks.measure_sum();
  }
  std::string measured;
  if (topology.rank == 0) {
    planner::CostModel model = calibrate();
    model.link_latency = link.latency;
    model.link_bytes_per_second = link.bytes_per_second;
    model.allreduce_bytes_per_second = sum_bandwidth;
    model.tensor_sum_latency = tensor_sum.latency;
    model.tensor_sum_bytes_per_second = tensor_sum.bytes_per_second;
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
  request.stage_counts = counts;
  request.tensor_degrees = degrees;
  request.context_degrees = rings;
  request.max_replicas = topology.replicas;
  request.all_devices = true;
  request.one_process = false;
  // Ranks sharing a node's cores slow each other. The first rank's count for every rank: nodes may
  // hold different counts, and every rank must plan from the same numbers.
  request.colocated = int(comm.sum_over_world(topology.rank == 0 ? double(planner::processes_on_this_node()) : 0.0));
  request.cores = int(comm.sum_over_world(topology.rank == 0 ? double(std::thread::hardware_concurrency()) : 0.0));
  request.max_microbatches = int(std::clamp<index_t>(batch / topology.replicas, 1, 64));
  request.split = std::move(split);
  request.schedules = std::move(schedules);
  request.zero_stages = std::move(zero_stages);
  // The launch fixed the replicas; fewer, with more stages or tensor ranks each, is another launch.
  const int replicas = topology.replicas;
  request.refuses = [&](std::string_view schedule, int p, int d, int t, int cp) -> std::string {
    if (d != replicas) return "the launch fixed --dp " + std::to_string(replicas);
    if (std::find(shapes.begin(), shapes.end(), std::pair{t, cp}) == shapes.end())
      return "this trainer runs tensor-parallel ranks or a context-parallel ring, not both";
    return ranks.refuses ? ranks.refuses(schedule, p, d, t, cp) : std::string();
  };
  const planner::Report report = plan(request);
  const planner::Layout best = report.best();
  std::string chosen = best.schedule + " m=" + std::to_string(best.microbatches) + " t=" + std::to_string(best.tensor) +
                       " cp=" + std::to_string(best.context) + " z=" + std::to_string(best.zero) + " cuts=";
  for (const std::size_t cut : best.cuts) chosen += std::to_string(cut) + ",";
  comm::require_same_settings(comm, {{"plan", chosen}});  // a guard: its first 55 bytes are compared
  if (topology.rank == 0) {
    std::string listed;
    for (const auto& [t, cp] : shapes)
      listed += (listed.empty() ? "" : ", ") + std::to_string(per_replica / (t * cp)) + " x " + std::to_string(replicas) +
                (tensor_candidates ? " x " + std::to_string(t) : std::string()) +
                (ring_candidates ? " x " + std::to_string(cp) : std::string());
    std::printf("--plan auto over %d processes (stages x replicas%s%s: %s), predicted from a profile of the first rank and "
                "the links measured between the ranks (hand-over %.1f us + %.2f GB/s, gradient sum %.2f GB/s",
                topology.world, tensor_candidates ? " x tensor ranks" : "", ring_candidates ? " x ring ranks" : "",
                listed.c_str(), link.latency * 1e6, link.bytes_per_second / 1e9, sum_bandwidth / 1e9);
    if (tensor_candidates)
      std::printf(", tensor-parallel sum %.1f us + %.2f GB/s", tensor_sum.latency * 1e6, tensor_sum.bytes_per_second / 1e9);
    std::printf("):\n%s", planner::describe(report, request.model).c_str());
    // Processes that share a node's cores slow each other: the plan counts it from the contention
    // the first rank measured, for as many workers at once as measured.
    const unsigned cores = std::thread::hardware_concurrency();
    if (request.colocated > 1 && request.model.contention.size() > 1) {
      std::printf("%d processes share this node (%u cores): each action is slowed as measured with", request.colocated, cores);
      const std::size_t entries = request.model.contention.size();
      for (std::size_t n = 1; n < entries; ++n)
        std::printf(" %zu at once x%.2f%s", n + 1, request.model.contention[n], n + 1 < entries ? "," : "");
      // Beyond what was measured: what the planner charges (the last entry, times a share of the cores).
      if (std::size_t(request.colocated) > entries)
        std::printf("; %d at once charged x%.2f", request.colocated,
                    planner::detail::contention_at(request.model.contention, std::size_t(request.colocated), request.cores));
      std::printf("\n");
    }
  }
  return best;
}

/// A trainer's --plan auto: across the ranks of `comm` when there is one (plan_across_ranks), else
/// in this process on `workers` workers (0: plan_workers' default, written back) with
/// `stage_counts`, for `batch` samples; the schedules are `schedules`, or (empty) those this build
/// compiles; with replicas, the ZeRO stages are `zero_stages` (empty: off).
template <class Calibrate, class Split>
planner::Layout plan_auto(comm::Communicator* comm, Calibrate&& calibrate, int& workers, index_t batch,
                          std::vector<int> stage_counts, Split split, std::vector<std::string> schedules = {},
                          const RankChoice& ranks = {}, std::vector<int> zero_stages = {}) {
  if (schedules.empty()) schedules = built_schedule_names();
  // Under a launcher even one process has a communicator, whose topology fixes the replicas.
  if (comm)
    return plan_across_ranks(*comm, calibrate, batch, stage_counts, std::move(split), std::move(schedules), ranks,
                             std::move(zero_stages));
  workers = plan_workers(workers);
  return plan_in_process(calibrate(), workers, batch, std::move(stage_counts), std::move(split), std::move(schedules),
                         ranks.refuses);
}

}  // namespace cupipe::examples
