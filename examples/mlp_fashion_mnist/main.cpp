// SPDX-License-Identifier: Apache-2.0
// Trains an MLP on Fashion-MNIST with a pipeline schedule: on the CPU (host backend), or with
// --backend cuda on GPUs in one process, with progress, per-epoch test accuracy, checkpoints (save
// and bit-exact resume), a measured trace and one JSON summary line at the end. Under mpirun/srun
// with --dp it runs stages x replicas processes (host backend).
//
//   mlp_fashion_mnist --schedule 1f1b --stages 4 --microbatches 8 --epochs 10
#include <CLI/CLI.hpp>

#include "cli_checks.hpp"
#include "launch.hpp"
#include "trainer.hpp"

#include <algorithm>
#include <string>
#include <thread>
#include <vector>

#include "plan_auto.hpp"
#include "trainer_schedules.hpp"

using namespace fmnist;
using cupipe::examples::Launcher;
using cupipe::examples::non_negative;
using cupipe::examples::positive;


/// The planner's cost model of the MLP measured here on `rows` samples of `train_set` (planner::
/// calibrate: every layer, the loss and the optimizer step, one BLAS thread), in fp32 on
/// backend::Host<float>, or with `bf16` on Host<bfloat16, float> with the pixels rounded to bf16, as
/// its first stage takes them.
inline planner::CostModel calibrate_here(const io::Dataset& train_set, index_t rows, bool bf16) {
  backend::Host<T>::set_blas_threads(1);
#if CUPIPE_TRAINER_HAS_BF16  // a flush-only build refused bf16 on the host before any data loaded
  if (bf16) {
    std::vector<cupipe::bfloat16> rounded(std::size_t(rows * 784));
    pipeline::convert_values(train_set.images.data(), rounded.data(), rounded.size());
    return planner::calibrate<Model, HostBf16>(ConstView<cupipe::bfloat16>{rounded.data(), Shape{rows, 784}}, 3, 1,
                                               cupipe::examples::profiled_microbatch_counts(rows));
  }
#else
  CUPIPE_REQUIRE(!bf16, "--plan auto: bf16 on the host is not in this build");
#endif
  return planner::calibrate<Model, backend::Host<T>>(ConstView<T>{train_set.images.data(), Shape{rows, 784}}, 3, 1,
                                                     cupipe::examples::profiled_microbatch_counts(rows));
}

/// --plan auto: calibrates the planner's cost model on the first batch of `train_set` here, plans a
/// run in this process on f.workers workers with the splits this program compiles (partition<>),
/// prints the report and sets f's schedule, stages and microbatches to the best layout.
///
/// Under mpirun (`comm`), the processes fix the stages and replicas: the first rank calibrates on its
/// replica's share of the batch, every rank plans from that (plan_across_ranks), and the planner
/// chooses the schedule and microbatches.
inline void plan_layout(Flags& f, const io::Dataset& train_set, comm::Communicator* comm = nullptr) {
  const int replicas = comm ? comm->topology().replicas : 1;
  const index_t rows = index_t(std::min<std::int64_t>(f.batch / replicas, train_set.count));
  CUPIPE_REQUIRE(rows >= 2, "--plan auto: the planner profiles a batch of at least 2 samples", comm ? " per replica" : "",
                 ", got ", rows);
  const auto calibrate = [&] { return calibrate_here(train_set, rows, f.precision == "bf16"); };
  // At most 7 virtual stages (the MLP's layers): 8 is refused before the split is asked for.
  const auto split = [](int virtual_stages) {
    std::vector<std::size_t> cuts;
    with_stage_count<1, 2, 3, 4, 5, 6, 7>(virtual_stages, [&]<int N>() { cuts = stage_cuts<partition<Model, std::size_t(N)>>(); });
    return cuts;
  };
  const index_t batch = index_t(std::min<std::int64_t>(f.batch, train_set.count));
  const planner::Layout best = cupipe::examples::plan_auto(
      comm, calibrate, f.workers, batch, {1, 2, 3, 4}, split);
  f.schedule = best.schedule;
  f.stages = best.stages;
  f.microbatches = best.microbatches;
  f.predicted_step_seconds = best.step_seconds;
}

/// The entries of --stage-backends, in stage order.
inline std::vector<std::string> stage_backend_entries(const std::string& list) {
  std::vector<std::string> entries;
  for (std::size_t at = 0;;) {
    const std::size_t comma = list.find(',', at);
    entries.push_back(list.substr(at, comma == std::string::npos ? std::string::npos : comma - at));
    if (comma == std::string::npos) return entries;
    at = comma + 1;
  }
}

/// --plan auto with --stage-backends (in this process): each stage's backend calibrated here on the
/// first batch (a cuda stage on the current GPU, out of the contention of the CPU stages, its
/// hand-overs priced at the measured host-device copy), and the planner for unequal workers
/// (planner::Request::workers) choosing the schedule (gpipe or 1f1b, which this build compiles for
/// them), the microbatches and where stage 1 starts, among the splits compiled (stage_backend_cuts):
/// the slowest stage, on its own backend, as fast as can be. Prints the report and, beside it, the FLOP-balanced split's best
/// layout on the same stages; sets f's schedule, microbatches and split.
inline void plan_stage_backends(Flags& f, const io::Dataset& train_set) {
  const index_t rows = index_t(std::min<std::int64_t>(f.batch, train_set.count));
  CUPIPE_REQUIRE(rows >= 2, "--plan auto: the planner profiles a batch of at least 2 samples, got ", rows);
  planner::Request request;
  const planner::CostModel* gpu = nullptr;
  std::vector<planner::CostModel> models;
  for (const std::string& entry : stage_backend_entries(f.stage_backends)) {
#if CUPIPE_TRAINER_HAS_CUDA
    models.push_back(entry == "cuda" ? calibrate_cuda(f, train_set, rows) : calibrate_here(train_set, rows, entry == "host:bf16"));
#else
    models.push_back(calibrate_here(train_set, rows, entry == "host:bf16"));  // check_stage_backends refused cuda
#endif
    request.workers.push_back(planner::worker_speed(entry, models.back()));
    request.workers.back().own_device = entry == "cuda";  // a GPU stage takes no share of the cores
  }
  // Sizes, links, contention and the runtime's own costs: the first host stage's (one is, as
  // check_stage_backends pairs cuda with host only).
  for (std::size_t w = 0; w < models.size(); ++w) {
    if (request.workers[w].own_device) gpu = &models[w];
    else if (request.model.layers.empty()) request.model = models[w];
  }
  if (gpu != nullptr) {
    // A hand-over between the CPU stage and the GPU's is a copy between host and device memory.
    request.model.link_bytes_per_second = gpu->offload_bytes_per_second;
    request.model.link_latency = std::max(request.model.link_latency, gpu->link_latency);
  }
  request.devices = int(request.workers.size());
  request.batch = rows;
  request.schedules = {"gpipe", "1f1b"};
  request.one_process = true;
  request.cores = int(std::thread::hardware_concurrency());
  request.max_microbatches = int(std::min<index_t>(64, rows));
  request.cut_points.assign(stage_backend_cuts.begin(), stage_backend_cuts.end());
  const planner::Report report = plan(request);
  const planner::Layout best = report.best();
  std::printf("--plan auto on %zu stages of unequal speed (%s; host stages on one BLAS thread each, %u cores), predicted from a profile "
              "of each stage's backend on this machine:\n%s",
              request.workers.size(), f.stage_backends.c_str(), unsigned(request.cores),
              planner::describe(report, request.model).c_str());
  // The split equal workers would get, on the same stages.
  request.split = [](int stages) { return stages == 2 ? stage_cuts<partition<Model, 2>>() : std::vector<std::size_t>{}; };
  const planner::Layout balanced = plan(request).best();
  std::printf("the FLOP-balanced split (stage 1 from layer %zu) on these stages: %s, step %.2f ms predicted (%+.1f%% against "
              "the chosen split's %.2f ms, stage 1 from layer %zu)\n",
              balanced.cuts[1], balanced.describe().c_str(), balanced.step_seconds * 1e3,
              100 * (balanced.step_seconds / best.step_seconds - 1), best.step_seconds * 1e3, best.cuts[1]);
  f.schedule = best.schedule;
  f.stages = best.stages;
  f.microbatches = best.microbatches;
  f.split_at = int(best.cuts[1]);
  f.predicted_step_seconds = best.step_seconds;
}

/// --stage-backends: every entry known, one per stage, and a combination this build instantiates
/// (each is the whole training loop again), refused before any data loads.
inline void check_stage_backends(const Flags& f) {
  const std::vector<std::string> entries = stage_backend_entries(f.stage_backends);
  for (const std::string& e : entries)
    if (e != "host" && e != "host:bf16" && e != "cuda")
      CUPIPE_THROW("--stage-backends: '", e, "' is not a stage backend; each stage is host, host:bf16 or cuda");
  if (int(entries.size()) != f.stages)
    CUPIPE_THROW("--stage-backends names ", entries.size(), " backend(s) for --stages ", f.stages, "; give one per stage");
  if (entries.size() != 2)
    CUPIPE_THROW("--stage-backends: this build instantiates 2-stage pipelines only (each combination is the whole "
                 "training loop again); ", f.plan == "auto" ? "name 2 backends" : "use --stages 2");
  if (entries[0] == entries[1])
    CUPIPE_THROW("--stage-backends ", f.stage_backends, " gives every stage the same backend; say it with --backend "
                 "and --precision");
  if (f.schedule != "1f1b" && f.schedule != "gpipe")
    CUPIPE_THROW("--stage-backends trains with 1f1b or gpipe in this build, not ", f.schedule);
  if (f.post_validation > 0) CUPIPE_THROW("--stage-backends: the pipeline refuses --post-validation with a backend per stage");
  const bool cuda = entries[0] == "cuda" || entries[1] == "cuda";
  if (cuda && (entries[0] == "host:bf16" || entries[1] == "host:bf16"))
    CUPIPE_THROW("--stage-backends: this build pairs cuda with an fp32 host stage (host,cuda or cuda,host)");
  if (f.split_at != 0 &&
      std::find(stage_backend_cuts.begin(), stage_backend_cuts.end(), std::size_t(f.split_at)) == stage_backend_cuts.end())
    CUPIPE_THROW("--split-at ", f.split_at, ": stage 1 starts at layer 2 (after the first Linear and ReLU) or 4 (after the "
                 "second) in this build; the MLP's other splits are not compiled");
#if !CUPIPE_TRAINER_HAS_CUDA
  if (cuda) CUPIPE_THROW("--stage-backends ", f.stage_backends, ": this trainer was built without CUDA");
#endif
#if !CUPIPE_TRAINER_HAS_BF16
  if (!cuda)
    CUPIPE_THROW("--stage-backends ", f.stage_backends, ": host stages of two precisions are not in this build, which "
                 "was configured with -DCUPIPE_TRAINER_SCHEDULES=", cupipe::examples::trainer_setting);
#endif
}

int main(int argc, char** argv) {
  Flags f;
  CLI::App app{"Train a 784-1024-512-256-10 MLP on Fashion-MNIST with a pipeline schedule (cupipe, CPU)"};
  // A flag given twice takes its last value, so `scripts/run.sh --epochs 10` overrides the script's own.
  app.option_defaults()->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);
  app.add_option("--data", f.data, "folder with the Fashion-MNIST IDX files (gzip or plain)")->capture_default_str();
  app.add_option("--schedule", f.schedule, "one of: " + schedule::policy_names())->capture_default_str();
  app.add_option("--stages", f.stages, "pipeline stages (workers): 1 to 4 (two-chunk schedules: 1 to 3; on cuda 1, 2 or 4, two-chunk 1 or 2)")->capture_default_str();
  app.add_option("--microbatches", f.microbatches, "microbatches per batch")->capture_default_str()->check(positive);
  app.add_option("--batch", f.batch, "samples per batch")->capture_default_str()->check(positive);
  app.add_option("--epochs", f.epochs, "passes over the training set")->capture_default_str()->check(positive);
  app.add_option("--lr", f.lr, "peak learning rate (linear warm-up, cosine decay)")->capture_default_str()->check(positive);
  app.add_option("--optimizer", f.optimizer, "adamw or sgd (momentum 0.9)")->capture_default_str()->check(CLI::IsMember({"adamw", "sgd"}));
  app.add_option("--weight-decay", f.weight_decay, "decoupled weight decay (AdamW) or L2 (SGD)")->capture_default_str()->check(non_negative);
  app.add_option("--warmup-epochs", f.warmup_epochs, "epochs of linear learning-rate warm-up")->capture_default_str()->check(non_negative);
  app.add_option("--seed", f.seed, "initialisation and data-order seed")->capture_default_str();
  app.add_option("--save", f.save, "checkpoint prefix: writes PREFIX.safetensors and PREFIX.state.safetensors each epoch");
  app.add_option("--resume", f.resume, "checkpoint prefix to resume from");
  app.add_option("--trace", f.trace, "write a Chrome trace (measured vs simulated) of the last step here");
  app.add_flag("--timeline", f.timeline, "print the ASCII timeline of the last measured step");
  app.add_flag("--rebalance", f.rebalance, "profile every layer and propose a better split");
  app.add_option("--train-limit", f.train_limit, "use only the first N training samples (0: all)")->check(non_negative);
  app.add_option("--test-limit", f.test_limit, "use only the first N test samples (0: all)")->check(non_negative);
  app.add_option("--max-steps", f.max_steps, "stop (and save) after this many steps in total (0: no limit)")->check(non_negative);
  app.add_option("--backend", f.backend, "host (CPU); cuda needs a build with CUDA")->capture_default_str()->check(CLI::IsMember({"host", "cuda"}));
  app.add_option("--precision", f.precision,
                 "fp32, or bf16: weights in use, activations and messages in bfloat16, master weights, gradients, "
                 "optimizer state and the loss in fp32 (every schedule, on the host and on cuda)")
      ->capture_default_str()
      ->check(CLI::IsMember({"fp32", "bf16"}));
  CLI::Option* stage_backends =
      app.add_option("--stage-backends", f.stage_backends,
                     "each stage's backend and precision, one per stage: host, host:bf16 or cuda, e.g. host:bf16,host "
                     "(this build: 2 stages of gpipe or 1f1b; host with host:bf16, or host with cuda); each "
                     "hand-over converts between them");
  app.add_option("--devices", f.devices, "GPU of each stage, e.g. 0,0,1,1 (with --backend cuda)");
  CLI::Option* math = app.add_option("--math", f.math, "float GEMMs on CUDA: tf32 (tensor cores) or fp32 (exact)")
                          ->capture_default_str()
                          ->check(CLI::IsMember({"fp32", "tf32"}));
  app.add_option("--dp", f.dp, "data-parallel replicas; run under mpirun/srun with stages x dp processes")->capture_default_str()->check(positive);
  app.add_option("--timeout", f.timeout,
                 "seconds a stage waits for another (a transfer, or a sum over ranks) before failing; 0: no limit")
      ->capture_default_str()
      ->check(non_negative);
  auto* plan = app.add_option("--plan", f.plan,
                               "auto: profile the model here and let the planner choose --schedule, --stages and "
                               "--microbatches (host backend; under mpirun with --dp, the processes over --dp are the stages; with "
                               "--stage-backends, the schedule, microbatches and --split-at from each stage's measured speed)")
                   ->check(CLI::IsMember({"auto"}));
  app.add_option("--workers", f.workers, "with --plan auto: workers (cores) the plan may use; 0: the cores, at most 4")
      ->check(non_negative)
      ->needs(plan);
  for (const char* name : {"--schedule", "--stages", "--microbatches"}) plan->excludes(app.get_option(name));
  cupipe::examples::add_check_equivalence(app, f.check_equivalence);
  cupipe::examples::add_hand_over(app, f.hand_over);
  app.add_option("--post-validation", f.post_validation,
                 "run N steps at a time with optimizer post-validation: no flush between them, the global gradient "
                 "norm checked a step late and an update that should have clipped redone (flush schedules, one "
                 "process; the weights are bitwise those without it); 0: off")
      ->capture_default_str()
      ->check(non_negative);
  app.add_option("--progress", f.progress, "auto, bar, lines or none")->capture_default_str()->check(CLI::IsMember({"auto", "bar", "lines", "none"}));
  CLI::Option* split_at =
      app.add_option("--split-at", f.split_at,
                     "with --stage-backends: the layer where stage 1 starts, 2 (after the first Linear and ReLU, the "
                     "FLOP-balanced split) or 4 (after the second); --plan auto chooses it from each stage's measured speed")
          ->needs(stage_backends);
  split_at->excludes(plan);
  for (const char* name : {"--backend", "--precision", "--devices", "--dp", "--rebalance", "--workers"})
    stage_backends->excludes(app.get_option(name));
  CLI11_PARSE(app, argc, argv);

  Launcher launcher;  // outside the try: the catch ends every rank through it
  try {
    if (!f.devices.empty() && f.backend != "cuda") CUPIPE_THROW("--devices places stages on GPUs and needs --backend cuda");
    if (math->count() > 0 && f.backend != "cuda") CUPIPE_THROW("--math sets the GPU's GEMM arithmetic and needs --backend cuda");
#if !CUPIPE_TRAINER_HAS_CUDA
    if (f.backend == "cuda")
      CUPIPE_THROW("--backend cuda: this trainer was built without CUDA (configure where nvcc is found to build it)");
#endif
    // --plan auto: the stages are the processes over --dp under mpirun (the planner's, alone).
    const Launch& launch = launcher.start(argc, argv, "mlp_fashion_mnist", f.plan == "auto" ? 0 : f.stages, f.dp, f.timeout);
    // Ranks started with different flags fail here, at once, naming the flag (not after a timeout).
    if (launch.communicator) comm::require_same_settings(*launch.communicator, shared_settings(f));
    (void)schedule::find_policy(f.schedule);  // an unknown name fails before the data loads
    cupipe::examples::require_built_schedule(f.schedule);
#if !CUPIPE_TRAINER_HAS_BF16
    if (f.precision == "bf16" && f.backend == "host")
      CUPIPE_THROW("--precision bf16 on the host backend is not in this build, which was configured with "
                   "-DCUPIPE_TRAINER_SCHEDULES=", cupipe::examples::trainer_setting,
                   "; configure without it for bf16 training on the CPU");
#endif
    if (!f.stage_backends.empty()) {
      if (f.plan == "auto") f.stages = int(stage_backend_entries(f.stage_backends).size());  // the planner keeps them
      check_stage_backends(f);
    }
    // Outputs written at the end of a long run are checked now, so a bad folder fails in the first second.
    if (!f.save.empty()) {
      io::check_writable(io::model_file(f.save), "--save");
      io::check_writable(io::state_file(f.save), "--save");
    }
    if (!f.trace.empty()) io::check_writable(f.trace, "--trace");
    io::FashionMnist data = io::load_fashion_mnist(f.data);
    if (f.train_limit > 0) data.train = io::take(data.train, 0, std::min(f.train_limit, data.train.count));
    if (f.test_limit > 0) data.test = io::take(data.test, 0, std::min(f.test_limit, data.test.count));
    if (launch.communicator)
      comm::require_same_settings(*launch.communicator, {{"training data", data_fingerprint(data.train)},
                                                         {"test data", data_fingerprint(data.test)}});
    standardise(data.train, data.test);
    if (f.plan == "auto" && !f.stage_backends.empty()) {
      if (launch.communicator) CUPIPE_THROW("--plan auto with --stage-backends plans the stages of one process; run it without mpirun");
      plan_stage_backends(f, data.train);
    } else if (f.plan == "auto") {
      if (f.backend != "host") CUPIPE_THROW("--plan auto plans the host backend; leave out --backend cuda");
      plan_layout(f, data.train, launch.communicator.get());
    }
    if (f.backend == "cuda") {
      if (launch.communicator)
        CUPIPE_THROW("--backend cuda runs in one process, stages placed with --devices; across processes the trainer "
                     "uses the host backend");
#if CUPIPE_TRAINER_HAS_CUDA
      return train_cuda(f, data.train, data.test, launch);
#endif
    }
    // OpenBLAS's thread count is process-wide: with several workers in this process, one BLAS thread
    // each keeps them from oversubscribing the cores (11x slower on 2 cores otherwise).
    cupipe::examples::note_blas_kernels("mlp_fashion_mnist", launch);
    if (!launch.communicator && (f.stages > 1 || !f.plan.empty())) backend::Host<T>::set_blas_threads(1);
    if (!f.stage_backends.empty()) {
      if (f.stage_backends.find("cuda") != std::string::npos) {
#if CUPIPE_TRAINER_HAS_CUDA
        return train_mixed_cuda(f, data.train, data.test, launch);
#endif
      }
#if CUPIPE_TRAINER_HAS_BF16
      return train_mixed(f, data.train, data.test, launch);
#endif
    }
    // The training loop of --schedule's family, in fp32 or bf16: each is a unit of its own
    // (require_built_schedule let the schedule through).
    using cupipe::examples::ScheduleFamily;
#if CUPIPE_TRAINER_HAS_BF16
    if (f.precision == "bf16")
      return cupipe::examples::with_family(f.schedule, [&]<ScheduleFamily F>() { return train_family<F, HostBf16>(f, data.train, data.test, launch); });
#endif
    return cupipe::examples::with_family(f.schedule, [&]<ScheduleFamily F>() { return train_family<F>(f, data.train, data.test, launch); });
  } catch (const cupipe::error& e) {
    std::fprintf(stderr, "mlp_fashion_mnist: %s\n", e.what());  // with the failing call and where
    launcher.abort_job();
    return 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "mlp_fashion_mnist: %s\n", e.what());
    launcher.abort_job();
    return 1;
  }
}
