// SPDX-License-Identifier: Apache-2.0
// From what the workers recorded and the allocators counted to a StepStats: makespan, busy and idle
// per stage, the measured bubble, peak activation and weight bytes, and every action's times.
#pragma once

#include <algorithm>
#include <limits>
#include <utility>
#include <vector>

#include "cupipe/core/memory.hpp"
#include "cupipe/pipeline/stats.hpp"

namespace cupipe::pipeline {

/// `records[w]` are worker w's actions, `memory[w]` its context's allocator counts (null: another
/// process ran it, and its figures are in that process's StepStats, zero here); `peak_versions[w]`
/// the most weight versions it held. `timed`: the actions were timed (PipelineOptions::measure_actions);
/// otherwise the makespan and the bubble are NaN and busy, idle and actions empty.
inline StepStats measure_step(const std::vector<const std::vector<ActionRecord>*>& records,
                              const std::vector<const MemoryTracker*>& memory, const std::vector<int>& peak_versions,
                              bool timed = true) {
  StepStats stats;
  if (!timed) {
    stats.makespan_seconds = stats.bubble_fraction = std::numeric_limits<double>::quiet_NaN();
    for (std::size_t w = 0; w < memory.size(); ++w) {
      stats.peak_activation_bytes.push_back(memory[w] ? memory[w]->peak(MemoryTag::activations) : 0);
      stats.peak_weight_bytes.push_back(memory[w] ? memory[w]->peak(MemoryTag::weights) : 0);
      stats.peak_weight_versions.push_back(memory[w] ? peak_versions[w] : 0);
    }
    return stats;
  }
  double first = 1e300, last = 0;
  for (const auto* per_worker : records)
    if (per_worker)
      for (const ActionRecord& r : *per_worker) {
        first = std::min(first, r.start);
        last = std::max(last, r.end);
      }
  stats.makespan_seconds = last > first ? last - first : 0;
  double idle_total = 0;
  int measured = 0;
  for (std::size_t w = 0; w < memory.size(); ++w) {
    double busy = 0;
    if (memory[w]) {
      // The time covered by the worker's actions: an overlapped F&B pair on two streams of one device
      // (DualPipeV on CUDA) has intervals that overlap, and that time is counted once.
      std::vector<std::pair<double, double>> spans;
      spans.reserve(records[w]->size());
      for (const ActionRecord& r : *records[w]) spans.emplace_back(r.start, r.end);
      std::sort(spans.begin(), spans.end());
      double covered_to = -1e300;
      for (const auto& [start, end] : spans) {
        if (start >= covered_to) busy += end - start;
        else if (end > covered_to) busy += end - covered_to;
        covered_to = std::max(covered_to, end);
      }
      idle_total += stats.makespan_seconds - busy;
      ++measured;
      stats.actions.insert(stats.actions.end(), records[w]->begin(), records[w]->end());
    }
    stats.busy_seconds.push_back(busy);
    stats.idle_seconds.push_back(memory[w] ? stats.makespan_seconds - busy : 0);
    stats.peak_activation_bytes.push_back(memory[w] ? memory[w]->peak(MemoryTag::activations) : 0);
    stats.peak_weight_bytes.push_back(memory[w] ? memory[w]->peak(MemoryTag::weights) : 0);
    stats.peak_weight_versions.push_back(memory[w] ? peak_versions[w] : 0);
  }
  stats.bubble_fraction = stats.makespan_seconds > 0 ? idle_total / (measured * stats.makespan_seconds) : 0;
  return stats;
}

}  // namespace cupipe::pipeline
