// SPDX-License-Identifier: Apache-2.0
// One benchmark harness for host and device, in the shape of nvbench. A program declares benchmarks
// (a name, axes of named values, a body); the harness runs the cartesian product of each benchmark's
// axes as states. A state times its work through a timer (HostTimer here, CudaTimer in cuda_timer.cuh):
// warm-up runs, then N timed runs, reported as the median and the noise, (p90 - p10) / median. A state
// declares the bytes it reads and writes and the FLOPs it does, so the report shows GB/s and TFLOP/s,
// and adds its own figures as summaries. Output: one markdown table per benchmark on stdout for people,
// and with --json FILE the same figures for tools.
#pragma once

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <deque>
#include <fstream>
#include <functional>
#include <regex>
#include <string>
#include <utility>
#include <variant>
#include <vector>

#include <nlohmann/json.hpp>

#include "cupipe/core/error.hpp"

namespace cupipe::bench {

/// How many untimed and timed runs a state makes.
struct Runs {
  int warmup = 1;
  int repeats = 3;
};

/// The statistics of a state's timed runs, in seconds.
struct Timing {
  std::vector<double> seconds;  // every timed run, in run order
  double median = 0, min = 0, p10 = 0, p90 = 0;

  /// Relative spread of the runs: (p90 - p10) / median.
  double noise() const { return median > 0 ? (p90 - p10) / median : 0; }

  static Timing of(std::vector<double> runs) {
    CUPIPE_REQUIRE(!runs.empty(), "bench: a timing needs at least one timed run");
    Timing t;
    t.seconds = runs;
    std::sort(runs.begin(), runs.end());
    t.min = runs.front();
    t.median = percentile(runs, 0.5);
    t.p10 = percentile(runs, 0.1);
    t.p90 = percentile(runs, 0.9);
    return t;
  }

  /// Linear interpolation between the closest ranks of sorted values.
  static double percentile(const std::vector<double>& sorted, double q) {
    const double rank = q * double(sorted.size() - 1);
    const std::size_t low = std::size_t(rank);
    const std::size_t high = std::min(low + 1, sorted.size() - 1);
    return sorted[low] + (rank - double(low)) * (sorted[high] - sorted[low]);
  }
};

/// The median of any per-run figure a body collects itself (bubble, busy time, ...).
inline double median(std::vector<double> values) { return Timing::of(std::move(values)).median; }

/// Wall-clock time of work that has finished when the callable returns.
class HostTimer {
 public:
  std::string description() const { return "std::chrono::steady_clock"; }
  template <class F>
  void untimed(F&& work) {
    work();
  }
  template <class F>
  double seconds(F&& work) {
    const auto start = std::chrono::steady_clock::now();
    work();
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  }
};

/// Runs `work` runs.warmup times untimed, then runs.repeats times timed.
template <class Timer, class F>
Timing measure(Timer& timer, F&& work, Runs runs) {
  for (int i = 0; i < runs.warmup; ++i) timer.untimed(work);
  std::vector<double> seconds;
  for (int i = 0; i < runs.repeats; ++i) seconds.push_back(timer.seconds(work));
  return Timing::of(std::move(seconds));
}

/// A figure a state reports besides its time: a number, a text, or one number per stage.
using Value = std::variant<double, std::string, std::vector<double>>;

struct Summary {
  std::string key;    // JSON key, e.g. "samples_per_second"
  std::string label;  // markdown column, e.g. "samples/s"
  Value value;
  int precision = 3;  // digits after the point in the markdown table
};

/// A named list of values; a benchmark runs the cartesian product of its axes.
struct Axis {
  std::string name;
  std::vector<std::string> values;
};

/// One point of a benchmark's axes: what its body sees and what it reports.
class State {
 public:
  State(std::vector<std::pair<std::string, std::string>> point, Runs runs) : point_(std::move(point)), runs_(runs) {}

  const std::string& text(const std::string& axis) const {
    for (const auto& [name, value] : point_)
      if (name == axis) return value;
    CUPIPE_THROW("bench: this benchmark has no axis '", axis, "'");
  }
  std::int64_t integer(const std::string& axis) const {
    const std::string& value = text(axis);
    std::size_t used = 0;
    std::int64_t out = 0;
    try {
      out = std::stoll(value, &used);
    } catch (const std::exception&) {
      used = 0;
    }
    CUPIPE_REQUIRE(used == value.size() && !value.empty(), "bench: axis '", axis, "' expected an integer but got '",
                   value, "'");
    return out;
  }
  const std::vector<std::pair<std::string, std::string>>& point() const { return point_; }
  Runs runs() const { return runs_; }

  /// The fewest bytes the timed work must move and the FLOPs it must do, per run.
  void add_reads(double bytes) { reads_ += bytes; }
  void add_writes(double bytes) { writes_ += bytes; }
  void add_flops(double flops) { flops_ += flops; }
  double bytes() const { return reads_ + writes_; }
  double flops() const { return flops_; }

  /// Times the state's work: the figure its row reports.
  template <class Timer, class F>
  const Timing& exec(Timer& timer, F&& work) {
    timing_ = measure(timer, std::forward<F>(work), runs_);
    timer_ = timer.description();
    return timing_;
  }
  /// Times other work with the same runs (a reference to compare with) without reporting it.
  template <class Timer, class F>
  Timing measure_other(Timer& timer, F&& work) const {
    return measure(timer, std::forward<F>(work), runs_);
  }
  const Timing& timing() const { return timing_; }
  bool timed() const { return !timing_.seconds.empty(); }
  const std::string& timer() const { return timer_; }

  /// A figure next to the time; adding the same key again replaces it.
  void summary(std::string key, std::string label, Value value, int precision = 3) {
    for (Summary& s : summaries_)
      if (s.key == key) {
        s = {std::move(key), std::move(label), std::move(value), precision};
        return;
      }
    summaries_.push_back({std::move(key), std::move(label), std::move(value), precision});
  }
  const Summary* find(const std::string& key) const {
    for (const Summary& s : summaries_)
      if (s.key == key) return &s;
    return nullptr;
  }
  const std::vector<Summary>& summaries() const { return summaries_; }

  /// Marks a point that does not apply (e.g. fewer rows than microbatches); its row says why.
  void skip(std::string reason) { skipped_ = std::move(reason); }
  const std::string& skipped() const { return skipped_; }

  double gbps() const { return timed() && bytes() > 0 ? bytes() / timing_.median / 1e9 : 0; }
  double tflops() const { return timed() && flops() > 0 ? flops() / timing_.median / 1e12 : 0; }

 private:
  std::vector<std::pair<std::string, std::string>> point_;
  Runs runs_;
  double reads_ = 0, writes_ = 0, flops_ = 0;
  Timing timing_;
  std::string timer_;
  std::vector<Summary> summaries_;
  std::string skipped_;
};

class Benchmark {
 public:
  using Body = std::function<void(State&)>;
  /// Runs after every state: for figures that compare states measured in the same run.
  using Finish = std::function<void(std::vector<State>&)>;

  Benchmark(std::string name, Body body) : name_(std::move(name)), body_(std::move(body)) {}

  Benchmark& axis(std::string name, std::vector<std::string> values) {
    CUPIPE_REQUIRE(!values.empty(), "bench: axis '", name, "' of ", name_, " has no values");
    axes_.push_back({std::move(name), std::move(values)});
    return *this;
  }
  Benchmark& int_axis(std::string name, const std::vector<std::int64_t>& values) {
    std::vector<std::string> text;
    for (std::int64_t v : values) text.push_back(std::to_string(v));
    return axis(std::move(name), std::move(text));
  }
  Benchmark& runs(int warmup, int repeats) {
    runs_ = {warmup, repeats};
    return *this;
  }
  Benchmark& finish(Finish f) {
    finish_ = std::move(f);
    return *this;
  }
  /// A sentence printed under the benchmark's heading: what is measured and how.
  Benchmark& note(std::string text) {
    note_ = std::move(text);
    return *this;
  }

  const std::string& name() const { return name_; }
  const std::string& note() const { return note_; }
  std::vector<Axis>& axes() { return axes_; }
  const std::vector<Axis>& axes() const { return axes_; }
  Runs default_runs() const { return runs_; }

  /// Every state of the cartesian product, the last axis varying fastest, run in order.
  std::vector<State> run(Runs runs) const {
    std::vector<State> states;
    std::vector<std::size_t> index(axes_.size(), 0);
    for (;;) {
      std::vector<std::pair<std::string, std::string>> point;
      for (std::size_t a = 0; a < axes_.size(); ++a) point.emplace_back(axes_[a].name, axes_[a].values[index[a]]);
      State& state = states.emplace_back(std::move(point), runs);
      body_(state);
      std::size_t a = axes_.size();
      while (a > 0 && ++index[a - 1] == axes_[a - 1].values.size()) index[--a] = 0;
      if (a == 0) break;
    }
    if (finish_) finish_(states);
    return states;
  }

 private:
  std::string name_;
  Body body_;
  std::vector<Axis> axes_;
  Runs runs_;
  Finish finish_;
  std::string note_;
};

/// The harness's own command-line options; a program parses the arguments left over.
struct HarnessOptions {
  std::string filter = ".*";  // ECMAScript regex searched in each benchmark's name
  std::string json;           // empty: no JSON
  int warmup = -1;            // -1: each benchmark's default
  int repeats = -1;
  std::vector<Axis> axis_overrides;  // --axis name=v1,v2
  bool list = false;
};

inline std::vector<std::string> split(const std::string& text, char separator = ',') {
  std::vector<std::string> out;
  std::size_t start = 0;
  for (;;) {
    const std::size_t end = text.find(separator, start);
    out.push_back(text.substr(start, end == std::string::npos ? std::string::npos : end - start));
    if (end == std::string::npos) return out;
    start = end + 1;
  }
}

inline constexpr const char* harness_usage =
    "--filter REGEX (benchmark names) --json FILE --warmup N --repeats N --axis NAME=V1,V2 --list";

class Harness {
 public:
  explicit Harness(std::string title) : title_(std::move(title)) {}

  Benchmark& add(std::string name, Benchmark::Body body) {
    for (const Benchmark& b : benchmarks_)
      CUPIPE_REQUIRE(b.name() != name, "bench: two benchmarks are named '", name, "'");
    return benchmarks_.emplace_back(std::move(name), std::move(body));
  }

  /// Takes the harness's options out of argv and returns the others, in order.
  std::vector<std::string> parse(int argc, char** argv) {
    std::vector<std::string> rest;
    for (int i = 1; i < argc; ++i) {
      const std::string arg = argv[i];
      auto value = [&]() -> std::string {
        CUPIPE_REQUIRE(i + 1 < argc, "bench: ", arg, " needs a value");
        return argv[++i];
      };
      if (arg == "--filter") options_.filter = value();
      else if (arg == "--json") options_.json = value();
      else if (arg == "--warmup") options_.warmup = std::stoi(value());
      else if (arg == "--repeats") options_.repeats = std::stoi(value());
      else if (arg == "--list") options_.list = true;
      else if (arg == "--axis") {
        const std::string spec = value();
        const std::size_t eq = spec.find('=');
        CUPIPE_REQUIRE(eq != std::string::npos && eq > 0 && eq + 1 < spec.size(), "bench: --axis expected NAME=V1,V2 but got '",
                       spec, "'");
        options_.axis_overrides.push_back({spec.substr(0, eq), split(spec.substr(eq + 1))});
      } else rest.push_back(arg);
    }
    CUPIPE_REQUIRE(options_.warmup >= -1 && options_.repeats != 0 && options_.repeats >= -1,
                   "bench: --warmup must be at least 0 and --repeats at least 1");
    return rest;
  }
  HarnessOptions& options() { return options_; }

  /// Facts about the run every JSON consumer needs: backend, device, job sizes.
  nlohmann::json& context() { return context_; }

  /// Runs every benchmark whose name matches --filter, prints each table as it finishes and writes
  /// the JSON. Returns the number of benchmarks run.
  int run() {
    const std::regex filter(options_.filter);
    for (const Axis& o : options_.axis_overrides) {
      bool used = false;
      for (Benchmark& b : benchmarks_)
        for (Axis& a : b.axes())
          if (a.name == o.name) a.values = o.values, used = true;
      CUPIPE_REQUIRE(used, "bench: --axis ", o.name, ": no benchmark has that axis");
    }
    if (options_.list) {
      for (const Benchmark& b : benchmarks_) {
        std::printf("%s", b.name().c_str());
        for (const Axis& a : b.axes()) std::printf("  %s=%s", a.name.c_str(), join(a.values).c_str());
        std::printf("\n");
      }
      return 0;
    }
    std::printf("# %s\n\n", title_.c_str());
    nlohmann::json out{{"title", title_},
                       {"context", context_},
                       {"method", {{"statistic", "median of the timed runs"}, {"noise", "(p90 - p10) / median"}}},
                       {"benchmarks", nlohmann::json::array()}};
    int count = 0;
    for (const Benchmark& b : benchmarks_) {
      if (!std::regex_search(b.name(), filter)) continue;
      const Runs defaults = b.default_runs();
      const Runs runs{options_.warmup >= 0 ? options_.warmup : defaults.warmup,
                      options_.repeats >= 1 ? options_.repeats : defaults.repeats};
      std::fprintf(stderr, "bench: %s\n", b.name().c_str());
      const std::vector<State> states = b.run(runs);
      print_markdown(b, states, runs);
      out["benchmarks"].push_back(to_json(b, states, runs));
      ++count;
    }
    CUPIPE_REQUIRE(count > 0, "bench: --filter '", options_.filter, "' matches no benchmark; --list names them");
    if (!options_.json.empty()) {
      std::ofstream file(options_.json);
      file << out.dump(2) << "\n";
      CUPIPE_REQUIRE(file.good(), "bench: cannot write ", options_.json);
      std::printf("JSON written to %s\n", options_.json.c_str());
    }
    return count;
  }

 private:
  static std::string join(const std::vector<std::string>& values) {
    std::string out;
    for (const std::string& v : values) {
      if (!out.empty()) out.append(",");
      out.append(v);
    }
    return out;
  }

  static std::string format(double value, int precision) {
    char text[64];
    std::snprintf(text, sizeof text, "%.*f", precision, value);
    return text;
  }
  static std::string format(const Value& value, int precision) {
    if (const double* d = std::get_if<double>(&value)) return format(*d, precision);
    if (const std::string* s = std::get_if<std::string>(&value)) return *s;
    std::string out;
    for (double d : std::get<std::vector<double>>(value)) {
      if (!out.empty()) out.append(" / ");
      out.append(format(d, precision));
    }
    return out;
  }
  /// A time in the unit that keeps 3-4 significant digits.
  static std::string format_time(double seconds) {
    if (seconds < 1e-3) return format(seconds * 1e6, 1) + " us";
    if (seconds < 1) return format(seconds * 1e3, 2) + " ms";
    return format(seconds, 3) + " s";
  }

  static void print_row(const std::vector<std::string>& cells) {
    for (const std::string& cell : cells) std::printf("| %s ", cell.c_str());
    std::printf("|\n");
  }

  static void print_markdown(const Benchmark& b, const std::vector<State>& states, Runs runs) {
    bool bytes = false, flops = false;
    std::vector<std::pair<std::string, std::string>> columns;  // summary key, label: first appearance order
    for (const State& s : states) {
      bytes = bytes || s.bytes() > 0;
      flops = flops || s.flops() > 0;
      for (const Summary& sum : s.summaries())
        if (std::none_of(columns.begin(), columns.end(), [&](const auto& c) { return c.first == sum.key; }))
          columns.emplace_back(sum.key, sum.label);
    }
    std::printf("## %s\n\n", b.name().c_str());
    if (!b.note().empty()) std::printf("%s\n\n", b.note().c_str());
    std::printf("Median of %d timed runs after %d warm-up; noise = (p90 - p10) / median.\n\n", runs.repeats, runs.warmup);
    std::vector<std::string> header, rule;
    for (const Axis& a : b.axes()) header.push_back(a.name), rule.push_back("---");
    for (const char* name : {"median", "min", "noise"}) header.push_back(name), rule.push_back("---:");
    if (bytes) header.push_back("GB/s"), rule.push_back("---:");
    if (flops) header.push_back("TFLOP/s"), rule.push_back("---:");
    for (const auto& c : columns) header.push_back(c.second), rule.push_back("---:");
    print_row(header);
    print_row(rule);
    for (const State& s : states) {
      std::vector<std::string> row;
      for (const auto& p : s.point()) row.push_back(p.second);
      if (!s.skipped().empty()) {
        row.push_back("skipped: ");
        row.back().append(s.skipped());
      } else {
        const Timing& t = s.timing();
        if (s.timed()) {
          row.push_back(format_time(t.median));
          row.push_back(format_time(t.min));
          row.push_back(format(100 * t.noise(), 1));
          row.back().append("%");
        } else {
          row.insert(row.end(), {"-", "-", "-"});
        }
        if (bytes) row.push_back(format(s.gbps(), 1));
        if (flops) row.push_back(format(s.tflops(), 2));
        for (const auto& c : columns) {
          const Summary* sum = s.find(c.first);
          row.push_back(sum ? format(sum->value, sum->precision) : std::string("-"));
        }
      }
      print_row(row);
    }
    std::printf("\n");
    std::fflush(stdout);
  }

  static nlohmann::json to_json(const Benchmark& b, const std::vector<State>& states, Runs runs) {
    nlohmann::json j{{"name", b.name()}, {"warmup", runs.warmup}, {"repeats", runs.repeats}, {"states", nlohmann::json::array()}};
    for (const Axis& a : b.axes()) j["axes"][a.name] = a.values;
    for (const State& s : states) {
      nlohmann::json state;
      for (const auto& [name, value] : s.point()) state["axes"][name] = value;
      if (!s.skipped().empty()) {
        state["skipped"] = s.skipped();
        j["states"].push_back(std::move(state));
        continue;
      }
      if (s.timed()) {
        const Timing& t = s.timing();
        state["timer"] = s.timer();
        state["seconds"] = {{"median", t.median}, {"min", t.min},         {"p10", t.p10},
                            {"p90", t.p90},       {"noise", t.noise()},   {"runs", t.seconds}};
      }
      if (s.bytes() > 0) state["bytes"] = s.bytes(), state["gbps"] = s.gbps();
      if (s.flops() > 0) state["flops"] = s.flops(), state["tflops"] = s.tflops();
      for (const Summary& sum : s.summaries()) std::visit([&](const auto& v) { state["summaries"][sum.key] = v; }, sum.value);
      j["states"].push_back(std::move(state));
    }
    return j;
  }

  std::string title_;
  std::deque<Benchmark> benchmarks_;  // add() hands out references that must stay valid
  HarnessOptions options_;
  nlohmann::json context_ = nlohmann::json::object();
};

}  // namespace cupipe::bench
