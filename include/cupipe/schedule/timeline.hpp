// SPDX-License-Identifier: Apache-2.0
// Timelines of executed or simulated schedules: an ASCII chart in the style of the PipeDream and
// Megatron-LM figures, and Chrome trace event JSON (Perfetto, chrome://tracing).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "cupipe/schedule/action.hpp"
#include "cupipe/schedule/simulate.hpp"

namespace cupipe::schedule {

/// One action as it ran (or was predicted to run). Times are in seconds or in unit time.
struct TimelineEvent {
  int stage;
  ActionKind kind;
  int microbatch;
  int chunk;
  double start;
  double end;
  bool overlap = false;  // an F that runs together with the stage's next action (Action::overlap)
};

/// The simulated events of a plan, in stage order.
inline std::vector<TimelineEvent> timeline_events(const Plan& plan, const SimResult& sim) {
  std::vector<TimelineEvent> events;
  for (std::size_t s = 0; s < plan.actions.size(); ++s)
    for (std::size_t i = 0; i < plan.actions[s].size(); ++i) {
      const Action& a = plan.actions[s][i];
      events.push_back(
          {static_cast<int>(s), a.kind, a.microbatch, a.chunk, sim.times[s][i].start, sim.times[s][i].end, a.overlap});
    }
  return events;
}

namespace detail {


/// "F3", or "F3b" for chunk 1 when stages hold several chunks; "F3b&" when it overlaps the next action.
inline std::string event_label(const TimelineEvent& e, bool with_chunk) {
  std::string label = kind_letter(e.kind) + std::to_string(e.microbatch);
  if (with_chunk) label += static_cast<char>('a' + e.chunk % 26);
  if (e.overlap) label += '&';
  return label;
}

}  // namespace detail

/// One row per stage, one column per `column` time units (0: the shortest event), each action shown
/// as its label followed by '~' for as long as it lasts; '.' is idle. At most `max_columns` wide:
/// longer timelines are scaled down.
inline std::string ascii_timeline(std::span<const TimelineEvent> events, int stages, double column = 0,
                                  int max_columns = 240) {
  if (events.empty() || stages < 1) return "(no events)\n";
  double begin = events.front().start, finish = events.front().end, shortest = 0;
  bool chunked = false;
  int widest = 1;
  for (const TimelineEvent& e : events) {
    begin = std::min(begin, e.start);
    finish = std::max(finish, e.end);
    if (e.end > e.start && (shortest == 0 || e.end - e.start < shortest)) shortest = e.end - e.start;
    chunked = chunked || e.chunk > 0;
  }
  for (const TimelineEvent& e : events) widest = std::max(widest, static_cast<int>(detail::event_label(e, chunked).size()));
  if (column <= 0) column = shortest > 0 ? shortest : 1;
  const int width = widest + 1;  // characters per column
  auto columns = static_cast<int>(std::ceil((finish - begin) / column - 1e-9));
  if (columns * width > max_columns) {
    column *= static_cast<double>(columns * width) / max_columns;
    columns = static_cast<int>(std::ceil((finish - begin) / column - 1e-9));
  }
  const std::string stage_prefix = "worker ";
  const int prefix = static_cast<int>(stage_prefix.size() + std::to_string(stages - 1).size()) + 2;
  std::string out;
  for (int s = 0; s < stages; ++s) {
    std::string row(static_cast<std::size_t>(columns * width), ' ');
    for (int col = 0; col < columns; ++col) row[static_cast<std::size_t>(col * width)] = '.';
    for (const TimelineEvent& e : events) {
      if (e.stage != s || e.end <= e.start) continue;
      // An action owns the columns whose midpoint it covers, and at least its first column.
      const auto first = static_cast<int>(std::floor((e.start - begin) / column + 0.5 - 1e-9));
      const auto last = std::max(first + 1, static_cast<int>(std::floor((e.end - begin) / column + 0.5 - 1e-9)));
      const std::string label = detail::event_label(e, chunked);
      for (int col = std::max(first, 0); col < std::min(last, columns); ++col) {
        const auto at = static_cast<std::size_t>(col * width);
        const std::string cell = col == first ? label : std::string(static_cast<std::size_t>(width - 1), '~');
        row.replace(at, static_cast<std::size_t>(width), cell + std::string(static_cast<std::size_t>(width) - cell.size(), ' '));
      }
    }
    std::string name = stage_prefix + std::to_string(s);
    name.resize(static_cast<std::size_t>(prefix - 2), ' ');
    while (!row.empty() && row.back() == ' ') row.pop_back();
    out += name + "| " + row + "\n";
  }
  char unit[64];
  std::snprintf(unit, sizeof unit, "%g", column);
  out += "legend: F<j> forward, B<j> backward (input gradient when W<j> appears), W<j> weight gradient of\n"
         "        microbatch j (0-based)";
  if (chunked) out += "; suffix a, b, ... = local chunk 0, 1, ...";
  out += "; ~ the action continues; . idle;\n        one column = " + std::string(unit) + " time units\n";
  return out;
}

/// Escapes a string for a JSON string literal.
inline std::string json_escape(std::string_view text) {
  std::string out;
  for (const char ch : text) {
    switch (ch) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\n': out += "\\n"; break;
      case '\t': out += "\\t"; break;
      case '\r': out += "\\r"; break;
      default:
        if (static_cast<unsigned char>(ch) < 0x20) {
          char code[8];
          std::snprintf(code, sizeof code, "\\u%04x", static_cast<unsigned>(static_cast<unsigned char>(ch)));
          out += code;
        } else {
          out += ch;
        }
    }
  }
  return out;
}

/// One process group in a Chrome trace: e.g. "measured" and "simulated (predicted)" side by side.
/// `microseconds_per_unit` converts event times: 1e6 for seconds; for unit time, any scale.
struct TraceGroup {
  std::string name;
  std::span<const TimelineEvent> events;
  double microseconds_per_unit = 1e6;
};

/// Chrome trace event JSON: a process per group, a thread per stage, one complete ("X") event per
/// action with its microbatch and chunk in args.
inline std::string chrome_trace_json(std::span<const TraceGroup> groups) {
  std::string out = "{\"displayTimeUnit\":\"ms\",\"traceEvents\":[";
  bool first = true;
  auto emit = [&](const std::string& event) {
    out += first ? "\n" : ",\n";
    out += event;
    first = false;
  };
  char number[64];
  auto fmt = [&number](double value) {
    std::snprintf(number, sizeof number, "%.6f", value);
    return std::string(number);
  };
  for (std::size_t g = 0; g < groups.size(); ++g) {
    const std::string pid = std::to_string(g + 1);
    emit("{\"name\":\"process_name\",\"ph\":\"M\",\"pid\":" + pid + ",\"args\":{\"name\":\"" +
         json_escape(groups[g].name) + "\"}}");
    emit("{\"name\":\"process_sort_index\",\"ph\":\"M\",\"pid\":" + pid + ",\"args\":{\"sort_index\":" + pid + "}}");
    int stages = 0;
    for (const TimelineEvent& e : groups[g].events) stages = std::max(stages, e.stage + 1);
    for (int s = 0; s < stages; ++s) {
      const std::string tid = std::to_string(s);
      emit("{\"name\":\"thread_name\",\"ph\":\"M\",\"pid\":" + pid + ",\"tid\":" + tid +
           ",\"args\":{\"name\":\"worker " + tid + "\"}}");
      emit("{\"name\":\"thread_sort_index\",\"ph\":\"M\",\"pid\":" + pid + ",\"tid\":" + tid +
           ",\"args\":{\"sort_index\":" + tid + "}}");
    }
    const double scale = groups[g].microseconds_per_unit;
    for (const TimelineEvent& e : groups[g].events) {
      const std::string kind(1, kind_letter(e.kind));
      emit("{\"name\":\"" + kind + std::to_string(e.microbatch) + "\",\"cat\":\"" + kind +
           "\",\"ph\":\"X\",\"pid\":" + pid + ",\"tid\":" + std::to_string(e.stage) + ",\"ts\":" + fmt(e.start * scale) +
           ",\"dur\":" + fmt((e.end - e.start) * scale) + ",\"args\":{\"microbatch\":" + std::to_string(e.microbatch) +
           ",\"chunk\":" + std::to_string(e.chunk) + (e.overlap ? ",\"overlaps_next\":true" : "") + "}}");
    }
  }
  out += "\n]}\n";
  return out;
}

/// A trace with one process group.
inline std::string chrome_trace_json(std::span<const TimelineEvent> events, std::string_view name,
                                     double microseconds_per_unit = 1e6) {
  const TraceGroup group{std::string(name), events, microseconds_per_unit};
  return chrome_trace_json(std::span<const TraceGroup>(&group, 1));
}

}  // namespace cupipe::schedule
