// SPDX-License-Identifier: Apache-2.0
// planner_check --mpi: the planner across processes, with data-parallel replicas, against measured
// runs. Under `mpirun -np N` each process is one device; the model is the sleeping `nap` layers, so
// N processes on fewer cores still take their layers' times (a sleep needs no core) and the replicas'
// gradient sums are tiny. For each batch the first rank calibrates the cost model, every rank
// measures the links (rank_link between stages, replica_sum_bandwidth over replicas), the planner
// searches every stage count x replicas = N (1, 2 and 4 stages are compiled), and every layout it
// reports runs on a communicator of its stage count. The table sets the planner's choice beside the
// fastest measured layout, beside the "about two devices per stage" rule (stages = N / 2, each with
// two replicas; the fastest measured layout with that split) and the "microbatch of about
// sqrt(batch) samples" rule.
#include <mpi.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "check.hpp"
#include "cupipe/comm/agreement.hpp"
#include "cupipe/comm/mpi.hpp"
#include "cupipe/planner/cost_json.hpp"

namespace planner_check {

namespace {

double median_abs(std::vector<double> v) {
  for (double& x : v) x = std::abs(x);
  std::nth_element(v.begin(), v.begin() + std::ptrdiff_t(v.size() / 2), v.end());
  return v[v.size() / 2];
}

/// The fastest measured row among those `keep` accepts; null when none does.
template <class Keep>
const Row* fastest(const std::vector<Row>& rows, Keep keep) {
  const Row* best = nullptr;
  for (const Row& r : rows)
    if (keep(r) && (!best || r.measured.step_seconds < best->measured.step_seconds)) best = &r;
  return best;
}

}  // namespace

namespace {
using Comms = std::map<int, std::shared_ptr<comm::Communicator>>;
int sweep_across_ranks(Comms& comms, int max_microbatches, const RunOptions& options, const std::vector<index_t>& batches);
}

int mpi_sweep(int& argc, char**& argv, int max_microbatches, const RunOptions& options, const std::vector<index_t>& batches) {
  comm::MpiSession session(&argc, &argv);
  // Outside the try: a communicator's destructor frees its MPI communicators (collective), which
  // must not run before the abort below while the other ranks wait in a collective.
  Comms comms;
  try {
    return sweep_across_ranks(comms, max_microbatches, options, batches);
  } catch (const std::exception& e) {
    // The other ranks would wait in a collective until its deadline: end the job now.
    std::fprintf(stderr, "planner_check --mpi: %s\n", e.what());
    MPI_Abort(MPI_COMM_WORLD, 1);
    return 1;
  }
}

namespace {

int sweep_across_ranks(Comms& comms, int max_microbatches, const RunOptions& options, const std::vector<index_t>& batches) {
  int world = 0, rank = 0;
  CUPIPE_CHECK_MPI(MPI_Comm_size(MPI_COMM_WORLD, &world));
  CUPIPE_CHECK_MPI(MPI_Comm_rank(MPI_COMM_WORLD, &rank));
  const ModelCheck model = nap_check();
  // One communicator per stage count the model compiles that divides the world (each splits the
  // world into stages x replicas); made in the same order on every rank, as MPI requires.
  for (const int p : model.stage_counts)
    if (world % p == 0) comms[p] = std::make_shared<comm::MpiCommunicator>(MPI_COMM_WORLD, p);
  comm::Communicator& everyone = *comms.at(1);  // one stage: every rank a replica
  comm::require_same_settings(everyone, {{"planner_check --mpi batches", std::to_string(batches.size())},
                                         {"steps", std::to_string(options.steps)},
                                         {"max microbatches", std::to_string(max_microbatches)}});
  // The links: between two stages' processes (the most stages the world holds), and the sum over
  // replicas (every rank a replica).
  planner::LinkCost link;
  for (auto it = comms.rbegin(); it != comms.rend(); ++it)
    if (it->first >= 2) {
      backend::Host<double> host;
      link = planner::rank_link(*it->second, host);
      break;
    }
  const double sum_bandwidth = world >= 2 ? planner::replica_sum_bandwidth(everyone) : 0.0;
  if (rank == 0) {
    std::printf("planner_check --mpi: %d processes (devices), nap model; hand-over %.1f us + %.2f GB/s, gradient sum "
                "%.2f GB/s (measured here)\n\n",
                world, link.latency * 1e6, link.bytes_per_second / 1e9, sum_bandwidth / 1e9);
    std::printf("| devices | batch | layouts | step within 10%% | median / worst error | planner's choice | its ms | best "
                "measured | ms | choice / best | 2 devices per stage: best | ms | rule / best | sqrt(samples) microbatches: best | ms | rule / best |\n"
                "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n");
    std::fflush(stdout);
  }
  int within = 0;
  std::vector<std::string> worst_lines;
  for (const index_t batch : batches) {
    std::string measured;
    if (rank == 0) {
      planner::CostModel costs = model.calibrate(batch, {});  // a replica's batch is a share of it: the three sizes
      costs.link_latency = link.latency;
      costs.link_bytes_per_second = link.bytes_per_second;
      costs.allreduce_bytes_per_second = sum_bandwidth;
      measured = planner::to_json(costs).dump();
    }
    const planner::CostModel costs =
        planner::cost_model_from_json(nlohmann::json::parse(comm::share_from_first(everyone, measured)), "planner_check --mpi");
    planner::Request request;
    request.model = costs;
    request.devices = world;
    request.batch = batch;
    request.stage_counts = model.stage_counts;
    request.all_devices = true;
    request.one_process = false;
    // The first rank's count for every rank, so that all plan from the same numbers.
    request.colocated = int(everyone.sum_over_world(rank == 0 ? double(planner::processes_on_this_node()) : 0.0));
    request.split = model.split;
    request.max_microbatches = max_microbatches;
    const planner::Report report = plan(request);
    // Every rank runs the same layouts in the same order (each a collective run).
    std::string listed;
    for (const planner::Layout& layout : report.ranked) listed += layout.describe() + ";";
    comm::require_same_settings(everyone, {{"layouts", std::to_string(report.ranked.size())},
                                           {"layout list hash", std::to_string(std::hash<std::string>{}(listed))}});
    std::vector<Row> rows;
    for (const planner::Layout& layout : report.ranked) {
      RunOptions o = options;
      o.communicator = comms.at(layout.stages);
      rows.push_back({layout, model.run(layout, batch, o)});
      if (rank == 0) std::fprintf(stderr, "\rbatch %lld: %zu/%zu layouts measured", (long long)batch, rows.size(), report.ranked.size());
    }
    if (rank == 0) std::fprintf(stderr, "\n");
    if (rank != 0) continue;  // every rank holds the same figures (run_layout's slowest_over_ranks)
    std::vector<double> errors;
    int close = 0;
    double worst = 0;
    for (const Row& r : rows) {
      errors.push_back(r.time_error());
      close += std::abs(r.time_error()) <= 0.10;
      if (std::abs(r.time_error()) > std::abs(worst)) worst = r.time_error();
    }
    const Row& chosen = rows.front();
    const Row* best = fastest(rows, [](const Row&) { return true; });
    const Row* two = fastest(rows, [&](const Row& r) { return 2 * r.layout.stages == world; });
    // The sqrt rule: a microbatch of about sqrt(samples) samples, that is about sqrt(samples)
    // microbatches, for each replica's samples: per replica count, the microbatch count the planner
    // tried nearest that (the smaller at a tie).
    std::map<int, int> rule_m;
    for (const Row& r : rows) {
      const double target = std::sqrt(double(batch) / r.layout.replicas);
      auto [it, fresh] = rule_m.try_emplace(r.layout.replicas, r.layout.microbatches);
      const double now = std::abs(it->second - target), here = std::abs(r.layout.microbatches - target);
      if (here < now || (here == now && r.layout.microbatches < it->second)) it->second = r.layout.microbatches;
    }
    const Row* rule = fastest(rows, [&](const Row& r) { return r.layout.microbatches == rule_m.at(r.layout.replicas); });
    const double ratio = chosen.measured.step_seconds / best->measured.step_seconds;
    within += ratio <= 1.05;
    const auto ms = [](const Row* r) { return r ? r->measured.step_seconds * 1e3 : 0.0; };
    std::printf("| %d | %lld | %zu | %d | %.1f%% / %+.1f%% | %s | %.2f | %s | %.2f | %.3f | %s | %.2f | %.3f | %s | %.2f | %.3f |\n",
                world, (long long)batch, rows.size(), close, 100 * median_abs(errors), 100 * worst,
                chosen.layout.describe().c_str(), ms(&chosen), best->layout.describe().c_str(), ms(best), ratio,
                two ? two->layout.describe().c_str() : "(none)", ms(two), two ? ms(two) / ms(best) : 0.0,
                rule ? rule->layout.describe().c_str() : "(none)", ms(rule),
                rule ? ms(rule) / ms(best) : 0.0);
    std::fflush(stdout);
    std::vector<const Row*> order;
    for (const Row& r : rows) order.push_back(&r);
    std::sort(order.begin(), order.end(),
              [](const Row* a, const Row* b) { return std::abs(a->time_error()) > std::abs(b->time_error()); });
    std::string line = "  batch " + std::to_string(batch) + ":";
    char cell[160];
    for (std::size_t i = 0; i < std::min<std::size_t>(order.size(), 4); ++i) {
      std::snprintf(cell, sizeof cell, "%s %s %.2f / %.2f (%+.1f%%)", i ? ";" : "", order[i]->layout.describe().c_str(),
                    order[i]->layout.step_seconds * 1e3, order[i]->measured.step_seconds * 1e3, 100 * order[i]->time_error());
      line += cell;
    }
    worst_lines.push_back(line);
  }
  if (rank == 0) {
    std::printf("\nthe planner's choice within 5%% of the best measured layout: %d of %zu batches\n", within, batches.size());
    std::printf("\nthe layouts predicted worst, per batch (predicted / measured ms):\n");
    for (const std::string& line : worst_lines) std::printf("%s\n", line.c_str());
  }
  return 0;
}

}  // namespace

}  // namespace planner_check
