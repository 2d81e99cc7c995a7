// SPDX-License-Identifier: Apache-2.0
// Every schedule policy the library has, on the same Fashion-MNIST MLP job on the CPU (host backend):
// the same stages, microbatches, batch, data order and initialisation. Each schedule trains from the
// same start over --samples training samples; every step is one harness run (the first --warmup
// steps train untimed). Reported: the median step, samples/s and its ratio to 1F1B measured in the
// same run, the measured bubble, the training time of all steps and the test accuracy afterwards.
//   schedules [--data DIR] [--stages 2] [--microbatches 8] [--batch 128] [--samples 10000]
//             [--test-samples 2000] [--filter REGEX] [--json FILE] [--axis schedule=1f1b,zb-h1]
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <exception>
#include <numeric>
#include <string>
#include <string_view>
#include <vector>

#include "../harness/harness.hpp"
#include "cupipe/cupipe.hpp"

using namespace cupipe;
using bench::State;

namespace {

using T = float;
using Model = Sequential<Linear<784, 1024>, ReLU, Linear<1024, 512>, ReLU, Linear<512, 256>, ReLU, Linear<256, 10>>;
constexpr int model_layers = 7;

/// Calls f.template operator()<Schedule>(name) for every schedule policy of the library, in its
/// order. The only place in bench/ that knows where that list lives.
template <class F>
void for_each_schedule(F&& f) {
  schedule::for_each_policy([&]<class Schedule>() { f.template operator()<Schedule>(Schedule::name); });
}

struct Options {
  std::string data = io::fashion_mnist_default_dir;
  int stages = 2;
  int microbatches = 8;
  int batch = 128;
  std::int64_t samples = 10000;
  std::int64_t test_samples = 2000;
  std::uint64_t seed = 0;
};

Options parse(const std::vector<std::string>& args) {
  Options o;
  for (std::size_t i = 0; i < args.size(); ++i) {
    const std::string& arg = args[i];
    auto value = [&]() -> std::string {
      CUPIPE_REQUIRE(i + 1 < args.size(), "schedules: ", arg, " needs a value");
      return args[++i];
    };
    if (arg == "--data") o.data = value();
    else if (arg == "--stages") o.stages = std::stoi(value());
    else if (arg == "--microbatches") o.microbatches = std::stoi(value());
    else if (arg == "--batch") o.batch = std::stoi(value());
    else if (arg == "--samples") o.samples = std::stoll(value());
    else if (arg == "--test-samples") o.test_samples = std::stoll(value());
    else if (arg == "--seed") o.seed = std::stoull(value());
    else
      CUPIPE_THROW("schedules: unknown argument '", arg,
                   "'; use --data DIR --stages 2|3|4 --microbatches N --batch N --samples N --test-samples N --seed N, "
                   "and ", bench::harness_usage);
  }
  CUPIPE_REQUIRE(o.microbatches >= 1 && o.batch >= o.microbatches, "schedules: --batch ", o.batch,
                 " must be at least --microbatches ", o.microbatches);
  CUPIPE_REQUIRE(o.samples >= o.batch, "schedules: --samples ", o.samples, " must be at least one batch (", o.batch, ")");
  return o;
}

/// The data every schedule trains on, in one shuffled order, standardised with the training set's
/// mean and standard deviation (as the Fashion-MNIST example does).
struct Job {
  io::Dataset train, test;
  std::vector<std::int64_t> order;

  explicit Job(const Options& o) {
    io::FashionMnist data = io::load_fashion_mnist(o.data);
    train = io::take(data.train, 0, std::min(o.samples, data.train.count));
    test = io::take(data.test, 0, std::min(o.test_samples, data.test.count));
    double sum = 0, sq = 0;
    for (float v : train.images) sum += v, sq += double(v) * v;
    const double n = double(train.images.size());
    const double mean = sum / n, stddev = std::sqrt(std::max(sq / n - mean * mean, 1e-12));
    for (io::Dataset* d : {&train, &test})
      for (float& v : d->images) v = float((v - mean) / stddev);
    order.resize(std::size_t(train.count));
    std::iota(order.begin(), order.end(), 0);
    Rng rng(o.seed);
    for (std::int64_t i = train.count - 1; i > 0; --i) std::swap(order[std::size_t(i)], order[rng.below(std::uint64_t(i + 1))]);
  }
};

template <class Pipe>
double test_accuracy(Pipe& pipe, const io::Dataset& test) {
  constexpr index_t chunk = 1000;
  std::vector<T> logits;
  std::int64_t correct = 0;
  for (index_t first = 0; first < test.count; first += chunk) {
    const index_t rows = std::min(chunk, test.count - first);
    logits.resize(std::size_t(rows * 10));
    pipe.predict(ConstView<T>{test.images.data() + first * 784, Shape{rows, 784}}, TensorView<T>{logits.data(), Shape{rows, 10}});
    for (index_t r = 0; r < rows; ++r) {
      const T* row = logits.data() + r * 10;
      correct += std::max_element(row, row + 10) - row == test.labels[std::size_t(first + r)];
    }
  }
  return double(correct) / double(test.count);
}

/// Trains one schedule from the seeded start; each step is one harness run.
template <class Schedule, int P>
void train(State& state, const Options& o, const Job& job) {
  using Pipe = Pipeline<partition_for<Model, P, Schedule>, Schedule, backend::Host<T>>;
  Pipe pipe({.microbatches = o.microbatches, .seed = o.seed});
  const bench::Runs runs = state.runs();
  const std::int64_t steps = runs.warmup + runs.repeats;
  optim::AdamW optimizer({.lr = 1e-3, .weight_decay = 1e-4});
  optimizer.options.schedule = {steps / 10, steps, 0.0};  // linear warm-up, cosine decay over the run

  std::vector<T> x(std::size_t(o.batch) * 784);
  std::vector<std::int32_t> y(std::size_t(o.batch));
  std::int64_t next = 0;  // position in the shuffled order; wraps if the run has more steps than data
  std::vector<double> bubbles;
  const auto start = std::chrono::steady_clock::now();
  bench::HostTimer timer;
  const bench::Timing& t = state.exec(timer, [&] {
    for (int r = 0; r < o.batch; ++r, next = (next + 1) % job.train.count) {
      const std::int64_t i = job.order[std::size_t(next)];
      std::copy_n(job.train.images.data() + i * 784, 784, x.data() + r * 784);
      y[std::size_t(r)] = job.train.labels[std::size_t(i)];
    }
    const StepStats stats =
        pipe.train_step(ConstView<T>{x.data(), Shape{o.batch, 784}}, ConstView<std::int32_t>{y.data(), Shape{o.batch}}, optimizer);
    bubbles.push_back(stats.bubble_fraction);
  });
  const double train_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  const std::vector<double> timed_bubbles(bubbles.begin() + runs.warmup, bubbles.end());

  state.summary("chunks_per_stage", "chunks", double(Schedule::chunks), 0);
  state.summary("samples_per_second", "samples/s", double(o.batch) / t.median, 0);
  state.summary("bubble_measured", "bubble measured",
                std::accumulate(timed_bubbles.begin(), timed_bubbles.end(), 0.0) / double(timed_bubbles.size()), 3);
  state.summary("train_seconds", "train s (all steps)", train_seconds, 2);
  state.summary("test_accuracy", "test accuracy", test_accuracy(pipe, job.test), 4);
}

/// Ratios to 1F1B, from the states measured in this run; none when 1F1B was not among them.
void ratio_to_1f1b(std::vector<State>& states) {
  const auto base = std::find_if(states.begin(), states.end(), [](const State& s) {
    return s.text("schedule") == schedule::OneFOneB::name && s.skipped().empty();
  });
  if (base == states.end()) return;
  const double base_samples_per_second = std::get<double>(base->find("samples_per_second")->value);
  for (State& s : states)
    if (const bench::Summary* sps = s.find("samples_per_second"))
      s.summary("ratio_to_1f1b", "vs 1F1B", std::get<double>(sps->value) / base_samples_per_second, 2);
}

int run(int argc, char** argv) {
  bench::Harness harness("schedules: every policy on the Fashion-MNIST MLP (host backend, CPU)");
  const Options o = parse(harness.parse(argc, argv));
  const Job job(o);
  const std::int64_t steps = (job.train.count + o.batch - 1) / o.batch;
  harness.context() = {{"backend", "host"},
                       {"model", "784-1024-512-256-10 MLP"},
                       {"stages", o.stages},
                       {"microbatches", o.microbatches},
                       {"batch", o.batch},
                       {"train_samples", job.train.count},
                       {"test_samples", job.test.count},
                       {"optimizer", "AdamW lr 1e-3, weight decay 1e-4, warm-up 10% then cosine"},
                       {"seed", o.seed}};

  std::vector<std::string> names;
  for_each_schedule([&]<class Schedule>(std::string_view name) { names.emplace_back(name); });

  const int warmup = int(std::min<std::int64_t>(2, steps - 1));
  harness
      .add("schedules",
           [&](State& state) {
             for_each_schedule([&]<class Schedule>(std::string_view name) {
               if (name != state.text("schedule")) return;
               with_stage_count<2, 3, 4>(o.stages, [&]<int P>() {
                 if constexpr (P * Schedule::chunks > model_layers)
                   state.skip(std::to_string(P * Schedule::chunks) + " model chunks needed, the MLP has 7 layers");
                 else
                   train<Schedule, P>(state, o, job);
               });
             });
           })
      .axis("schedule", names)
      .runs(warmup, int(steps) - warmup)
      .finish(ratio_to_1f1b)
      .note("p = " + std::to_string(o.stages) + " stages, m = " + std::to_string(o.microbatches) + " microbatches, batch " +
            std::to_string(o.batch) + ", " + std::to_string(job.train.count) +
            " training samples (one step per run; the warm-up steps train too), AdamW. samples/s: batch / median "
            "step; vs 1F1B: in this run. Bubble: mean of the timed steps' measured StepStats::bubble_fraction. Test "
            "accuracy on " + std::to_string(job.test.count) + " test samples after the run.");
  harness.run();
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    cupipe::backend::Host<float>::set_blas_threads(1);  // p workers share the cores (process-wide setting)
    return run(argc, argv);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "schedules: %s\n", e.what());
    return 1;
  }
}
