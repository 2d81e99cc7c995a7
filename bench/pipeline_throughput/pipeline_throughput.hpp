// SPDX-License-Identifier: Apache-2.0
// Pipeline throughput benchmark, shared by the host build (main_host.cpp) and the CUDA build
// (main_cuda.cu): the same models, schedules and report on any backend, through bench/harness.
//
// Benchmarks (each a table; --filter picks them by name):
// - network: the unpipelined Network, forward+backward of one batch; its samples/s is every ratio's
//   denominator, measured in the same run;
// - 1f1b: 1F1B with P stages and m microbatches of the same batch: samples/s and the ratio to the
//   Network's; the measured bubble (StepStats) next to the simulator's for the same plan with the
//   step's measured mean F/B costs (labelled "simulated"); peak memory per stage (weights +
//   activations, from the stage's allocator) next to a prediction: parameter bytes + peak in-flight
//   microbatches (schedule::peak_activations) x (the stage's LayerSeq record + its received input)
//   for one microbatch (labelled "predicted");
// - action_cost: a pipeline of trivial layers (4x4 Linear, one row per microbatch), whose actions
//   are almost all runtime: mean action time and makespan per action, in us.
#pragma once

#include <cstdint>
#include <cstdio>
#include <map>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "../harness/harness.hpp"
#include "cupipe/cupipe.hpp"

namespace cupipe::bench {

using Mlp = Sequential<Linear<784, 1024>, ReLU, Linear<1024, 512>, ReLU, Linear<512, 256>, ReLU, Linear<256, 10>>;
/// Wide enough to keep an H100 busy: 8 layers of 8192 x 8192 (fp32: 2 GiB of weights).
using Wide = Sequential<Linear<8192, 8192>, ReLU, Linear<8192, 8192>, ReLU, Linear<8192, 8192>, ReLU, Linear<8192, 8192>,
                        ReLU, Linear<8192, 8192>, ReLU, Linear<8192, 8192>, ReLU, Linear<8192, 8192>, ReLU,
                        Linear<8192, 8192>>;
/// Actions that do almost nothing: what is left is the runtime's own cost per action.
using Trivial = Sequential<Linear<4, 4>, ReLU, Linear<4, 4>, ReLU, Linear<4, 4>, ReLU, Linear<4, 4>>;

/// This program's own options; the harness takes --filter, --json, --warmup, --repeats, --axis.
struct Options {
  std::vector<std::string> models{"mlp"};
  std::vector<std::string> stages{"2", "4"};
  std::vector<std::string> microbatches{"4", "8", "16", "32"};
  index_t mlp_batch = 256;
  index_t wide_batch = 512;
  int device = 0;
};

inline Options parse(const std::vector<std::string>& args) {
  Options o;
  for (std::size_t i = 0; i < args.size(); ++i) {
    const std::string& arg = args[i];
    auto value = [&]() -> std::string {
      CUPIPE_REQUIRE(i + 1 < args.size(), "pipeline_throughput: ", arg, " needs a value");
      return args[++i];
    };
    if (arg == "--models") o.models = split(value());
    else if (arg == "--stages") o.stages = split(value());
    else if (arg == "--microbatches") o.microbatches = split(value());
    else if (arg == "--mlp-batch") o.mlp_batch = std::stoll(value());
    else if (arg == "--wide-batch") o.wide_batch = std::stoll(value());
    else if (arg == "--device") o.device = std::stoi(value());
    else
      CUPIPE_THROW("pipeline_throughput: unknown argument '", arg,
                   "'; use --models mlp,wide --stages 2,4 --microbatches 4,8,16,32 --mlp-batch N --wide-batch N "
                   "--device K, and ", harness_usage);
  }
  for (const std::string& m : o.models)
    CUPIPE_REQUIRE(m == "mlp" || m == "wide", "pipeline_throughput: unknown model '", m, "' (mlp or wide)");
  for (const std::string& p : o.stages)
    CUPIPE_REQUIRE(p == "2" || p == "4", "pipeline_throughput: stages must be 2 or 4, got ", p);
  return o;
}

inline double mib(double bytes) { return bytes / (1024.0 * 1024.0); }

/// Seeded inputs and labels, resident in a backend's memory.
template <class Backend, class U>
typename Backend::template buffer<U> resident(Backend& be, const std::vector<U>& host) {
  auto out = be.template allocate<U>(index_t(host.size()), MemoryTag::workspace);
  be.upload(std::span<const U>(host), out.data());
  return out;
}

inline std::vector<float> random_inputs(index_t n, std::uint64_t seed) {
  Rng rng(seed);
  std::vector<float> x(static_cast<std::size_t>(n));
  for (float& v : x) v = float(rng.uniform(-1.0, 1.0));
  return x;
}
inline std::vector<std::int32_t> random_labels(index_t n, index_t classes, std::uint64_t seed) {
  Rng rng(seed);
  std::vector<std::int32_t> y(static_cast<std::size_t>(n));
  for (auto& v : y) v = std::int32_t(rng.below(std::uint64_t(classes)));
  return y;
}

/// One model's batch, and the two ways of running it.
template <class Backend, class Model>
class Job {
 public:
  using T = typename Backend::value_type;
  static constexpr index_t in = Model::body::in_features;
  static constexpr index_t classes = Model::body::out_features;

  Job(const Options& o, index_t batch)
      : o_(o), batch_(batch), x_(random_inputs(batch * in, 1)), labels_(random_labels(batch, classes, 2)) {}

  /// The unpipelined Network; returns its samples/s.
  double network(State& state) {
    Network<Model, Backend> net = make_network();
    auto x = resident(net.backend(), x_);
    auto y = resident(net.backend(), labels_);
    const ConstViewOn<Backend, T> xv{x.data(), Shape{batch_, in}};
    const ConstViewOn<Backend, std::int32_t> yv{y.data(), Shape{batch_}};
    HostTimer timer;
    const Timing& t = state.exec(timer, [&] {
      net.forward_backward(xv, yv);  // returns the loss, so the host work has finished
      net.backend().synchronize();
    });
    const double samples_per_second = double(batch_) / t.median;
    const double weights = double(Model::body::param_count) * sizeof(T);
    state.summary("batch", "batch", double(batch_), 0);
    state.summary("samples_per_second", "samples/s", samples_per_second, 0);
    state.summary("peak_mib_measured", "peak MiB measured",
                  std::vector<double>{mib(double(net.backend().memory.peak(MemoryTag::weights) +
                                                 net.backend().memory.peak(MemoryTag::activations)))},
                  1);
    state.summary("peak_mib_predicted", "peak MiB predicted",
                  std::vector<double>{mib(weights + double(Model::body::record_elements(batch_)) * sizeof(T))}, 1);
    return samples_per_second;
  }

  /// 1F1B with P stages and m microbatches; `network_samples_per_second` measured in this run.
  template <int P>
  void pipelined(State& state, int m, double network_samples_per_second) {
    using Stages = partition<Model, P>;
    using Pipe = Pipeline<Stages, schedule::OneFOneB, Backend>;
    PipelineOptions options;
    options.microbatches = m;
    options.seed = 3;
    if constexpr (!host_accessible<typename Backend::space>) options.devices.assign(std::size_t(P), o_.device);
    Pipe pipe(options);
    auto x = resident(pipe.backend(0), x_);
    auto y = resident(pipe.backend(P - 1), labels_);
    const ConstViewOn<Backend, T> xv{x.data(), Shape{batch_, in}};
    const ConstViewOn<Backend, std::int32_t> yv{y.data(), Shape{batch_}};
    StepStats last;
    HostTimer timer;
    const Timing& t = state.exec(timer, [&] { last = pipe.forward_backward(xv, yv); });
    const double samples_per_second = double(batch_) / t.median;
    const schedule::SimResult sim = predicted(pipe.plan(), last);
    const index_t rows = (batch_ + m - 1) / m;
    std::vector<double> measured, prediction;
    [&]<std::size_t... K>(std::index_sequence<K...>) {
      (([&] {
         using Seq = typename Stages::template stage<K>;
         const double weights = double(Seq::param_count) * sizeof(T);
         const double input = K == 0 ? 0.0 : double(rows * Seq::in_features) * sizeof(T);
         const double per_microbatch = double(Seq::record_elements(rows)) * sizeof(T) + input;
         measured.push_back(mib(double(last.peak_weight_bytes[K] + last.peak_activation_bytes[K])));
         prediction.push_back(mib(weights + sim.peak_activations[K] * per_microbatch));
       }()),
       ...);
    }(std::make_index_sequence<std::size_t(P)>());
    state.summary("batch", "batch", double(batch_), 0);
    state.summary("samples_per_second", "samples/s", samples_per_second, 0);
    state.summary("ratio_to_unpipelined", "ratio to Network", samples_per_second / network_samples_per_second, 2);
    state.summary("bubble_measured", "bubble measured", last.bubble_fraction, 3);
    state.summary("bubble_simulated", "bubble simulated", sim.bubble_fraction, 3);
    state.summary("peak_mib_measured", "peak MiB measured", measured, 1);
    state.summary("peak_mib_predicted", "peak MiB predicted", prediction, 1);
  }

 private:
  Network<Model, Backend> make_network() {
    if constexpr (!host_accessible<typename Backend::space>) return Network<Model, Backend>(3, o_.device);
    else return Network<Model, Backend>(3);
  }

  const Options& o_;
  index_t batch_;
  std::vector<float> x_;
  std::vector<std::int32_t> labels_;
};

/// The program's heap allocations so far (bench/harness/heap_count.cpp, compiled into each program).
std::uint64_t heap_allocations() noexcept;

/// The runtime's own cost per action, from a pipeline of trivial layers; `timing`: measure_actions,
/// `arena`: planned_arena.
template <class Backend, int P>
void action_cost(State& state, const Options& o) {
  using T = typename Backend::value_type;
  using Pipe = Pipeline<partition<Trivial, P>, schedule::OneFOneB, Backend>;
  constexpr int m = 32;
  PipelineOptions options;
  options.microbatches = m;
  options.measure_actions = state.text("timing") == "on";
  options.planned_arena = state.text("arena") == "on";
  if constexpr (!host_accessible<typename Backend::space>) options.devices.assign(std::size_t(P), o.device);
  Pipe pipe(options);
  auto x = resident(pipe.backend(0), random_inputs(m * 4, 5));
  auto y = resident(pipe.backend(P - 1), random_labels(m, 4, 6));
  const ConstViewOn<Backend, T> xv{x.data(), Shape{m, 4}};
  const ConstViewOn<Backend, std::int32_t> yv{y.data(), Shape{m}};
  // Every run's figures, the warm-up's included; only the timed runs' are kept below.
  std::vector<double> mean_action, per_action, allocations;
  constexpr int actions = 2 * m * P;  // F and B of every microbatch on every worker
  HostTimer timer;
  const Timing& timing = state.exec(timer, [&] {
    const std::uint64_t before = heap_allocations();
    const StepStats s = pipe.forward_backward(xv, yv);
    allocations.push_back(double(heap_allocations() - before));
    if (!options.measure_actions) return;
    double busy = 0;
    for (double b : s.busy_seconds) busy += b;
    mean_action.push_back(busy / double(actions));
    per_action.push_back(s.makespan_seconds / (double(actions) / P));
  });
  const auto timed = std::ptrdiff_t(state.runs().warmup);
  auto median_of_timed = [&](const std::vector<double>& v) {
    return median(std::vector<double>(v.begin() + timed, v.end()));
  };
  state.summary("microbatches", "m", double(m), 0);
  state.summary("actions", "actions", double(actions), 0);
  if (options.measure_actions) {
    state.summary("mean_action_us", "mean action us", median_of_timed(mean_action) * 1e6, 1);
    state.summary("makespan_per_action_us", "makespan per action us", median_of_timed(per_action) * 1e6, 1);
  }
  // The step on the caller's clock, losses read back included: what a trainer sees per action.
  state.summary("step_per_action_us", "step per action us", timing.median / (double(actions) / P) * 1e6, 2);
  state.summary("allocations", "heap allocations per step", median_of_timed(allocations), 0);
}

/// Calls f.template operator()<Model>(batch) for the model named on the `model` axis.
template <class F>
decltype(auto) with_model(const std::string& model, const Options& o, F&& f) {
  if (model == "wide") return std::forward<F>(f).template operator()<Wide>(o.wide_batch);
  return std::forward<F>(f).template operator()<Mlp>(o.mlp_batch);
}

/// Declares this program's benchmarks on `Backend`, runs what the harness's options select and
/// reports it.
template <class Backend>
int run(Harness& harness, const Options& o, const std::string& device) {
  harness.context() = {{"backend", std::string(Backend::name)}, {"device", device}, {"schedule", "1f1b"},
                       {"models", {{"mlp", "784-1024-512-256-10"}, {"wide", "8 x 8192^2"}}},
                       {"mlp_batch", o.mlp_batch}, {"wide_batch", o.wide_batch}};
  // The Network's samples/s per model, for the ratios; measured here if --filter left `network` out.
  std::map<std::string, double> network_samples_per_second;
  auto network = [&](State& state) {
    const std::string model = state.text("model");
    network_samples_per_second[model] = with_model(model, o, [&]<class Model>(index_t batch) {
      return Job<Backend, Model>(o, batch).network(state);
    });
  };

  harness.add("network", network)
      .axis("model", o.models)
      .note("The unpipelined Network: forward+backward of one batch. mlp: 784-1024-512-256-10; wide: 8 x 8192^2. "
            "Peak MiB: measured (weights + activations) vs predicted (weights + the batch's record).");

  harness
      .add("1f1b",
           [&](State& state) {
             const std::string model = state.text("model");
             const int p = int(state.integer("stages")), m = int(state.integer("microbatches"));
             if (!network_samples_per_second.contains(model)) {
               State baseline({{"model", model}}, state.runs());
               network(baseline);
             }
             with_model(model, o, [&]<class Model>(index_t batch) {
               if (batch < m) return state.skip("batch smaller than m");
               Job<Backend, Model> job(o, batch);
               if (p == 2) job.template pipelined<2>(state, m, network_samples_per_second[model]);
               else job.template pipelined<4>(state, m, network_samples_per_second[model]);
             });
           })
      .axis("model", o.models)
      .axis("stages", o.stages)
      .axis("microbatches", o.microbatches)
      .note("Forward+backward of the same batch with 1F1B. Ratio: to the unpipelined Network measured in the same run. "
            "Bubble: measured vs simulated (schedule::simulate with the step's measured mean costs). Peak MiB per "
            "stage: measured (weights + activations) vs predicted (weights + peak in-flight microbatches x (record + "
            "input)).");

  harness
      .add("action_cost",
           [&](State& state) {
             if (state.integer("stages") == 2) action_cost<Backend, 2>(state, o);
             else action_cost<Backend, 4>(state, o);
           })
      .axis("stages", o.stages)
      .axis("timing", {"on", "off"})
      .axis("arena", {"on", "off"})
      .note("Runtime cost per action: trivial 4x4 layers, one row per microbatch, 1F1B. Timing: measure_actions; "
            "arena: planned_arena (off: every buffer from the pool). Mean "
            "action: time inside an action (measured); makespan per action: step makespan / actions per stage "
            "(includes waiting); step per action: the step's time on the caller's clock / actions per stage; heap "
            "allocations per step: every thread's calls of operator new during the step.");

  harness.run();
  return 0;
}

}  // namespace cupipe::bench
