// SPDX-License-Identifier: Apache-2.0
// A small benchmark harness in the spirit of nvbench: warm-up, an L2 flush before every timed run,
// CUDA-event timing, the median of N runs, and for each benchmark the bytes it must move and the
// FLOPs it must do, so the report shows GB/s or TFLOP/s and the percentage of a ceiling measured on
// the same device in the same run. Output: a markdown table on stdout and, optionally, JSON.
#pragma once

#include <cuda_runtime_api.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cstddef>
#include <cstdio>
#include <fstream>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "cupipe/backend/cuda/check.cuh"
#include "cupipe/backend/cuda/stream.cuh"

namespace cupipe::bench {

struct Timing {
  double median_ms = 0;
  double min_ms = 0;
  int runs = 0;
};

/// One measured line of the report.
struct Result {
  std::string group;            // "layernorm", "gemm", ...
  std::string name;             // "forward", "qkv (tf32)", ...
  std::string shape;            // "(8192, 768)"
  Timing timing;
  double bytes = 0;             // the fewest bytes the op must move (each input read once, each output written once)
  double flops = 0;
  std::string ceiling;          // which ceiling the op is held against
  double ceiling_value = 0;     // GB/s for bandwidth ceilings, TFLOP/s for GEMM ceilings
  double reference_ms = 0;      // GEMM: the fastest cuBLASLt heuristic candidate for the same problem (0: none)

  double gbps() const { return timing.median_ms > 0 ? bytes / (timing.median_ms * 1e-3) / 1e9 : 0; }
  double tflops() const { return timing.median_ms > 0 ? flops / (timing.median_ms * 1e-3) / 1e12 : 0; }
  bool compute_bound() const { return flops > 0 && bytes == 0; }
  double achieved() const { return compute_bound() ? tflops() : gbps(); }
  double percent_of_ceiling() const { return ceiling_value > 0 ? 100.0 * achieved() / ceiling_value : 0; }
  /// Best heuristic's time over ours: 1.0 means as fast as the best candidate.
  double ratio_to_reference() const { return reference_ms > 0 ? reference_ms / timing.median_ms : 0; }
};

class Harness {
 public:
  Harness(cudaStream_t stream, std::size_t l2_bytes, int warmup, int repeats)
      : stream_(stream), warmup_(warmup), repeats_(repeats), start_(true), stop_(true) {
    flush_bytes_ = std::max<std::size_t>(2 * l2_bytes, std::size_t(64) << 20);
    CUPIPE_CHECK_CUDA(cudaMalloc(&flush_, flush_bytes_));
  }
  Harness(const Harness&) = delete;
  Harness& operator=(const Harness&) = delete;
  ~Harness() { (void)cudaFree(flush_); }

  /// Evicts L2 by writing a buffer twice its size, so every timed run starts from device memory.
  void flush_l2() { CUPIPE_CHECK_CUDA(cudaMemsetAsync(flush_, ++flush_value_ & 0xff, flush_bytes_, stream_)); }

  /// Times `launch`, which enqueues its work on the harness's stream.
  template <class F>
  Timing time(F&& launch) {
    for (int i = 0; i < warmup_; ++i) launch();
    CUPIPE_CHECK_CUDA(cudaStreamSynchronize(stream_));
    std::vector<double> ms;
    for (int i = 0; i < repeats_; ++i) {
      flush_l2();
      start_.record(stream_);
      launch();
      stop_.record(stream_);
      stop_.synchronize();
      ms.push_back(stop_.elapsed_ms_since(start_));
    }
    std::sort(ms.begin(), ms.end());
    const std::size_t n = ms.size();
    const double median = n % 2 ? ms[n / 2] : 0.5 * (ms[n / 2 - 1] + ms[n / 2]);
    return {median, ms.front(), int(n)};
  }

  void add(Result result) {
    print_line(result);
    results_.push_back(std::move(result));
  }
  void set_ceiling(const std::string& name, double value, const std::string& unit) { ceilings_[name] = {value, unit}; }
  double ceiling(const std::string& name) const {
    const auto it = ceilings_.find(name);
    return it == ceilings_.end() ? 0 : it->second.first;
  }

  void print_header() const {
    std::printf("| group | op | shape | median (us) | min (us) | GB/s | TFLOP/s | vs ceiling | %% of ceiling | best heuristic / ours |\n");
    std::printf("|---|---|---|---:|---:|---:|---:|---|---:|---:|\n");
    std::fflush(stdout);
  }

  void write_json(const std::string& path, const nlohmann::json& device) const {
    nlohmann::json out;
    out["device"] = device;
    out["method"] = {{"warmup", warmup_}, {"repeats", repeats_}, {"statistic", "median"},
                     {"l2_flush_bytes", flush_bytes_}, {"timer", "cudaEventElapsedTime"}};
    for (const auto& [name, value] : ceilings_) out["ceilings"][name] = {{"value", value.first}, {"unit", value.second}};
    for (const Result& r : results_) {
      nlohmann::json j{{"group", r.group},       {"name", r.name},
                       {"shape", r.shape},       {"median_us", r.timing.median_ms * 1e3},
                       {"min_us", r.timing.min_ms * 1e3}, {"runs", r.timing.runs},
                       {"bytes", r.bytes},       {"flops", r.flops},
                       {"gbps", r.gbps()},       {"tflops", r.tflops()},
                       {"ceiling", r.ceiling},   {"percent_of_ceiling", r.percent_of_ceiling()}};
      if (r.reference_ms > 0) {
        j["best_heuristic_us"] = r.reference_ms * 1e3;
        j["ratio_best_heuristic_over_ours"] = r.ratio_to_reference();
      }
      out["results"].push_back(std::move(j));
    }
    std::ofstream file(path);
    CUPIPE_REQUIRE(file.good(), "bench: cannot write ", path);
    file << out.dump(2) << "\n";
    CUPIPE_REQUIRE(file.good(), "bench: writing ", path, " failed");
  }

 private:
  static void print_line(const Result& r) {
    char ratio[32] = "";
    if (r.reference_ms > 0) std::snprintf(ratio, sizeof ratio, "%.3f", r.ratio_to_reference());
    std::printf("| %s | %s | %s | %.1f | %.1f | %.1f | %.2f | %s | %.1f | %s |\n", r.group.c_str(), r.name.c_str(),
                r.shape.c_str(), r.timing.median_ms * 1e3, r.timing.min_ms * 1e3, r.gbps(), r.tflops(),
                r.ceiling.c_str(), r.percent_of_ceiling(), ratio);
    std::fflush(stdout);
  }

  cudaStream_t stream_;
  int warmup_, repeats_;
  gpu::Event start_, stop_;
  void* flush_ = nullptr;
  std::size_t flush_bytes_ = 0;
  int flush_value_ = 0;
  std::vector<Result> results_;
  std::map<std::string, std::pair<double, std::string>> ceilings_;
};

}  // namespace cupipe::bench
