// SPDX-License-Identifier: Apache-2.0
// The Fashion-MNIST trainer's training loop: one template over the schedule, the stage count, the
// backend and the optimizer, instantiated by family of schedules and backend in train_*.cpp (host)
// and trainer_cuda.cu / trainer_cuda_other.cu (CUDA), which main.cpp calls.
#pragma once

#include <unistd.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <memory>
#include <nlohmann/json.hpp>
#include <numeric>
#include <span>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "cupipe/comm/agreement.hpp"
#include "cupipe/cupipe.hpp"
#include "cupipe/pipeline/rebalance.hpp"
#include "cupipe/planner/cost_model.hpp"
#include "launch.hpp"
#include "step_times.hpp"
#include "trainer_schedules.hpp"

namespace fmnist {

using namespace cupipe;

using T = float;
using Model = Sequential<Linear<784, 1024>, ReLU, Linear<1024, 512>, ReLU, Linear<512, 256>, ReLU, Linear<256, 10>>;

struct Flags {
  std::string data = "/usr/share/datasets/fashion-mnist";
  std::string schedule = "1f1b";
  int stages = 4;
  int microbatches = 8;
  int batch = 128;
  int epochs = 10;
  double lr = 1e-3;
  std::string optimizer = "adamw";
  double weight_decay = 1e-4;
  double warmup_epochs = 0.5;
  std::uint64_t seed = 0;
  std::string save;
  std::string resume;
  std::string trace;
  bool timeline = false;
  bool rebalance = false;
  std::int64_t train_limit = 0;
  std::int64_t test_limit = 0;
  std::int64_t max_steps = 0;
  std::string progress = "auto";
  std::string backend = "host";
  std::string precision = "fp32";     ///< "bf16": bf16 storage, fp32 master weights (host backend)
  std::string stage_backends;         ///< "host:bf16,host": each stage's backend and precision (empty: all alike)
  std::string devices;
  std::string math = "tf32";          ///< float GEMMs on CUDA: "tf32" (tensor cores) or "fp32" (exact)
  int dp = 1;
  double timeout = comm::Communicator::default_collective_timeout_seconds;
  std::string plan;                   ///< "auto": the planner chooses the schedule, stages and microbatches
  int workers = 0;                    ///< devices the planner may use with --plan auto; 0: the cores, at most 4
  int post_validation = 0;            ///< steps per Pipeline::train_steps call with post-validation; 0: off
  int check_equivalence = 0;          ///< the first N steps also run unpipelined and must agree; 0: off
  std::string hand_over = "full";     ///< --hand-over: full, bf16 or e4m3, for every link or one per link
  int split_at = 0;                   ///< --split-at: with --stage-backends, the layer stage 1 starts at; 0: the partition's
  double predicted_step_seconds = 0;  ///< the planned layout's, set by plan_layout
};

/// The layers where --stage-backends' stage 1 may start, each a split this build compiles (each is
/// the whole training loop again): 2, after the first Linear and ReLU (the FLOP-balanced
/// partition's), or 4, after the second. --plan auto chooses among them for unequal stages.
inline constexpr std::array<std::size_t, 2> stage_backend_cuts{2, 4};

/// The flags every rank of a multi-process run must share (display flags and the data folder, which
/// may be mounted elsewhere on another node, are left out; the data itself is compared after loading).
inline comm::Settings shared_settings(const Flags& f) {
  const auto real = examples::exact_text;
  return {{"--schedule", f.schedule},          {"--stages", std::to_string(f.stages)},
          {"--dp", std::to_string(f.dp)},      {"--microbatches", std::to_string(f.microbatches)},
          {"--batch", std::to_string(f.batch)}, {"--epochs", std::to_string(f.epochs)},
          {"--lr", real(f.lr)},                {"--optimizer", f.optimizer},
          {"--weight-decay", real(f.weight_decay)}, {"--warmup-epochs", real(f.warmup_epochs)},
          {"--seed", std::to_string(f.seed)},  {"--train-limit", std::to_string(f.train_limit)},
          {"--test-limit", std::to_string(f.test_limit)}, {"--max-steps", std::to_string(f.max_steps)},
          {"--backend", f.backend},            {"--precision", f.precision}, {"--stage-backends", f.stage_backends}, {"--save", f.save},
          {"--resume", f.resume},              {"--split-at", std::to_string(f.split_at)}};
}

/// FNV-1a over a dataset's sizes, labels and pixels: equal on every rank that loaded the same data.
inline std::string data_fingerprint(const io::Dataset& d) {
  Fnv1a hash;
  hash.add(&d.count, sizeof d.count);
  hash.add(d.labels.data(), d.labels.size() * sizeof(std::int32_t));
  hash.add(d.images.data(), d.images.size() * sizeof(float));
  char text[40];
  std::snprintf(text, sizeof text, "%lld samples, hash %016llx", (long long)d.count, (unsigned long long)hash.value());
  return text;
}

using examples::Launch;
using examples::parse_devices;

/// Standardises images with the training set's mean and standard deviation.
inline void standardise(io::Dataset& train, io::Dataset& test) {
  double sum = 0, sq = 0;
  for (float v : train.images) {
    sum += v;
    sq += double(v) * v;
  }
  const double n = double(train.images.size());
  const double mean = sum / n, stddev = std::sqrt(std::max(sq / n - mean * mean, 1e-12));
  for (io::Dataset* d : {&train, &test})
    for (float& v : d->images) v = float((v - mean) / stddev);
}

class Progress {
 public:
  Progress(std::string mode, std::int64_t total) : total_(total) {
    bar_ = mode == "bar" || (mode == "auto" && isatty(STDOUT_FILENO));
    quiet_ = mode == "none";
  }
  void update(int epoch, std::int64_t done, double loss, double samples_per_second) {
    if (quiet_) return;
    const double fraction = total_ ? double(done) / double(total_) : 1.0;
    if (bar_) {
      const int width = 30, filled = int(fraction * width);
      std::printf("\repoch %d [%s%s] %5.1f%%  loss %.4f  %.0f samples/s ", epoch, std::string(std::size_t(filled), '#').c_str(),
                  std::string(std::size_t(width - filled), '.').c_str(), 100 * fraction, loss, samples_per_second);
      std::fflush(stdout);
    } else if (int(fraction * 10) > last_decile_ || done == total_) {
      last_decile_ = int(fraction * 10);
      std::printf("epoch %d: %5.1f%% of %lld samples, loss %.4f, %.0f samples/s\n", epoch, 100 * fraction,
                  (long long)total_, loss, samples_per_second);
      std::fflush(stdout);
    }
  }
  void end_epoch() {
    if (bar_) std::printf("\n");
    last_decile_ = -1;
  }

 private:
  std::int64_t total_;
  bool bar_ = false;
  bool quiet_ = false;
  int last_decile_ = -1;
};

/// Images (float) into the storage precision S of a backend: a copy for float, else each value
/// rounded to nearest (bf16).
template <class S>
void to_storage(const T* from, std::size_t count, S* to) {
  if constexpr (std::is_same_v<S, T>) std::copy_n(from, count, to);
  else
    for (std::size_t i = 0; i < count; ++i) to[i] = S(from[i]);
}

template <class Pipe>
double accuracy(Pipe& pipe, const io::Dataset& data) {
  using S = typename Pipe::input_type;  // the first stage's storage precision
  using L = typename Pipe::T;           // the last stage's: the logits
  constexpr index_t chunk = 1000;
  std::vector<L> logits;
  std::vector<S> images;
  std::int64_t correct = 0;
  for (index_t first = 0; first < data.count; first += chunk) {
    const index_t rows = std::min(chunk, data.count - first);
    logits.resize(std::size_t(rows * 10));
    images.resize(std::size_t(rows * 784));
    to_storage(data.images.data() + first * 784, images.size(), images.data());
    pipe.predict(ConstView<S>{images.data(), Shape{rows, 784}}, TensorView<L>{logits.data(), Shape{rows, 10}});
    for (index_t r = 0; r < rows; ++r) {
      const L* row = logits.data() + r * 10;
      const auto less = [](const L& a, const L& b) { return float(a) < float(b); };
      correct += std::max_element(row, row + 10, less) - row == data.labels[std::size_t(first + r)];
    }
  }
  return double(correct) / double(data.count);
}

/// What a run measured, for the lines that close it: the same for every schedule, stage count,
/// precision and optimizer.
struct RunTotals {
  double test_accuracy = 0, last_loss = 0, seconds = 0, bubble_sum = 0;
  std::int64_t samples = 0, steps = 0, rollbacks = 0;
  std::vector<double> step_seconds;  ///< wall time of every full-batch train_step
  std::string precision;             ///< --precision, or --stage-backends' list
};

/// Prints (first rank only) the planned layout's step against the measured median and the JSON
/// summary. Not a template: compiled once, not once per instantiation of train.
inline void report_run(const Flags& f, const Launch& launch, RunTotals run) {
  if (!launch.leader()) return;
  const double median_step = examples::median_step_seconds(run.step_seconds);
  if (f.predicted_step_seconds > 0 && median_step > 0)
    std::printf("planned layout: step %.2f ms predicted, %.2f ms measured (median of %zu full batches), %+.1f%%\n",
                f.predicted_step_seconds * 1e3, median_step * 1e3, run.step_seconds.size(),
                100 * (f.predicted_step_seconds / median_step - 1));
  nlohmann::json summary = {{"test_accuracy", run.test_accuracy},
                            {"train_loss", run.last_loss},
                            {"epochs", f.epochs},
                            {"seconds", run.seconds},
                            {"samples_per_second", run.seconds > 0 ? double(run.samples) / run.seconds : 0.0},
                            {"bubble_fraction_measured", run.steps ? run.bubble_sum / double(run.steps) : 0.0},
                            {"schedule", f.schedule},
                            {"stages", f.stages},
                            {"microbatches", f.microbatches},
                            {"data_parallel", launch.replicas},
                            {"precision", run.precision},
                            {"step_seconds_measured", median_step}};
  if (f.post_validation > 0) summary["post_validation_rollbacks"] = run.rollbacks;
  if (!f.stage_backends.empty()) summary["split_at"] = f.split_at > 0 ? std::size_t(f.split_at) : stage_backend_cuts[0];
  if (f.predicted_step_seconds > 0) summary["step_seconds_predicted"] = f.predicted_step_seconds;
  std::printf("%s\n", summary.dump().c_str());
}

/// The training loop of one layout: `Stages` is the model's split (by default the FLOP-balanced one
/// for P workers of Schedule).
template <class Schedule, int P, class Backend, class Optimizer, class Stages = partition_for<Model, P, Schedule>>
int train(const Flags& f, io::Dataset& train_set, const io::Dataset& test_set, Optimizer optimizer, const Launch& launch) {
  using Pipe = Pipeline<Stages, Schedule, Backend>;
  using S = typename Pipe::input_type;  // inputs in the first stage's storage precision
  Pipe pipe({.microbatches = f.microbatches, .seed = f.seed, .devices = parse_devices(f.devices),
             .transfer_timeout_seconds = f.timeout, .communicator = launch.communicator,
             .post_validation = f.post_validation > 0, .check_equivalence = f.check_equivalence,
             .hand_over = parse_wires(f.hand_over)});
  // Only the first rank talks; every rank computes.
  auto say = [&](const char* format, auto... args) {
    if (launch.leader()) std::printf(format, args...);
  };

  const std::int64_t n = train_set.count;
  const std::int64_t batches_per_epoch = (n + f.batch - 1) / f.batch;
  optimizer.options.schedule = {std::int64_t(f.warmup_epochs * double(batches_per_epoch)),
                                std::int64_t(f.epochs) * batches_per_epoch, 0.0};

  say("cupipe %s: %s, %d stages x %d chunk(s), %d microbatches, batch %d, %s lr %g, backend %s, precision %s\n",
      version_string, std::string(Schedule::name).c_str(), P, Schedule::chunks, f.microbatches, f.batch,
      std::string(Optimizer::name).c_str(), f.lr, Pipe::mixed ? "per stage" : f.backend.c_str(),
      Pipe::mixed ? ("per stage: " + f.stage_backends).c_str()
      : std::is_same_v<S, T> ? "fp32" : "bf16 (fp32 master weights, gradients and optimizer state)");
  if (launch.communicator) say("%s\n", launch.communicator->topology().describe().c_str());
  for (int k = 0; k < int(Stages::size); ++k) say("  stage %d: %s\n", k, stage_description<Stages>(k).c_str());

  io::TrainingState state;
  Rng data_rng(f.seed);
  state.rng = data_rng.state();
  if (!f.resume.empty()) {
    state = io::load_checkpoint(f.resume, pipe, optimizer);
    if (state.batch > batches_per_epoch)
      CUPIPE_THROW("--resume ", f.resume, ": the checkpoint is after batch ", state.batch, " of its epoch, but this run's epochs have ",
                   batches_per_epoch, " batches (was it saved with another --batch or --train-limit?)");
    if (state.epoch > f.epochs)
      CUPIPE_THROW("--resume ", f.resume, ": the checkpoint has finished ", state.epoch, " epochs, more than --epochs ", f.epochs);
    say("resumed from %s: epoch %lld, batch %lld, %lld updates\n", f.resume.c_str(), (long long)state.epoch,
        (long long)state.batch, (long long)state.updates);
  }

  std::vector<std::int64_t> order(static_cast<std::size_t>(n));
  // With --post-validation N, N batches go to one train_steps call, which overlaps their steps.
  const std::int64_t window = std::max(1, f.post_validation);
  std::vector<std::vector<S>> xs(std::size_t(window), std::vector<S>(std::size_t(f.batch) * 784));
  std::vector<std::vector<std::int32_t>> ys(std::size_t(window), std::vector<std::int32_t>(std::size_t(f.batch)));
  std::vector<typename Pipe::Batch> group;
  std::vector<std::int64_t> group_rows;
  std::int64_t rollbacks = 0;
  StepStats last;
  std::vector<double> step_seconds;  // wall time of every train_step
  double bubble_sum = 0, last_loss = 0, test_accuracy = 0;
  std::int64_t steps = 0, samples = 0, total_steps = state.epoch * batches_per_epoch + state.batch;
  const auto start = std::chrono::steady_clock::now();

  for (std::int64_t epoch = state.epoch; epoch < f.epochs; ++epoch) {
    // The epoch's order comes from the generator state saved at the epoch's start, so a resumed
    // run replays the same permutation and skips the batches already done.
    data_rng.set_state(state.rng);
    std::iota(order.begin(), order.end(), 0);
    for (std::int64_t i = n - 1; i > 0; --i) std::swap(order[std::size_t(i)], order[data_rng.below(std::uint64_t(i + 1))]);
    Progress progress(launch.leader() ? f.progress : "none", n);
    double epoch_loss = 0;
    std::int64_t epoch_samples = 0;
    const auto epoch_start = std::chrono::steady_clock::now();
    for (std::int64_t b = state.batch; b < batches_per_epoch;) {
      // The next group of batches: one, or up to --post-validation of them, within the epoch and --max-steps.
      std::int64_t count = std::min(window, batches_per_epoch - b);
      if (f.max_steps) count = std::min(count, f.max_steps - total_steps);
      group.clear();
      group_rows.clear();
      for (std::int64_t k = 0; k < count; ++k) {
        const std::int64_t first = (b + k) * f.batch, rows = std::min<std::int64_t>(f.batch, n - first);
        // Each data-parallel replica trains on its share of the batch; losses and gradients are
        // normalised by the whole batch, so the replicas together take exactly one batch's step.
        const std::int64_t share_first = rows * launch.replica / launch.replicas;
        const std::int64_t share_rows = rows * (launch.replica + 1) / launch.replicas - share_first;
        std::vector<S>& x = xs[std::size_t(k)];
        std::vector<std::int32_t>& y = ys[std::size_t(k)];
        for (std::int64_t r = 0; r < share_rows; ++r) {
          const std::int64_t i = order[std::size_t(first + share_first + r)];
          to_storage(train_set.images.data() + i * 784, 784, x.data() + r * 784);
          y[std::size_t(r)] = train_set.labels[std::size_t(i)];
        }
        group.push_back({ConstView<S>{x.data(), Shape{share_rows, 784}}, ConstView<std::int32_t>{y.data(), Shape{share_rows}}});
        group_rows.push_back(rows);
      }
      const auto step_start = std::chrono::steady_clock::now();
      std::vector<StepStats> results;
      if (count == 1) results.push_back(pipe.train_step(group[0].x, group[0].labels, optimizer));
      else results = pipe.train_steps(std::span<const typename Pipe::Batch>(group), optimizer);
      // Overlapped steps have no boundaries of their own: each gets the group's mean.
      const double each_seconds =
          std::chrono::duration<double>(std::chrono::steady_clock::now() - step_start).count() / double(count);
      for (std::int64_t k = 0; k < count; ++k) {
        last = results[std::size_t(k)];
        const std::int64_t rows = group_rows[std::size_t(k)];
        if (rows == f.batch)  // the epoch's last, shorter batch would pull the median down
          step_seconds.push_back(each_seconds);
        rollbacks += last.rolled_back ? 1 : 0;
        epoch_loss += last.loss * double(rows);
        epoch_samples += rows;
        samples += rows;
        bubble_sum += last.bubble_fraction;
        ++steps;
        ++total_steps;
      }
      b += count;
      const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - epoch_start).count();
      progress.update(int(epoch), std::min(n, b * f.batch), epoch_loss / double(epoch_samples), double(epoch_samples) / seconds);
      if (f.max_steps && total_steps >= f.max_steps) {
        state.batch = b;
        state.epoch = epoch;
        state.updates = pipe.updates();
        state.extra = {{"schedule", std::string(Schedule::name)}, {"stages", std::to_string(P)}};
        if (!f.save.empty()) io::save_checkpoint(f.save, pipe, optimizer, state);
        say("stopped after %lld steps (--max-steps)\n", (long long)total_steps);
        epoch = f.epochs;  // leave both loops
        break;
      }
    }
    if (epoch >= f.epochs) {
      last_loss = epoch_samples ? epoch_loss / double(epoch_samples) : 0;
      break;
    }
    progress.end_epoch();
    last_loss = epoch_samples ? epoch_loss / double(epoch_samples) : 0;
    test_accuracy = accuracy(pipe, test_set);
    say("epoch %lld: train loss %.4f, test accuracy %.4f\n", (long long)epoch, last_loss, test_accuracy);
    state.epoch = epoch + 1;
    state.batch = 0;
    state.rng = data_rng.state();
    state.updates = pipe.updates();
    state.extra = {{"schedule", std::string(Schedule::name)}, {"stages", std::to_string(P)}};
    if (!f.save.empty()) {
      io::save_checkpoint(f.save, pipe, optimizer, state);
      say("saved %s and %s\n", io::model_file(f.save).c_str(), io::state_file(f.save).c_str());
    }
  }
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  if (test_accuracy == 0) test_accuracy = accuracy(pipe, test_set);

  if (f.timeline && steps && launch.leader()) std::printf("measured timeline of the last step (seconds):\n%s", measured_ascii_timeline(last, P).c_str());
  if (!f.trace.empty() && steps && launch.leader()) {
    io::write_file_atomically(f.trace, measured_trace_json(pipe.plan(), last));
    std::printf("wrote %s (open it in https://ui.perfetto.dev or chrome://tracing): the last step, measured and "
                "simulated side by side\n", f.trace.c_str());
  }
  if constexpr (Pipe::mixed) {
    if (f.rebalance) CUPIPE_THROW("--rebalance profiles one backend; it is refused with --stage-backends");
  } else if (f.rebalance && launch.leader()) {
    // One microbatch of real images, timed on a fresh context of the same backend (device 0 for CUDA).
    const index_t rows = std::max<index_t>(1, std::min<std::int64_t>(n, f.batch) / f.microbatches);
    std::vector<S> images(std::size_t(rows * 784));
    to_storage(train_set.images.data(), images.size(), images.data());
    const auto profile = profile_layers<typename Model::body, Backend>(ConstView<S>{images.data(), Shape{rows, 784}}, 3);
    std::printf("%s", describe(rebalance(pipe.plan(), profile, stage_cuts<Stages>())).c_str());
  }

  report_run(f, launch, {.test_accuracy = test_accuracy, .last_loss = last_loss, .seconds = seconds,
                          .bubble_sum = bubble_sum, .samples = samples, .steps = steps, .rollbacks = rollbacks,
                          .step_seconds = std::move(step_seconds),
                          .precision = Pipe::mixed ? f.stage_backends : f.precision});
  return 0;
}


/// Calls run(optimizer) with the optimizer the flags ask for.
template <class Run>
int with_optimizer(const Flags& f, Run&& run) {
  if (f.optimizer == "sgd") return run(optim::SGD({.lr = f.lr, .momentum = 0.9, .weight_decay = f.weight_decay}));
  return run(optim::AdamW({.lr = f.lr, .weight_decay = f.weight_decay}));
}

/// Calls run.template operator()<P>() for the stage count `stages` among those `Backend`'s loops
/// compile: 1 to 4 on the host; 1, 2 and 4 on a GPU, where nvcc compiles each instantiation per
/// architecture.
template <class Backend, class Run>
void with_built_stage_count(int stages, Run&& run) {
  if constexpr (std::is_same_v<typename Backend::space, HostSpace>) with_stage_count<1, 2, 3, 4>(stages, run);
  else with_stage_count<1, 2, 4>(stages, run);
}

/// Trains on `Backend` (backend::Host<float>; Host<bfloat16, float> for --precision bf16;
/// backend::Cuda<float> or Cuda<bfloat16, float> with --backend cuda) with a --schedule of family F.
/// Each family, precision and backend is instantiated outside main.cpp (train_flush.cpp and
/// train_other.cpp; train_bf16.cpp and train_bf16_other.cpp for bf16; trainer_cuda.cu and
/// trainer_cuda_other.cu on CUDA), so that they compile side by side; main.cpp calls the one of
/// --schedule's family.
template <examples::ScheduleFamily F, class Backend = backend::Host<T>>
int train_family(const Flags& f, io::Dataset& train_set, const io::Dataset& test_set, const Launch& launch) {
  int rc = 1;
  schedule::with_policy(f.schedule, [&]<class Schedule>() {
    if constexpr (examples::family_of<Schedule> == F && examples::trainer_builds<Schedule>) {
      with_built_stage_count<Backend>(f.stages, [&]<int P>() {
        if constexpr (P * Schedule::chunks > 7) {
          CUPIPE_THROW("--schedule ", f.schedule, " with ", P, " stages needs ", P * Schedule::chunks,
                       " model chunks but the MLP has 7 layers; use at most 3 stages (2 on CUDA)");
        } else {
          rc = with_optimizer(f, [&](auto optimizer) {
            return train<Schedule, P, Backend>(f, train_set, test_set, optimizer, launch);
          });
        }
      });
    }
  });
  return rc;
}
/// backend::Host<bfloat16, float>: --precision bf16 on the host.
using HostBf16 = backend::Host<cupipe::bfloat16, float>;  // in full: OpenBLAS declares a ::bfloat16 too
// Each family x precision is compiled in one unit (train_*.cpp), not in main.cpp.
#define CUPIPE_MLP_TRAIN_FAMILY(B) \
  extern template int train_family<examples::ScheduleFamily::flush, B>(const Flags&, io::Dataset&, const io::Dataset&, const Launch&); \
  extern template int train_family<examples::ScheduleFamily::chunked, B>(const Flags&, io::Dataset&, const io::Dataset&, const Launch&); \
  extern template int train_family<examples::ScheduleFamily::asynchronous, B>(const Flags&, io::Dataset&, const io::Dataset&, const Launch&);
CUPIPE_MLP_TRAIN_FAMILY(backend::Host<T>)
CUPIPE_MLP_TRAIN_FAMILY(HostBf16)
#undef CUPIPE_MLP_TRAIN_FAMILY

/// --stage-backends for two stages: `A` then `B`, or `B` then `A` when `b_first`, under gpipe or 1f1b
/// (main.cpp's check_stage_backends lets no other schedule through), stage 1 starting at layer `Cut`
/// (one of stage_backend_cuts).
template <class A, class B, std::size_t Cut = stage_backend_cuts[0]>
int train_two_backends(const Flags& f, io::Dataset& train_set, const io::Dataset& test_set, const Launch& launch,
                       bool b_first) {
  using Stages = partition_at<Model, Cut>;
  const auto run = [&]<class Schedule>() {
    return with_optimizer(f, [&]<class Optimizer>(Optimizer optimizer) {
      if (b_first) return train<Schedule, 2, backend::PerWorker<B, A>, Optimizer, Stages>(f, train_set, test_set, optimizer, launch);
      return train<Schedule, 2, backend::PerWorker<A, B>, Optimizer, Stages>(f, train_set, test_set, optimizer, launch);
    });
  };
  return f.schedule == "gpipe" ? run.template operator()<schedule::GPipe>() : run.template operator()<schedule::OneFOneB>();
}

/// --stage-backends with host stages of different precisions (defined in train_bf16.cpp), split at
/// f.split_at; stage 1 from layer 4 is defined in train_bf16_split.cpp, which compiles beside it.
int train_mixed(const Flags& f, io::Dataset& train_set, const io::Dataset& test_set, const Launch& launch);
int train_mixed_from_layer_4(const Flags& f, io::Dataset& train_set, const io::Dataset& test_set, const Launch& launch);
/// --stage-backends with a host and a CUDA stage, split at f.split_at (defined in trainer_cuda.cu).
int train_mixed_cuda(const Flags& f, io::Dataset& train_set, const io::Dataset& test_set, const Launch& launch);
/// The planner's cost model of the MLP measured on backend::Cuda<float> (the current GPU) on the first
/// `rows` samples of `train_set` in f.math's arithmetic, as main.cpp's calibrate_here measures a host
/// stage (defined in trainer_cuda.cu).
planner::CostModel calibrate_cuda(const Flags& f, const io::Dataset& train_set, index_t rows);

/// Trains on the CUDA backend, every schedule in fp32 and bf16 (defined in trainer_cuda.cu; only in
/// builds with CUDA).
int train_cuda(const Flags& f, io::Dataset& train_set, const io::Dataset& test_set,
               const Launch& launch);

}  // namespace fmnist
