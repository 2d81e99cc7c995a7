// SPDX-License-Identifier: Apache-2.0
// Schedule plans as CSV or JSON files: one row (or object) per action, so a plan can be written by
// hand or by another tool, checked by schedule::verify and simulate, and run with schedule::UserPlan.
// The explorer writes any policy's plan in either format (--write-plan) and reads one back (--plan);
// load_plan and save_plan pick the format by the file's extension (.json: JSON, anything else: CSV).
//
// CSV:
//   # cupipe plan 1
//   # stages=2 microbatches=2 chunks=1 batches=1 split_backward=0 update=flush channel_depth=1
//   # placement=0.0,1.0
//   worker,kind,microbatch,chunk
//   0,F,0,0
//   ...
//
// JSON (the same fields; chunks, batches, split_backward, update and channel_depth may be left out):
//   {"format": "cupipe plan", "version": 1, "stages": 2, "microbatches": 2, "chunks": 1, "batches": 1,
//    "split_backward": false, "update": "flush", "channel_depth": 1, "placement": [[0, 0], [1, 0]],
//    "actions": [{"worker": 0, "kind": "F", "microbatch": 0, "chunk": 0}, ...]}
//
// `placement` lists, for each virtual stage in order, the worker and its local chunk (CSV:
// worker.chunk). Kind `F&` is an F that runs together with the worker's next action, a B
// (schedule::Action::overlap). In CSV, lines starting with '#' after the first two are comments and
// blank lines are skipped. Actions may come in any worker order; each worker's actions run in file
// order. Every malformed line or field is an error naming the file and the line (CSV) or the field
// (JSON, e.g. "actions[12].kind"); a plan that parses but cannot run fails schedule::verify, whose
// message names the two actions that conflict. Counts that overflow the schedule code's int tables,
// or that need more actions (an F and a B per virtual stage and microbatch) than the file lists,
// and JSON nested deeper than 8 levels, are refused here (issue #61's fuzzing).
#pragma once

#include <algorithm>
#include <charconv>
#include <filesystem>
#include <initializer_list>
#include <limits>
#include <map>
#include <optional>
#include <sstream>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

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

// What both formats check the same way. `fail(what)` throws, prefixed with where the value came from.

/// Throws `what` after a prefix naming the file and the line or field.
struct FailAt {
  std::string prefix;
  [[noreturn]] void operator()(const std::string& what) const { CUPIPE_THROW(prefix, what); }
};

/// The schedule code indexes its per-action tables in int: 3 x virtual stages x microbatches slots.
inline constexpr long long max_plan_action_slots = std::numeric_limits<int>::max();

inline void check_counts(const schedule::Config& c, const FailAt& fail) {
  const std::string counts = "stages=" + std::to_string(c.stages) + " microbatches=" + std::to_string(c.microbatches) +
                             " chunks=" + std::to_string(c.chunks) + " batches=" + std::to_string(c.batches);
  if (c.stages < 1 || c.microbatches < 1 || c.chunks < 1 || c.batches < 1)
    fail("stages, microbatches, chunks and batches must be at least 1 (got " + counts + ")");
  // In long long: each count fits an int, their products may not.
  const long long virtual_stages = 1LL * c.stages * c.chunks, microbatches = 1LL * c.microbatches * c.batches;
  if (virtual_stages > max_plan_action_slots / 3 || microbatches > max_plan_action_slots / 3 ||
      3 * virtual_stages * microbatches > max_plan_action_slots)
    fail("stages x chunks x microbatches x batches is too large for a plan (got " + counts + "; 3 x the product must be at most " +
         std::to_string(max_plan_action_slots) + ")");
}

/// A plan holds an F and a B for every virtual stage and microbatch: counts that need more actions
/// than the file lists are refused here, before verify sizes its tables by them.
inline void check_listed(const schedule::Plan& plan, const FailAt& fail) {
  const schedule::Config& c = plan.config;
  const long long needed = 2LL * c.virtual_stages() * c.total_microbatches();
  long long listed = 0;
  for (const auto& worker : plan.actions) listed += static_cast<long long>(worker.size());
  if (listed < needed)
    fail("the plan's " + std::to_string(c.virtual_stages()) + " virtual stages x " + std::to_string(c.total_microbatches()) +
         " microbatches need at least " + std::to_string(needed) + " actions (an F and a B each), but it lists " +
         std::to_string(listed));
}

inline schedule::UpdateRule parse_update(std::string_view u, const FailAt& fail) {
  if (u == "per_microbatch") return schedule::UpdateRule::per_microbatch;
  if (u == "double_buffered") return schedule::UpdateRule::double_buffered;
  if (u != "flush") fail("update '" + std::string(u) + "' is not flush, per_microbatch or double_buffered");
  return schedule::UpdateRule::flush;
}

/// The placement from (worker, chunk) per virtual stage: one per virtual stage, in range, no repeats.
inline schedule::Placement checked_placement(const schedule::Config& c, const std::vector<schedule::detail::WorkerChunk>& located,
                                      const FailAt& fail) {
  if (int(located.size()) != c.virtual_stages())
    fail("placement lists " + std::to_string(located.size()) + " virtual stages, expected stages x chunks = " +
         std::to_string(c.virtual_stages()));
  std::vector<char> taken(std::size_t(c.virtual_stages()), 0);
  for (std::size_t k = 0; k < located.size(); ++k) {
    const auto [w, ch] = located[k];
    if (w < 0 || w >= c.stages || ch < 0 || ch >= c.chunks)
      fail("placement entry " + std::to_string(k) + " '" + std::to_string(w) + "." + std::to_string(ch) + "' is outside " +
           std::to_string(c.stages) + " workers x " + std::to_string(c.chunks) + " chunks");
    char& seen = taken[std::size_t(w * c.chunks + ch)];
    if (seen) fail("placement gives worker " + std::to_string(w) + " chunk " + std::to_string(ch) + " twice");
    seen = 1;
  }
  return schedule::detail::placement_from(c.stages, c.chunks, [&](int k) { return located[std::size_t(k)]; });
}

/// One action of worker `worker` (checked against the plan's workers) with kind F, F&, B or W.
/// Microbatch and chunk ranges, duplicates and order are verify's to judge, with the actions named;
/// only what would make the plan unreadable is refused here.
inline schedule::Action parse_action(int workers, int worker, std::string_view kind, int microbatch, int chunk, const FailAt& fail) {
  if (worker < 0 || worker >= workers)
    fail("worker " + std::to_string(worker) + " is outside 0.." + std::to_string(workers - 1));
  const bool overlap = kind == "F&";
  schedule::ActionKind k = schedule::ActionKind::F;
  if (kind == "B") k = schedule::ActionKind::B;
  else if (kind == "W") k = schedule::ActionKind::W;
  else if (kind != "F" && !overlap) fail("kind '" + std::string(kind) + "' is not F, F& (overlapped with the next B), B or W");
  return {k, microbatch, chunk, overlap};
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
    check_counts(c, at(line));
    plan_.split_backward = setting_int("split_backward", 0) != 0;
    plan_.channel_depth = setting_int("channel_depth", 1);
    if (const auto it = settings_.find("update"); it != settings_.end())
      plan_.update = parse_update(it->second.value, at(it->second.line));
    else
      plan_.update = schedule::UpdateRule::flush;
    const Entry& where = settings_.at("placement");
    std::vector<schedule::detail::WorkerChunk> located;
    for (const std::string_view cell : split(where.value, ',')) {
      const std::size_t dot = cell.find('.');
      if (dot == std::string_view::npos)
        fail(where.line, "placement entry " + std::to_string(located.size()) + " '" + std::string(cell) + "' is not worker.chunk");
      located.push_back({integer(where.line, cell.substr(0, dot), "a placement worker"),
                         integer(where.line, cell.substr(dot + 1), "a placement chunk")});
    }
    plan_.placement = checked_placement(c, located, at(where.line));
    plan_.actions.assign(std::size_t(c.stages), {});
  }

  /// A fail(what) for the shared checks, at `line`.
  FailAt at(int line) const { return {source_ + " line " + std::to_string(line) + ": "}; }

  void row(int line, std::string_view s) {
    const std::vector<std::string_view> f = split(s, ',');
    if (f.size() != 4) fail(line, "expected 4 fields (" + std::string(plan_columns) + "), found " + std::to_string(f.size()));
    const int worker = integer(line, f[0], "worker");
    const int microbatch = integer(line, f[2], "microbatch");
    const int chunk = integer(line, f[3], "chunk");
    const schedule::Action a = parse_action(plan_.config.stages, worker, f[1], microbatch, chunk, at(line));
    plan_.actions[std::size_t(worker)].push_back(a);
  }

  schedule::Plan finish() {
    check_listed(plan_, {source_ + ": "});
    return std::move(plan_);
  }

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

namespace detail {

inline constexpr int max_plan_depth = 8;

/// Reads a plan's JSON document; every error names `source` and the field.
class JsonPlanReader {
 public:
  explicit JsonPlanReader(std::string source) : source_(std::move(source)) {}

  schedule::Plan read(std::string_view text) const {
    nlohmann::json doc;
    // A plan nests 3 deep (the document, actions or placement, an entry); the messages below print
    // values with nlohmann's recursive dump(), which a file nesting 300,000 arrays would overflow.
    const auto shallow = [&](int depth, nlohmann::json::parse_event_t, nlohmann::json&) {
      if (depth > max_plan_depth) CUPIPE_THROW(source_, ": the JSON nests deeper than ", max_plan_depth, " levels; a plan needs 3");
      return true;
    };
    try {
      doc = nlohmann::json::parse(text.begin(), text.end(), shallow);
    } catch (const nlohmann::json::exception& e) {  // a syntax error, or a number beyond a double (1e400)
      CUPIPE_THROW(source_, ": not a JSON plan: ", e.what());
    }
    if (!doc.is_object()) fail("", "expected a JSON object with \"format\": \"cupipe plan\", found " + kind_of(doc));
    if (!doc.contains("format") || doc["format"] != "cupipe plan")
      fail("format", "expected \"cupipe plan\"" + found(doc, "format"));
    if (integer(doc, "version", std::nullopt) != 1) fail("version", "expected 1" + found(doc, "version"));
    only_known(doc, "", {"format", "version", "stages", "microbatches", "chunks", "batches", "split_backward", "update",
                         "channel_depth", "placement", "actions"});

    schedule::Plan plan{{}, {}, false, schedule::UpdateRule::flush, {}};
    schedule::Config& c = plan.config;
    c.stages = integer(doc, "stages", std::nullopt);
    c.microbatches = integer(doc, "microbatches", std::nullopt);
    c.chunks = integer(doc, "chunks", 1);
    c.batches = integer(doc, "batches", 1);
    check_counts(c, at(""));
    plan.channel_depth = integer(doc, "channel_depth", 1);
    if (doc.contains("split_backward")) {
      if (!doc["split_backward"].is_boolean()) fail("split_backward", "expected true or false" + found(doc, "split_backward"));
      plan.split_backward = doc["split_backward"].get<bool>();
    }
    if (doc.contains("update")) {
      if (!doc["update"].is_string()) fail("update", "expected a string" + found(doc, "update"));
      plan.update = parse_update(doc["update"].get<std::string>(), at("update"));
    }

    const nlohmann::json& placement = array(doc, "placement");
    std::vector<schedule::detail::WorkerChunk> located;
    for (std::size_t k = 0; k < placement.size(); ++k) {
      const std::string where = "placement[" + std::to_string(k) + "]";
      const nlohmann::json& entry = placement[k];
      if (!entry.is_array() || entry.size() != 2 || !small_integer(entry[0]) || !small_integer(entry[1]))
        fail(where, "expected [worker, chunk], found " + entry.dump());
      located.push_back({entry[0].get<int>(), entry[1].get<int>()});
    }
    plan.placement = checked_placement(c, located, at(""));

    plan.actions.assign(std::size_t(c.stages), {});
    const nlohmann::json& actions = array(doc, "actions");
    for (std::size_t i = 0; i < actions.size(); ++i) {
      const std::string where = "actions[" + std::to_string(i) + "]";
      const nlohmann::json& a = actions[i];
      if (!a.is_object()) fail(where, "expected {\"worker\", \"kind\", \"microbatch\", \"chunk\"}, found " + a.dump());
      only_known(a, where, {"worker", "kind", "microbatch", "chunk"});
      if (!a.contains("kind") || !a["kind"].is_string()) fail(where + ".kind", "expected \"F\", \"F&\", \"B\" or \"W\"" + found(a, "kind"));
      const int worker = integer(a, "worker", std::nullopt, where + ".");
      const schedule::Action action = parse_action(c.stages, worker, a["kind"].get<std::string>(), integer(a, "microbatch", std::nullopt, where + "."),
                                                   integer(a, "chunk", std::nullopt, where + "."), at(where));
      plan.actions[std::size_t(worker)].push_back(action);
    }
    check_listed(plan, at("actions"));
    return plan;
  }

 private:
  [[noreturn]] void fail(const std::string& field, const std::string& what) const {
    if (field.empty()) CUPIPE_THROW(source_, ": ", what);
    CUPIPE_THROW(source_, ": ", field, ": ", what);
  }

  FailAt at(const std::string& field) const { return {source_ + ": " + (field.empty() ? "" : field + ": ")}; }

  /// A misspelt field would otherwise be skipped and its default used.
  void only_known(const nlohmann::json& object, const std::string& where, std::initializer_list<std::string_view> known) const {
    for (const auto& item : object.items())
      if (std::find(known.begin(), known.end(), item.key()) == known.end()) {
        std::string list;
        for (const std::string_view k : known) list += (list.empty() ? "" : ", ") + std::string(k);
        fail(where, "unknown field '" + item.key() + "' (expected " + list + ")");
      }
  }

  static std::string kind_of(const nlohmann::json& value) { return std::string(value.type_name()); }

  static std::string found(const nlohmann::json& object, const char* key) {
    if (!object.contains(key)) return ", but it is missing";
    return ", found " + object[key].dump();
  }

  int integer(const nlohmann::json& object, const char* key, std::optional<int> fallback, const std::string& prefix = "") const {
    if (!object.contains(key)) {
      if (fallback) return *fallback;
      fail("", "field '" + prefix + key + "' is missing");
    }
    const nlohmann::json& value = object[key];
    if (!small_integer(value)) fail(prefix + key, "expected an integer, found " + value.dump());
    return value.get<int>();
  }

  /// An integer within +-2^30, so that get<int>() reads what the file says: 2^40 would wrap to 0, and
  /// an unsigned 2^64 - 1 to -1.
  static bool small_integer(const nlohmann::json& value) {
    if (value.is_number_unsigned()) return value.get<unsigned long long>() <= (1ULL << 30);
    return value.is_number_integer() && value.get<long long>() >= -(1LL << 30) && value.get<long long>() <= (1LL << 30);
  }

  const nlohmann::json& array(const nlohmann::json& object, const char* key) const {
    if (!object.contains(key)) fail("", std::string("field '") + key + "' is missing");
    if (!object[key].is_array()) fail(key, "expected an array, found " + kind_of(object[key]));
    return object[key];
  }

  std::string source_;
};

inline bool is_json_path(const std::filesystem::path& file) { return file.extension() == ".json"; }

}  // namespace detail

/// The plan as JSON text (the format above): one action per line, so a diff of two plans reads well.
inline std::string plan_to_json(const schedule::Plan& plan) {
  const schedule::Config& c = plan.config;
  std::ostringstream out;
  out << "{\n  \"format\": \"cupipe plan\",\n  \"version\": 1,\n  \"stages\": " << c.stages
      << ",\n  \"microbatches\": " << c.microbatches << ",\n  \"chunks\": " << c.chunks << ",\n  \"batches\": " << c.batches
      << ",\n  \"split_backward\": " << (plan.split_backward ? "true" : "false") << ",\n  \"update\": \""
      << detail::update_name(plan.update) << "\",\n  \"channel_depth\": " << plan.channel_depth << ",\n  \"placement\": [";
  for (int k = 0; k < c.virtual_stages(); ++k)
    out << (k ? ", " : "") << '[' << plan.placement.worker_of(k) << ", " << plan.placement.chunk_of(k) << ']';
  out << "],\n  \"actions\": [";
  bool first = true;
  for (std::size_t w = 0; w < plan.actions.size(); ++w)
    for (const schedule::Action& a : plan.actions[w]) {
      out << (first ? "\n" : ",\n") << "    {\"worker\": " << w << ", \"kind\": \"" << schedule::kind_letter(a.kind)
          << (a.overlap ? "&" : "") << "\", \"microbatch\": " << a.microbatch << ", \"chunk\": " << a.chunk << '}';
      first = false;
    }
  out << "\n  ]\n}\n";
  return out.str();
}

/// Parses JSON text; `source` names it in errors (a path, or "<text>").
inline schedule::Plan plan_from_json(std::string_view text, std::string source = "<plan text>") {
  return detail::JsonPlanReader(std::move(source)).read(text);
}

/// Reads a plan file: JSON when its name ends in .json, CSV otherwise. Errors name the file and the
/// line (CSV) or field (JSON).
inline schedule::Plan load_plan(const std::filesystem::path& file) {
  const std::vector<char> bytes = detail::read_all(file);
  const std::string_view text(bytes.data(), bytes.size());
  return detail::is_json_path(file) ? plan_from_json(text, file.string()) : plan_from_csv(text, file.string());
}

/// Writes a plan file atomically, as JSON when its name ends in .json and CSV otherwise: after a
/// crash the file holds the old plan or all of the new one.
inline void save_plan(const schedule::Plan& plan, const std::filesystem::path& file) {
  const std::string text = detail::is_json_path(file) ? plan_to_json(plan) : plan_to_csv(plan);
  write_file_atomically(file, [&](FileSink& sink) { sink.write(text.data(), text.size()); });
}

}  // namespace cupipe::io
