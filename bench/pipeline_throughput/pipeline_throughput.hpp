// SPDX-License-Identifier: Apache-2.0
// Pipeline throughput benchmark, shared by the host build (main_host.cpp) and the CUDA build
// (main_cuda.cu): the same models, schedules and report on any backend.
//
// For each model: the unpipelined Network, then 1F1B with P stages and m microbatches of one global
// batch, all measured side by side in one run. Reported per configuration:
// - samples/s of forward+backward (median of the timed steps) and the ratio to the Network's;
// - the measured bubble (StepStats) next to the simulator's for the same plan with the step's
//   measured mean F/B costs (labelled "simulated");
// - peak memory per stage (weights + activations, from the stage's allocator) next to a prediction:
//   parameter bytes + peak in-flight microbatches (schedule::peak_activations) x (the stage's
//   LayerSeq record + its received input) for one microbatch (labelled "predicted");
// - per-action runtime cost: a pipeline of trivial layers (4x4 Linear, one row per microbatch),
//   whose actions are almost all runtime: mean action time and makespan per action, in us.
// Output: a markdown table on stdout and, with --json, the same figures as JSON.
#pragma once

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <iomanip>
#include <span>
#include <sstream>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "cupipe/cupipe.hpp"

namespace cupipe::bench {

using Mlp = Sequential<Linear<784, 1024>, ReLU, Linear<1024, 512>, ReLU, Linear<512, 256>, ReLU, Linear<256, 10>>;
/// Wide enough to keep an H100 busy: 8 layers of 8192 x 8192 (fp32: 2 GiB of weights).
using Wide = Sequential<Linear<8192, 8192>, ReLU, Linear<8192, 8192>, ReLU, Linear<8192, 8192>, ReLU, Linear<8192, 8192>,
                        ReLU, Linear<8192, 8192>, ReLU, Linear<8192, 8192>, ReLU, Linear<8192, 8192>, ReLU,
                        Linear<8192, 8192>>;
/// Actions that do almost nothing: what is left is the runtime's own cost per action.
using Trivial = Sequential<Linear<4, 4>, ReLU, Linear<4, 4>, ReLU, Linear<4, 4>, ReLU, Linear<4, 4>>;

struct Options {
  std::vector<std::string> models{"mlp"};
  std::vector<int> stages{2, 4};
  std::vector<int> microbatches{4, 8, 16, 32};
  index_t mlp_batch = 256;
  index_t wide_batch = 512;
  int warmup = 1;
  int repeats = 3;
  int device = 0;
  std::string json;
};

inline std::vector<int> parse_ints(const std::string& text) {
  std::vector<int> out;
  std::stringstream in(text);
  for (std::string item; std::getline(in, item, ',');) out.push_back(std::stoi(item));
  return out;
}

inline Options parse(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    auto value = [&]() -> std::string {
      CUPIPE_REQUIRE(i + 1 < argc, "pipeline_throughput: ", arg, " needs a value");
      return argv[++i];
    };
    if (arg == "--models") {
      o.models.clear();
      std::stringstream in(value());
      for (std::string item; std::getline(in, item, ',');) o.models.push_back(item);
    } else if (arg == "--stages") {
      o.stages = parse_ints(value());
    } else if (arg == "--microbatches") {
      o.microbatches = parse_ints(value());
    } else if (arg == "--mlp-batch") {
      o.mlp_batch = std::stoll(value());
    } else if (arg == "--wide-batch") {
      o.wide_batch = std::stoll(value());
    } else if (arg == "--warmup") {
      o.warmup = std::stoi(value());
    } else if (arg == "--repeats") {
      o.repeats = std::stoi(value());
    } else if (arg == "--device") {
      o.device = std::stoi(value());
    } else if (arg == "--json") {
      o.json = value();
    } else {
      CUPIPE_THROW("pipeline_throughput: unknown argument '", arg,
                   "'; use --models mlp,wide --stages 2,4 --microbatches 4,8,16,32 --mlp-batch N --wide-batch N "
                   "--warmup N --repeats N --device K --json FILE");
    }
  }
  for (const std::string& m : o.models)
    CUPIPE_REQUIRE(m == "mlp" || m == "wide", "pipeline_throughput: unknown model '", m, "' (mlp or wide)");
  for (int p : o.stages) CUPIPE_REQUIRE(p == 2 || p == 4, "pipeline_throughput: stages must be 2 or 4, got ", p);
  CUPIPE_REQUIRE(o.repeats >= 1, "pipeline_throughput: --repeats must be at least 1");
  return o;
}

/// One configuration's figures.
struct Row {
  std::string model;
  int stages = 1;  // 1: the unpipelined Network
  int microbatches = 1;
  index_t batch = 0;
  double seconds = 0;  // median step time
  double samples_per_second = 0;
  double ratio = 1;  // to the unpipelined Network of the same model and batch
  double bubble_measured = 0;
  double bubble_simulated = 0;
  std::vector<double> peak_mib_measured;   // per stage: weights + activations
  std::vector<double> peak_mib_predicted;  // per stage
};

struct ActionCost {
  int stages = 0;
  int microbatches = 0;
  int actions = 0;
  double mean_action_us = 0;        // mean time inside an action
  double makespan_per_action_us = 0;  // makespan / actions on a stage (includes waiting)
};

inline double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
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

template <class Backend, class Model>
class Bench {
 public:
  using T = typename Backend::value_type;
  static constexpr index_t in = Model::body::in_features;
  static constexpr index_t classes = Model::body::out_features;

  Bench(const Options& o, std::string name, index_t batch) : o_(o), name_(std::move(name)), batch_(batch) {
    x_ = random_inputs(batch_ * in, 1);
    labels_ = random_labels(batch_, classes, 2);
  }

  /// The unpipelined Network; its samples/s is every ratio's denominator.
  Row unpipelined() {
    Network<Model, Backend> net = make_network();
    auto x = resident(net.backend(), x_);
    auto y = resident(net.backend(), labels_);
    const ConstView<T> xv{x.data(), Shape{batch_, in}};
    const ConstView<std::int32_t> yv{y.data(), Shape{batch_}};
    std::vector<double> times;
    for (int r = 0; r < o_.warmup + o_.repeats; ++r) {
      const auto start = std::chrono::steady_clock::now();
      net.forward_backward(xv, yv);  // returns the loss, so the work has finished
      net.backend().synchronize();
      const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      if (r >= o_.warmup) times.push_back(s);
    }
    Row row;
    row.model = name_;
    row.batch = batch_;
    row.seconds = median(times);
    row.samples_per_second = double(batch_) / row.seconds;
    const double weights = double(Model::body::param_count) * sizeof(T);
    row.peak_mib_measured = {mib(double(net.backend().memory.peak(MemoryTag::weights) +
                                        net.backend().memory.peak(MemoryTag::activations)))};
    row.peak_mib_predicted = {mib(weights + double(Model::body::record_elements(batch_)) * sizeof(T))};
    base_ = row.samples_per_second;
    return row;
  }

  template <int P>
  Row pipelined(int m) {
    using Stages = partition<Model, P>;
    using Pipe = Pipeline<Stages, schedule::OneFOneB, Backend>;
    PipelineOptions options;
    options.microbatches = m;
    options.seed = 3;
    if constexpr (Backend::on_device) options.devices.assign(std::size_t(P), o_.device);
    Pipe pipe(options);
    auto x = resident(pipe.backend(0), x_);
    auto y = resident(pipe.backend(P - 1), labels_);
    const ConstView<T> xv{x.data(), Shape{batch_, in}};
    const ConstView<std::int32_t> yv{y.data(), Shape{batch_}};
    std::vector<double> times;
    StepStats last;
    for (int r = 0; r < o_.warmup + o_.repeats; ++r) {
      const auto start = std::chrono::steady_clock::now();
      last = pipe.forward_backward(xv, yv);
      const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      if (r >= o_.warmup) times.push_back(s);
    }
    Row row;
    row.model = name_;
    row.stages = P;
    row.microbatches = m;
    row.batch = batch_;
    row.seconds = median(times);
    row.samples_per_second = double(batch_) / row.seconds;
    row.ratio = base_ > 0 ? row.samples_per_second / base_ : 0;
    row.bubble_measured = last.bubble_fraction;
    const schedule::SimResult sim = predicted(pipe.plan(), last);
    row.bubble_simulated = sim.bubble_fraction;
    const index_t rows = (batch_ + m - 1) / m;
    [&]<std::size_t... K>(std::index_sequence<K...>) {
      (([&] {
         using Seq = typename Stages::template stage<K>;
         const double weights = double(Seq::param_count) * sizeof(T);
         const double input = K == 0 ? 0.0 : double(rows * Seq::in_features) * sizeof(T);
         const double per_microbatch = double(Seq::record_elements(rows)) * sizeof(T) + input;
         row.peak_mib_measured.push_back(
             mib(double(last.peak_weight_bytes[K] + last.peak_activation_bytes[K])));
         row.peak_mib_predicted.push_back(mib(weights + sim.peak_activations[K] * per_microbatch));
       }()),
       ...);
    }(std::make_index_sequence<std::size_t(P)>());
    return row;
  }

 private:
  Network<Model, Backend> make_network() {
    if constexpr (Backend::on_device) return Network<Model, Backend>(3, o_.device);
    else return Network<Model, Backend>(3);
  }

  const Options& o_;
  std::string name_;
  index_t batch_;
  std::vector<float> x_;
  std::vector<std::int32_t> labels_;
  double base_ = 0;
};

/// The runtime's own cost per action, from a pipeline of trivial layers.
template <class Backend, int P>
ActionCost action_cost(const Options& o) {
  using T = typename Backend::value_type;
  using Pipe = Pipeline<partition<Trivial, P>, schedule::OneFOneB, Backend>;
  constexpr int m = 32;
  PipelineOptions options;
  options.microbatches = m;
  if constexpr (Backend::on_device) options.devices.assign(std::size_t(P), o.device);
  Pipe pipe(options);
  auto x = resident(pipe.backend(0), random_inputs(m * 4, 5));
  auto y = resident(pipe.backend(P - 1), random_labels(m, 4, 6));
  const ConstView<T> xv{x.data(), Shape{m, 4}};
  const ConstView<std::int32_t> yv{y.data(), Shape{m}};
  std::vector<double> mean_action, per_action;
  int actions = 0;
  for (int r = 0; r < o.warmup + o.repeats; ++r) {
    const StepStats s = pipe.forward_backward(xv, yv);
    if (r < o.warmup) continue;
    double busy = 0;
    for (double b : s.busy_seconds) busy += b;
    actions = int(s.actions.size());
    mean_action.push_back(busy / double(actions));
    per_action.push_back(s.makespan_seconds / (double(actions) / P));
  }
  return {P, m, actions, median(mean_action) * 1e6, median(per_action) * 1e6};
}

inline std::string join(const std::vector<double>& v, int precision) {
  std::ostringstream out;
  out << std::fixed << std::setprecision(precision);
  for (std::size_t i = 0; i < v.size(); ++i) out << (i ? " / " : "") << v[i];
  return out.str();
}

inline std::string json_array(const std::vector<double>& v) {
  std::ostringstream out;
  out << std::setprecision(6) << "[";
  for (std::size_t i = 0; i < v.size(); ++i) out << (i ? ", " : "") << v[i];
  return out.str() + "]";
}

inline void report(const std::string& backend_name, const std::string& device, const std::vector<Row>& rows,
                   const std::vector<ActionCost>& costs, const Options& o) {
  std::printf("## pipeline_throughput (%s backend, %s)\n\n", backend_name.c_str(), device.c_str());
  std::printf("Forward+backward of one batch, 1F1B; median of %d timed steps after %d warm-up. Ratio: to the "
              "unpipelined Network in the same run. Bubble: measured vs simulated (schedule::simulate with the "
              "step's measured mean costs). Peak MiB per stage: measured (weights + activations) vs predicted "
              "(weights + peak in-flight microbatches x (record + input)).\n\n",
              o.repeats, o.warmup);
  std::printf("| model | batch | P | m | step ms | samples/s | ratio | bubble measured | bubble simulated | peak MiB measured | peak MiB predicted |\n");
  std::printf("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- | --- |\n");
  for (const Row& r : rows) {
    if (r.stages == 1)
      std::printf("| %s | %lld | 1 (Network) | - | %.2f | %.0f | 1.00 | - | - | %s | %s |\n", r.model.c_str(),
                  static_cast<long long>(r.batch), r.seconds * 1e3, r.samples_per_second,
                  join(r.peak_mib_measured, 1).c_str(), join(r.peak_mib_predicted, 1).c_str());
    else
      std::printf("| %s | %lld | %d | %d | %.2f | %.0f | %.2f | %.3f | %.3f | %s | %s |\n", r.model.c_str(),
                  static_cast<long long>(r.batch), r.stages, r.microbatches, r.seconds * 1e3, r.samples_per_second,
                  r.ratio, r.bubble_measured, r.bubble_simulated, join(r.peak_mib_measured, 1).c_str(),
                  join(r.peak_mib_predicted, 1).c_str());
  }
  std::printf("\nRuntime cost per action (trivial 4x4 layers, one row per microbatch, 1F1B):\n\n");
  std::printf("| P | m | actions | mean action us | makespan per action us |\n| ---: | ---: | ---: | ---: | ---: |\n");
  for (const ActionCost& c : costs)
    std::printf("| %d | %d | %d | %.1f | %.1f |\n", c.stages, c.microbatches, c.actions, c.mean_action_us,
                c.makespan_per_action_us);
  std::fflush(stdout);

  if (o.json.empty()) return;
  std::ofstream out(o.json);
  out << std::setprecision(8) << "{\n  \"backend\": \"" << backend_name << "\",\n  \"device\": \"" << device
      << "\",\n  \"schedule\": \"1f1b\",\n  \"repeats\": " << o.repeats << ",\n  \"warmup\": " << o.warmup
      << ",\n  \"rows\": [\n";
  for (std::size_t i = 0; i < rows.size(); ++i) {
    const Row& r = rows[i];
    out << "    {\"model\": \"" << r.model << "\", \"batch\": " << r.batch << ", \"stages\": " << r.stages
        << ", \"microbatches\": " << r.microbatches << ", \"step_seconds\": " << r.seconds
        << ", \"samples_per_second\": " << r.samples_per_second << ", \"ratio_to_unpipelined\": " << r.ratio
        << ", \"bubble_measured\": " << r.bubble_measured << ", \"bubble_simulated\": " << r.bubble_simulated
        << ", \"peak_mib_measured\": " << json_array(r.peak_mib_measured)
        << ", \"peak_mib_predicted\": " << json_array(r.peak_mib_predicted) << "}" << (i + 1 < rows.size() ? "," : "")
        << "\n";
  }
  out << "  ],\n  \"action_cost\": [\n";
  for (std::size_t i = 0; i < costs.size(); ++i) {
    const ActionCost& c = costs[i];
    out << "    {\"stages\": " << c.stages << ", \"microbatches\": " << c.microbatches << ", \"actions\": " << c.actions
        << ", \"mean_action_us\": " << c.mean_action_us << ", \"makespan_per_action_us\": " << c.makespan_per_action_us
        << "}" << (i + 1 < costs.size() ? "," : "") << "\n";
  }
  out << "  ]\n}\n";
  CUPIPE_REQUIRE(out.good(), "pipeline_throughput: cannot write ", o.json);
}

template <class Backend, class Model>
void run_model(const Options& o, const std::string& name, index_t batch, std::vector<Row>& rows) {
  Bench<Backend, Model> bench(o, name, batch);
  rows.push_back(bench.unpipelined());
  for (int p : o.stages)
    for (int m : o.microbatches) {
      if (batch < m) continue;
      std::fprintf(stderr, "%s P=%d m=%d\n", name.c_str(), p, m);
      rows.push_back(p == 2 ? bench.template pipelined<2>(m) : bench.template pipelined<4>(m));
    }
}

/// Runs everything the options ask for on `Backend` and reports it.
template <class Backend>
int run(const Options& o, const std::string& device) {
  std::vector<Row> rows;
  for (const std::string& model : o.models) {
    if (model == "mlp") run_model<Backend, Mlp>(o, "mlp 784-1024-512-256-10", o.mlp_batch, rows);
    if (model == "wide") run_model<Backend, Wide>(o, "wide 8x8192^2", o.wide_batch, rows);
  }
  std::vector<ActionCost> costs;
  for (int p : o.stages) costs.push_back(p == 2 ? action_cost<Backend, 2>(o) : action_cost<Backend, 4>(o));
  report(std::string(Backend::name), device, rows, costs, o);
  return 0;
}

}  // namespace cupipe::bench
