// SPDX-License-Identifier: Apache-2.0
// cupipe_plan: picks a parallel layout (stages, chunks, microbatches, schedule, replicas, layer split)
// from a cost model and prints it with its predicted step time, bubble and per-worker peak memory,
// the runners-up and why they lost, and what was refused.
//   cupipe_plan --model mlp --devices 4 --batch 256                 profile the Fashion-MNIST MLP here
//   cupipe_plan --model gpt-tiny --devices 8 --batch 64 --memory-gb 0.05 --json
//   cupipe_plan --costs mine.json --devices 64 --batch 1024         a cost model of your own model
//   cupipe_plan --synthetic 48 --devices 64 --batch 1024            48 equal layers (timing the search)
//   mpirun -np 4 cupipe_plan --model mlp --devices 4 --measure-comm   link and gradient sum measured
//   mpirun -np 2 cupipe_plan --model gpt-tiny --devices 4 --tensor 2 --measure-comm
//                                                                   tensor parallelism searched too
// --write-costs FILE saves the cost model used (a starting point for --costs). Every figure the
// planner prints is a prediction from the cost model; the search time and --measure-comm's link and
// gradient-sum figures are measured.
#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <array>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "cupipe/cupipe.hpp"
#include "cupipe/gpt/model.hpp"
#include "cupipe/planner/calibrate.hpp"
#include "cupipe/planner/cost_json.hpp"
#include "cupipe/planner/planner.hpp"
#if CUPIPE_PLAN_HAS_MPI
#include <memory>

#include "cupipe/comm/mpi.hpp"
#endif

using namespace cupipe;

namespace {

using Mlp = Sequential<Linear<784, 1024>, ReLU, Linear<1024, 512>, ReLU, Linear<512, 256>, ReLU, Linear<256, 10>>;
constexpr gpt::Config tiny{256, 64, 4, 4, 128};

/// Calibrated here (planner::calibrate): every layer and the loss at `samples` samples and a quarter
/// of them, and the optimizer step; for the GPT, also one rank's part of each split in `tensor`
/// (planner::calibrate_tensor_parts); with the largest microbatch of each of `microbatches` too, as
/// the planner splits `samples`.
planner::CostModel profiled(const std::string& name, index_t samples, int repeats, const std::vector<int>& tensor,
                            const std::vector<int>& microbatches) {
  using Host = backend::Host<float>;
  Rng rng(1);
  if (name == "mlp") {
    std::vector<float> x(static_cast<std::size_t>(samples * 784));
    for (float& v : x) v = float(rng.uniform());
    for (const int t : tensor)
      CUPIPE_REQUIRE(t == 1, "cupipe_plan: --tensor ", t, ": the mlp has no tensor-parallel split here (gpt-tiny has)");
    return planner::calibrate<Mlp, Host>(ConstView<float>{x.data(), Shape{samples, 784}}, repeats, 1, microbatches);
  }
  using Gpt = gpt::Model<tiny>;
  const index_t rows = samples * tiny.context;
  std::vector<std::int32_t> ids(static_cast<std::size_t>(rows));
  for (auto& t : ids) t = std::int32_t(rng.below(std::uint64_t(tiny.vocab)));
  const ConstView<std::int32_t> x{ids.data(), Shape{rows, 1}};
  planner::CostModel model = planner::calibrate<Gpt, Host>(x, repeats, tiny.context, microbatches);
  for (const int t : tensor) {
    if (t == 2) model.tensor_variants.push_back(planner::calibrate_tensor_parts<gpt::TensorParallelModel<tiny, 2>, Host>(x, 2, repeats, tiny.context));
    else if (t == 4) model.tensor_variants.push_back(planner::calibrate_tensor_parts<gpt::TensorParallelModel<tiny, 4>, Host>(x, 4, repeats, tiny.context));
    else CUPIPE_REQUIRE(t == 1, "cupipe_plan: --tensor ", t, ": gpt-tiny splits 1, 2 or 4 ways (its 4 heads)");
  }
  return model;
}

planner::CostModel synthetic(int layers) {
  planner::CostModel model;
  model.profiled_rows = 1024;
  for (int l = 0; l < layers; ++l)
    model.layers.push_back({"block" + std::to_string(l), 1e-3, 1e-3, 1e-3, 7e6, 768, 768, 8 * 768});
  model.link_latency = 1e-5;
  model.link_bytes_per_second = 25e9;
  model.allreduce_bytes_per_second = 50e9;
  return model;
}

/// Reads a cost model file (planner::cost_model_from_json names a missing or mistyped field).
planner::CostModel from_json(const std::string& path) {
  std::ifstream file(path);
  CUPIPE_REQUIRE(file, "cupipe_plan: cannot read the cost model '", path, "'");
  nlohmann::json j;
  try {
    file >> j;
  } catch (const std::exception& e) {
    CUPIPE_THROW(path, ": not JSON: ", e.what());
  }
  return planner::cost_model_from_json(j, path);
}

nlohmann::json layout_json(const planner::Layout& l) {
  return {{"schedule", l.schedule},      {"stages", l.stages},         {"chunks", l.chunks},
          {"microbatches", l.microbatches}, {"replicas", l.replicas},  {"batches", l.batches},
          {"tensor", l.tensor},          {"context", l.context},        {"cuts", l.cuts},              {"step_seconds", l.step_seconds}, {"bubble", l.bubble},
          {"allreduce_seconds", l.allreduce_seconds}, {"update_seconds", l.update_seconds}, {"peak_bytes", l.peak_bytes},
          {"peak_activation_bytes", l.peak_activation_bytes}, {"peak_activation_low_bytes", l.peak_activation_low_bytes},
          {"peak_activation_high_bytes", l.peak_activation_high_bytes}, {"most_bytes", l.most_bytes},
          {"offload", l.offload},        {"offload_resident", l.offload_resident}, {"zero", l.zero},
          {"exposed_all_to_all_seconds", l.exposed_all_to_all_seconds},
          {"unpaired_all_to_all_seconds", l.unpaired_all_to_all_seconds}};
}

}  // namespace

int main(int argc, char** argv) {
  std::string model_name, costs_path, write_costs, schedules;
  int synthetic_layers = 0, repeats = 3;
  index_t profile_samples = 64;
  double memory_gb = 0;
  bool json = false;
  planner::Request request;
  CLI::App app{"Pick a parallel layout from measured costs (every figure printed is predicted from the cost model)."};
  auto* model_option = app.add_option("--model", model_name, "profile a built-in model on this CPU: mlp or gpt-tiny")
                           ->check(CLI::IsMember({"mlp", "gpt-tiny"}));
  auto* costs_option = app.add_option("--costs", costs_path, "read the cost model from this JSON file");
  auto* synthetic_option = app.add_option("--synthetic", synthetic_layers, "N equal layers (F = B = W = 1 ms)");
  model_option->excludes(costs_option)->excludes(synthetic_option);
  costs_option->excludes(synthetic_option);
  app.add_option("--write-costs", write_costs, "write the cost model used to this JSON file");
  app.add_option("--profile-samples", profile_samples, "samples in the profiled microbatch")->capture_default_str()->check(CLI::PositiveNumber);
  app.add_option("--repeats", repeats, "profile runs per layer (median)")->capture_default_str()->check(CLI::PositiveNumber);
  app.add_option("--tensor", request.tensor_degrees,
                 "tensor-parallel degrees to search too, e.g. --tensor 2 (default: 1; gpt-tiny profiles 2 and 4; "
                 "--costs needs the degree's tensor_variants)")
      ->check(CLI::PositiveNumber);
  app.add_option("--context", request.context_degrees,
                 "context-parallel ring sizes to search too, e.g. --context 2 (default: 1; each sample's rows split "
                 "over a ring of processes; the model's samples must cut into 2 cp chunks)")
      ->check(CLI::PositiveNumber);
  app.add_option("--zero", request.zero_stages,
                 "ZeRO stages to consider for layouts with replicas, e.g. --zero 0,1,2,3 (PipelineOptions::zero; "
                 "default: 0)")
      ->delimiter(',')
      ->check(CLI::Range(0, 3));
  app.add_option("--devices", request.devices, "devices (stages x replicas x tensor ranks x context ranks)")->capture_default_str()->check(CLI::PositiveNumber);
  app.add_option("--memory-gb", memory_gb, "memory per device in GB (0: no limit)")->capture_default_str()->check(CLI::NonNegativeNumber);
  app.add_option("--batch", request.batch, "samples per optimizer step")->capture_default_str()->check(CLI::PositiveNumber);
  app.add_option("--schedules", schedules, "comma-separated policies to consider (default: all: " + schedule::policy_names() + ")");
  app.add_option("--max-microbatches", request.max_microbatches, "most microbatches to try")->capture_default_str()->check(CLI::PositiveNumber);
  app.add_option("--runners-up", request.runners_up, "runners-up to print")->capture_default_str();
  app.add_flag("--asynchronous", request.asynchronous,
               "consider PipeDream and 2BW too (stale weights change what training computes)");
  app.add_flag("--json", json, "print one JSON object");
  bool measure_comm = false;
#if CUPIPE_PLAN_HAS_MPI
  app.add_flag("--measure-comm", measure_comm,
               "under mpirun/srun (an even number of processes): measure the hand-over between two ranks (MPI, "
               "host memory), the gradient sum over every rank as a replica and the sum over a tensor-parallel "
               "pair, and plan with them; the first rank prints");
#endif
  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp& e) {
    return app.exit(e);
  } catch (const CLI::ParseError& e) {
    std::cerr << "cupipe_plan: " << e.what() << "\n";
    return 2;
  }
#if CUPIPE_PLAN_HAS_MPI
  std::unique_ptr<comm::MpiSession> mpi;  // outside the try: MPI_Abort reaches every rank from the catch
#endif
  try {
    CUPIPE_REQUIRE(!model_name.empty() || !costs_path.empty() || synthetic_layers > 0,
                   "cupipe_plan: give --model, --costs or --synthetic (see --help)");
    nlohmann::json measured_comm;
#if CUPIPE_PLAN_HAS_MPI
    planner::LinkCost link, tensor_sum;
    double sum_bandwidth = 0;
    int world = 1;
    if (measure_comm) {
      // Every rank takes part in the measurement; then all but the first are done.
      mpi = std::make_unique<comm::MpiSession>(&argc, &argv);
      CUPIPE_CHECK_MPI(MPI_Comm_size(MPI_COMM_WORLD, &world));
      CUPIPE_REQUIRE(world >= 2 && world % 2 == 0, "cupipe_plan: --measure-comm needs an even number of processes "
                     "under mpirun or srun, got ", world);
      int rank = 0;
      {
        comm::MpiCommunicator communicator(MPI_COMM_WORLD, 2, 60);
        rank = communicator.topology().rank;
        backend::Host<float> host;
        link = planner::rank_link(communicator, host);
      }
      {
        // The gradient sum over every rank as a replica of one stage.
        comm::MpiCommunicator replicas(MPI_COMM_WORLD, 1, 60);
        sum_bandwidth = planner::replica_sum_bandwidth(replicas);
      }
      {
        // A sum over a tensor-parallel group of two ranks (each pair of the world one group).
        comm::MpiCommunicator pairs(MPI_COMM_WORLD, 1, 60, 2);
        tensor_sum = planner::tensor_sum_cost(pairs);
      }
      if (rank != 0) return 0;
      measured_comm = {{"processes", world},
                       {"link_latency", link.latency},
                       {"link_bytes_per_second", link.bytes_per_second},
                       {"allreduce_bytes_per_second", sum_bandwidth},
                       {"tensor_sum_latency", tensor_sum.latency},
                       {"tensor_sum_bytes_per_second", tensor_sum.bytes_per_second}};
    }
#endif
    // Profiled at the batch itself with one replica: the microbatch sizes the planner will split it
    // into are timed too (with replicas each splits its share, which the points interpolate).
    if (!model_name.empty()) {
      std::vector<int> stages = request.stage_counts;
      if (stages.empty())
        for (int p = 1; p <= request.devices; ++p) stages.push_back(p);
      request.model = profiled(model_name, profile_samples, repeats, request.tensor_degrees,
                               profile_samples == request.batch
                                   ? planner::planned_microbatch_counts(stages, request.batch, request.max_microbatches)
                                   : std::vector<int>{});
    } else if (!costs_path.empty()) {
      request.model = from_json(costs_path);
    } else {
      request.model = synthetic(synthetic_layers);
    }
#if CUPIPE_PLAN_HAS_MPI
    if (measure_comm) {
      request.model.link_latency = link.latency;
      request.model.link_bytes_per_second = link.bytes_per_second;
      if (sum_bandwidth > 0) request.model.allreduce_bytes_per_second = sum_bandwidth;
      request.model.tensor_sum_latency = tensor_sum.latency;
      request.model.tensor_sum_bytes_per_second = tensor_sum.bytes_per_second;
      request.one_process = false;  // hand-overs between processes
      request.colocated = planner::processes_on_this_node();
      request.cores = int(std::thread::hardware_concurrency());
      if (!json)
        std::printf("measured over MPI with %d processes: hand-over latency %.1f us, %.2f GB/s; gradient sum over %d "
                    "replicas %.2f GB/s\n",
                    world, link.latency * 1e6, link.bytes_per_second / 1e9, world, sum_bandwidth / 1e9);
      if (!json)
        std::printf("measured over MPI: a sum over a tensor-parallel group of 2 takes %.1f us + %.2f GB/s\n",
                    tensor_sum.latency * 1e6, tensor_sum.bytes_per_second / 1e9);
    }
#endif
    const bool tensor_searched = std::any_of(request.tensor_degrees.begin(), request.tensor_degrees.end(), [](int t) { return t > 1; });
    if (tensor_searched && request.model.tensor_sum_latency == 0 && request.model.tensor_sum_bytes_per_second == 0 && !json)
      std::printf("note: the tensor-parallel sums are taken as free (the cost model has no tensor_sum_latency or "
                  "tensor_sum_bytes_per_second; --measure-comm under mpirun measures them)\n");
    if (!write_costs.empty()) {
      std::ofstream out(write_costs);
      CUPIPE_REQUIRE(out, "cupipe_plan: cannot write '", write_costs, "'");
      out << planner::to_json(request.model).dump(2) << "\n";
    }
    request.memory_bytes = memory_gb * 1e9;
    std::stringstream names(schedules);
    for (std::string name; std::getline(names, name, ',');)
      if (!name.empty()) request.schedules.push_back(name);
    const auto start = std::chrono::steady_clock::now();
    const planner::Report report = plan(request);
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    if (json) {
      nlohmann::json ranked = nlohmann::json::array(), rejected = nlohmann::json::array();
      for (std::size_t i = 0; i < std::min(report.ranked.size(), request.runners_up + 1); ++i)
        ranked.push_back(layout_json(report.ranked[i]));
      for (const planner::Rejected& r : report.rejected) rejected.push_back({{"layout", r.layout}, {"reason", r.reason}});
      std::cout << nlohmann::json{{"predicted", true},          {"considered", report.considered},
                                  {"fit", report.ranked.size()}, {"search_seconds", seconds},
                                  {"ranked", ranked},          {"rejected", rejected},
                                  {"measured_comm", measured_comm}, {"caveats", report.caveats}}
                       .dump()
                << "\n";
    } else {
      std::cout << planner::describe(report, request.model, request.runners_up);
      std::printf("searched in %.3f s (measured)\n", seconds);
    }
    return report.ranked.empty() ? 3 : 0;
  } catch (const cupipe::error& e) {
    std::cerr << "cupipe_plan: " << e.message() << "\n";
#if CUPIPE_PLAN_HAS_MPI
    int size = 1;  // the other ranks may be waiting in the measurement: end them too
    if (mpi && MPI_Comm_size(MPI_COMM_WORLD, &size) == MPI_SUCCESS && size > 1) MPI_Abort(MPI_COMM_WORLD, 1);
#endif
    return 1;
  }
}
