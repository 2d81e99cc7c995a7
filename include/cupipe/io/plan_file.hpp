// SPDX-License-Identifier: Apache-2.0
// Schedule plans as CSV files: one row per action, so a plan can be written by hand or by another
// tool, checked by schedule::verify and simulate, and run with schedule::UserPlan. The explorer
// writes any policy's plan in this format (--write-plan) and reads one back (--plan).
//
//   # cupipe plan 1
//   # stages=2 microbatches=2 chunks=1 batches=1 split_backward=0 update=flush channel_depth=1
//   # placement=0.0,1.0
//   worker,kind,microbatch,chunk
//   0,F,0,0
//   ...
//
// `placement` lists, for each virtual stage in order, the worker and its local chunk (worker.chunk).
// Kind `F&` is an F that runs together with the worker's next row, a B (schedule::Action::overlap).
// Lines starting with '#' after the first two are comments; blank lines are skipped. Rows may come in
// any worker order; each worker's rows run in file order. Every malformed line is an error naming the
// file, the line and what is wrong; a plan that parses but cannot run fails schedule::verify, whose
// message names the two actions that conflict.
#pragma once

#include <charconv>
#include <filesystem>
#include <map>
#include <sstream>
#include <string>
#include <string_view>
#include <vector>

#include "cupipe/core/error.hpp"
#include "cupipe/io/atomic_file.hpp"
#include "cupipe/io/tokens.hpp"
#include "cupipe/schedule/action.hpp"
#include "cupipe/schedule/placement.hpp"

namespace cupipe::io {

namespace detail {

inline constexpr std::string_view plan_magic = "# cupipe plan 1";
inline constexpr std::string_view plan_columns = "worker,kind,microbatch,chunk";

inline std::string_view update_name(schedule::UpdateRule rule) {
  switch (rule) {
    case schedule::UpdateRule::flush: return "flush";
    case schedule::UpdateRule::per_microbatch: return "per_microbatch";
    case schedule::UpdateRule::double_buffered: return "double_buffered";
  }
  return "flush";
}

inline std::string_view trim(std::string_view s) {
  while (!s.empty() && (s.front() == ' ' || s.front() == '\t')) s.remove_prefix(1);
  while (!s.empty() && (s.back() == ' ' || s.back() == '\t' || s.back() == '\r')) s.remove_suffix(1);
  return s;
}

inline std::vector<std::string_view> split(std::string_view s, char separator) {
  std::vector<std::string_view> parts;
  for (std::size_t start = 0;;) {
    const std::size_t end = s.find(separator, start);
    parts.push_back(trim(s.substr(start, end == std::string_view::npos ? std::string_view::npos : end - start)));
    if (end == std::string_view::npos) return parts;
    start = end + 1;
  }
}

/// Reads one plan file's text; `where(line)` prefixes every error.
class PlanParser {
 public:
  PlanParser(std::string_view text, std::string source) : text_(text), source_(std::move(source)) {}

  schedule::Plan parse() {
    std::size_t line_start = 0;
    for (int line = 1; line_start <= text_.size(); ++line) {
      const std::size_t end = text_.find('\n', line_start);
      const std::string_view raw = text_.substr(line_start, end == std::string_view::npos ? std::string_view::npos : end - line_start);
      line_start = end == std::string_view::npos ? text_.size() + 1 : end + 1;
      take(line, trim(raw));
    }
    if (state_ != State::rows) fail(0, state_ == State::magic ? "the file is empty (expected a first line '" +
                                                                     std::string(plan_magic) + "')"
                                                               : "the file ends before the column line '" +
                                                                     std::string(plan_columns) + "'");
    return finish();
  }

 private:
  enum class State { magic, settings, columns, rows };

  [[noreturn]] void fail(int line, const std::string& what) const {
    if (line > 0) CUPIPE_THROW(source_, " line ", line, ": ", what);
    CUPIPE_THROW(source_, ": ", what);
  }

  int integer(int line, std::string_view field, std::string_view name) const {
    int value = 0;
    const auto [end, ec] = std::from_chars(field.data(), field.data() + field.size(), value);
    if (field.empty() || ec != std::errc{} || end != field.data() + field.size())
      fail(line, std::string(name) + " '" + std::string(field) + "' is not an integer");
    return value;
  }

  void take(int line, std::string_view s) {
    switch (state_) {
      case State::magic:
        if (s != plan_magic) fail(line, "expected '" + std::string(plan_magic) + "' as the first line, found '" + std::string(s) + "'");
        state_ = State::settings;
        return;
      case State::settings:
      case State::columns:
        if (s.empty()) return;
        if (s.front() == '#') return setting(line, trim(s.substr(1)));
        if (s != plan_columns) fail(line, "expected the column line '" + std::string(plan_columns) + "', found '" + std::string(s) + "'");
        for (const char* key : {"stages", "microbatches", "chunks", "placement"})
          if (!settings_.count(key)) fail(line, std::string("the settings lines before it name no ") + key);
        start_plan(line);
        state_ = State::rows;
        return;
      case State::rows:
        if (s.empty() || s.front() == '#') return;
        row(line, s);
        return;
    }
  }

  void setting(int line, std::string_view s) {
    for (const std::string_view pair : split(s, ' ')) {
      if (pair.empty()) continue;
      const std::size_t eq = pair.find('=');
      if (eq == std::string_view::npos) continue;  // a comment's words
      settings_[std::string(pair.substr(0, eq))] = {std::string(pair.substr(eq + 1)), line};
    }
  }

  int setting_int(std::string_view key, int fallback) const {
    const auto it = settings_.find(std::string(key));
    if (it == settings_.end()) return fallback;
    return integer(it->second.line, it->second.value, key);
  }

  void start_plan(int line) {
    schedule::Config& c = plan_.config;
    c.stages = setting_int("stages", 0);
    c.microbatches = setting_int("microbatches", 0);
    c.chunks = setting_int("chunks", 1);
    c.batches = setting_int("batches", 1);
    if (c.stages < 1 || c.microbatches < 1 || c.chunks < 1 || c.batches < 1)
      fail(line, "stages, microbatches, chunks and batches must be at least 1 (got stages=" + std::to_string(c.stages) +
                     " microbatches=" + std::to_string(c.microbatches) + " chunks=" + std::to_string(c.chunks) +
                     " batches=" + std::to_string(c.batches) + ")");
    plan_.split_backward = setting_int("split_backward", 0) != 0;
    plan_.channel_depth = setting_int("channel_depth", 1);
    if (const auto it = settings_.find("update"); it != settings_.end()) {
      const std::string& u = it->second.value;
      if (u == "flush") plan_.update = schedule::UpdateRule::flush;
      else if (u == "per_microbatch") plan_.update = schedule::UpdateRule::per_microbatch;
      else if (u == "double_buffered") plan_.update = schedule::UpdateRule::double_buffered;
      else fail(it->second.line, "update '" + u + "' is not flush, per_microbatch or double_buffered");
    } else {
      plan_.update = schedule::UpdateRule::flush;
    }
    const Entry& where = settings_.at("placement");
    const std::vector<std::string_view> cells = split(where.value, ',');
    if (int(cells.size()) != c.virtual_stages())
      fail(where.line, "placement lists " + std::to_string(cells.size()) + " virtual stages, expected stages x chunks = " +
                           std::to_string(c.virtual_stages()));
    std::vector<schedule::detail::WorkerChunk> located;
    std::vector<char> taken(std::size_t(c.virtual_stages()), 0);
    for (std::size_t k = 0; k < cells.size(); ++k) {
      const std::size_t dot = cells[k].find('.');
      if (dot == std::string_view::npos)
        fail(where.line, "placement entry " + std::to_string(k) + " '" + std::string(cells[k]) + "' is not worker.chunk");
      const int w = integer(where.line, cells[k].substr(0, dot), "a placement worker");
      const int ch = integer(where.line, cells[k].substr(dot + 1), "a placement chunk");
      if (w < 0 || w >= c.stages || ch < 0 || ch >= c.chunks)
        fail(where.line, "placement entry " + std::to_string(k) + " '" + std::string(cells[k]) + "' is outside " +
                             std::to_string(c.stages) + " workers x " + std::to_string(c.chunks) + " chunks");
      char& seen = taken[std::size_t(w * c.chunks + ch)];
      if (seen) fail(where.line, "placement gives worker " + std::to_string(w) + " chunk " + std::to_string(ch) + " twice");
      seen = 1;
      located.push_back({w, ch});
    }
    plan_.placement = schedule::detail::placement_from(c.stages, c.chunks, [&](int k) { return located[std::size_t(k)]; });
    plan_.actions.assign(std::size_t(c.stages), {});
  }

  void row(int line, std::string_view s) {
    const std::vector<std::string_view> f = split(s, ',');
    if (f.size() != 4) fail(line, "expected 4 fields (" + std::string(plan_columns) + "), found " + std::to_string(f.size()));
    const int worker = integer(line, f[0], "worker");
    if (worker < 0 || worker >= plan_.config.stages)
      fail(line, "worker " + std::to_string(worker) + " is outside 0.." + std::to_string(plan_.config.stages - 1));
    schedule::ActionKind kind{};
    const bool overlap = f[1] == "F&";
    if (f[1] == "F" || overlap) kind = schedule::ActionKind::F;
    else if (f[1] == "B") kind = schedule::ActionKind::B;
    else if (f[1] == "W") kind = schedule::ActionKind::W;
    else fail(line, "kind '" + std::string(f[1]) + "' is not F, F& (overlapped with the next B), B or W");
    const int microbatch = integer(line, f[2], "microbatch");
    const int chunk = integer(line, f[3], "chunk");
    // Ranges, duplicates and order are verify's to judge, with the actions named; only what would
    // make the plan unreadable is refused here.
    plan_.actions[std::size_t(worker)].push_back({kind, microbatch, chunk, overlap});
  }

  schedule::Plan finish() { return std::move(plan_); }

  struct Entry {
    std::string value;
    int line = 0;
  };
  std::string_view text_;
  std::string source_;
  State state_ = State::magic;
  std::map<std::string, Entry, std::less<>> settings_;
  schedule::Plan plan_{{}, {}, false, schedule::UpdateRule::flush, {}};
};

}  // namespace detail

/// The plan as CSV text (the format above).
inline std::string plan_to_csv(const schedule::Plan& plan) {
  const schedule::Config& c = plan.config;
  std::ostringstream out;
  out << detail::plan_magic << "\n# stages=" << c.stages << " microbatches=" << c.microbatches << " chunks=" << c.chunks
      << " batches=" << c.batches << " split_backward=" << (plan.split_backward ? 1 : 0)
      << " update=" << detail::update_name(plan.update) << " channel_depth=" << plan.channel_depth << "\n# placement=";
  for (int k = 0; k < c.virtual_stages(); ++k)
    out << (k ? "," : "") << plan.placement.worker_of(k) << '.' << plan.placement.chunk_of(k);
  out << '\n' << detail::plan_columns << '\n';
  for (std::size_t w = 0; w < plan.actions.size(); ++w)
    for (const schedule::Action& a : plan.actions[w])
      out << w << ',' << schedule::kind_letter(a.kind) << (a.overlap ? "&" : "") << ',' << a.microbatch << ','
          << a.chunk << '\n';
  return out.str();
}

/// Parses CSV text; `source` names it in errors (a path, or "<text>").
inline schedule::Plan plan_from_csv(std::string_view text, std::string source = "<plan text>") {
  return detail::PlanParser(text, std::move(source)).parse();
}

/// Reads a plan file. Errors name the file and the line.
inline schedule::Plan load_plan(const std::filesystem::path& file) {
  const std::vector<char> bytes = detail::read_all(file);
  return plan_from_csv(std::string_view(bytes.data(), bytes.size()), file.string());
}

/// Writes a plan file atomically: after a crash the file holds the old plan or all of the new one.
inline void save_plan(const schedule::Plan& plan, const std::filesystem::path& file) {
  const std::string text = plan_to_csv(plan);
  write_file_atomically(file, [&](FileSink& sink) { sink.write(text.data(), text.size()); });
}

}  // namespace cupipe::io
