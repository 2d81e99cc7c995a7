// SPDX-License-Identifier: Apache-2.0
// Checkpoints as two safetensors files, both by layer and not by stage, so that a checkpoint written
// with one schedule and stage count loads into any other:
//   <prefix>.safetensors        the model: PyTorch state_dict names and layouts ("0.weight" [out, in],
//                               "0.bias", ...), so torch.nn.Sequential.load_state_dict accepts it;
//   <prefix>.state.safetensors  the training state: optimizer slots per parameter
//                               ("0.weight.exp_avg", ...), and in its metadata the optimizer, update
//                               count, RNG state and data position.
// Both carry a checksum of their contents in their metadata: safetensors has none, and a flipped
// bit in the data would otherwise load silently.
// Each file is written atomically, and both are complete before either replaces the old one. The
// two carry the same save id. A crash (kill -9, power loss) at any point of a save leaves a pair that
// loads: the old one, or the new one, whose model file a crash between the two renames left staged
// (load_checkpoint, or the next save before it stages anything, finishes that rename). The next save
// also removes what killed saves left behind.
#pragma once

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <concepts>
#include <chrono>
#include <cstdio>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <map>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "cupipe/core/error.hpp"
#include "cupipe/core/hash.hpp"
#include "cupipe/core/rng.hpp"
#include "cupipe/io/safetensors.hpp"
#include "cupipe/layers/sequential.hpp"

namespace cupipe::io {

/// Where training stands, beyond the tensors.
struct TrainingState {
  std::string optimizer;          ///< "adamw", "sgd", or empty when there is no optimizer state
  std::int64_t updates = 0;       ///< optimizer updates applied (the LR-schedule position)
  Rng::state_type rng = Rng(0).state();  ///< the data-order generator (never all zeros: that state never changes)
  std::int64_t epoch = 0;         ///< data position: epoch ...
  std::int64_t batch = 0;         ///< ... and batches done within it
  std::map<std::string, std::string> extra;  ///< anything else the trainer records (schedule, stages, ...)
};

inline std::filesystem::path model_file(const std::filesystem::path& prefix) {
  return std::filesystem::path(prefix.string() + ".safetensors");
}
inline std::filesystem::path state_file(const std::filesystem::path& prefix) {
  return std::filesystem::path(prefix.string() + ".state.safetensors");
}

namespace detail {

inline std::vector<std::int64_t> extents(const Shape& shape) {
  std::vector<std::int64_t> out;
  for (int i = 0; i < shape.rank(); ++i) out.push_back(shape[i]);
  return out;
}

template <class T>
std::vector<TensorEntry> entries(const std::vector<ParamInfo>& table, std::span<const T> flat, const std::string& suffix) {
  std::vector<TensorEntry> out;
  for (const ParamInfo& p : table)
    out.push_back(make_entry(p.name + suffix, extents(p.shape), flat.subspan(std::size_t(p.offset), std::size_t(p.numel))));
  return out;
}

/// Reads every tensor of `table` (with `suffix`) into one flat array, checking that the file has
/// exactly those names, shapes and dtypes, and saying everything that differs.
template <class T>
std::vector<T> read_flat(const SafetensorsFile& file, const std::vector<ParamInfo>& table, const std::string& suffix) {
  std::vector<std::string> problems;
  std::vector<std::string> expected_names;
  index_t total = 0;
  for (const ParamInfo& p : table) total += p.numel;
  std::vector<T> flat(static_cast<std::size_t>(total));
  for (const ParamInfo& p : table) {
    const std::string name = p.name + suffix;
    expected_names.push_back(name);
    if (!file.contains(name)) {
      problems.push_back("missing tensor '" + name + "' " + format_shape(extents(p.shape)));
      continue;
    }
    const TensorEntry& e = file.at(name);
    if (e.dtype != dtype_v<T> || e.shape != extents(p.shape)) {
      problems.push_back("tensor '" + name + "' is " + std::string(cupipe::name(e.dtype)) + " " + format_shape(e.shape) +
                         " but the model needs " + std::string(cupipe::name(dtype_v<T>)) + " " +
                         format_shape(extents(p.shape)));
      continue;
    }
    std::memcpy(flat.data() + p.offset, e.data.data(), e.data.size());
  }
  for (const std::string& name : file.names())
    if (std::find(expected_names.begin(), expected_names.end(), name) == expected_names.end() &&
        (suffix.empty() || name.ends_with(suffix)))
      problems.push_back("unexpected tensor '" + name + "'");
  if (!problems.empty()) {  // one line: the first few differences and how many more
    constexpr std::size_t shown = 4;
    std::string message = file.path().string() + ": does not fit the model (" + std::to_string(problems.size()) +
                          (problems.size() == 1 ? " difference): " : " differences): ");
    for (std::size_t i = 0; i < std::min(shown, problems.size()); ++i) message += (i ? "; " : "") + problems[i];
    if (problems.size() > shown) message += "; and " + std::to_string(problems.size() - shown) + " more";
    CUPIPE_THROW(message);
  }
  return flat;
}

inline std::string rng_text(const Rng::state_type& state) {
  std::string out;
  for (std::uint64_t word : state) {
    if (!out.empty()) out += ' ';  // not `" " + std::to_string(...)`: GCC 12 warns on it (-Wrestrict, PR 105329)
    out += std::to_string(word);
  }
  return out;
}

inline Rng::state_type parse_rng(const std::string& file, const std::string& text) {
  Rng::state_type state{};
  std::size_t pos = 0;
  for (auto& word : state) {
    std::size_t used = 0;
    try {
      word = std::stoull(text.substr(pos), &used);
    } catch (const std::exception&) {
      CUPIPE_THROW(file, ": metadata 'rng' must be four unsigned integers, got '", text, "'");
    }
    pos += used;
  }
  if (state == Rng::state_type{})
    CUPIPE_THROW(file, ": metadata 'rng' is all zeros, a state the generator never leaves; the checkpoint was edited or corrupted");
  return state;
}

inline const std::string& meta(const SafetensorsFile& file, const std::string& key) {
  const auto it = file.metadata().find(key);
  if (it == file.metadata().end()) CUPIPE_THROW(file.path().string(), ": metadata has no '", key, "'");
  return it->second;
}

/// Largest count a checkpoint may record (updates, epochs, batches): far beyond any real run, and far
/// enough below INT64_MAX that the arithmetic done with it (step + 1, epoch * batches) cannot overflow.
inline constexpr std::int64_t max_checkpoint_count = std::int64_t(1) << 40;

/// A count from the metadata, in [0, max_checkpoint_count]. The checksum only catches accidents, so
/// a value edited by hand must still not crash or mislead the trainer.
inline std::int64_t meta_int(const SafetensorsFile& file, const std::string& key) {
  const std::string& text = meta(file, key);
  std::int64_t value = 0;
  try {
    std::size_t used = 0;
    value = std::stoll(text, &used);
    if (used != text.size()) throw std::invalid_argument(text);
  } catch (const std::exception&) {
    CUPIPE_THROW(file.path().string(), ": metadata '", key, "' must be an integer, got '", text, "'");
  }
  if (value < 0 || value > max_checkpoint_count)
    CUPIPE_THROW(file.path().string(), ": metadata '", key, "' is ", value, ", outside [0, 2^40]; the checkpoint was edited or corrupted");
  return value;
}

/// FNV-1a (64-bit) over a file's metadata but "checksum" and its tensors' names, dtypes, shapes and
/// bytes, in name order. Each step is a bijection of the running hash, so a changed byte in any of
/// them changes the result: safetensors itself would load a flipped bit in the data silently.
inline std::string content_checksum(const std::map<std::string, std::string>& metadata,
                                    std::vector<const TensorEntry*> tensors) {
  Fnv1a hash;
  auto add = [&hash](const void* data, std::size_t size) { hash.add(data, size); };
  auto add_text = [&add](std::string_view text) {
    add(text.data(), text.size());
    add("", 1);  // a terminator, so that ("ab", "c") and ("a", "bc") differ
  };
  for (const auto& [key, value] : metadata) {
    if (key == "checksum") continue;
    add_text(key);
    add_text(value);
  }
  std::sort(tensors.begin(), tensors.end(), [](auto* a, auto* b) { return a->name < b->name; });
  for (const TensorEntry* t : tensors) {
    add_text(t->name);
    add_text(cupipe::name(t->dtype));
    for (std::int64_t extent : t->shape) add(&extent, sizeof extent);
    add_text("");
    add(t->data.data(), t->data.size());
  }
  char text[32];
  std::snprintf(text, sizeof text, "fnv1a64:%016llx", static_cast<unsigned long long>(hash.value()));
  return text;
}

/// Saves `tensors` with a "checksum" entry added to `metadata`.
inline void save_with_checksum(const std::filesystem::path& path, const std::vector<TensorEntry>& tensors,
                               std::map<std::string, std::string> metadata) {
  std::vector<const TensorEntry*> pointers;
  for (const TensorEntry& t : tensors) pointers.push_back(&t);
  metadata["checksum"] = content_checksum(metadata, std::move(pointers));
  save_safetensors(path, std::span<const TensorEntry>(tensors), metadata);
}

/// Throws if `file`'s contents do not hash to its "checksum"; without one, throws only if `required`.
inline void verify_checksum(const SafetensorsFile& file, bool required) {
  const auto it = file.metadata().find("checksum");
  if (it == file.metadata().end()) {
    if (required) CUPIPE_THROW(file.path().string(), ": metadata has no 'checksum'; not a file written by cupipe's save_checkpoint");
    return;
  }
  std::vector<const TensorEntry*> tensors;
  for (const std::string& name : file.names()) tensors.push_back(&file.at(name));
  const std::string actual = content_checksum(file.metadata(), std::move(tensors));
  if (actual != it->second)
    CUPIPE_THROW(file.path().string(), ": corrupted: its contents hash to ", actual, " but its metadata says ", it->second);
}

/// Where a checkpoint file waits, complete, until its partner is complete too.
inline std::filesystem::path staged(const std::filesystem::path& path) {
  return std::filesystem::path(path.string() + ".partial");
}

/// Removes what killed saves of `target` left behind: its staged copy and the temp files of
/// write_file_atomically for the target and for the staged copy.
inline void remove_leftovers(const std::filesystem::path& target) {
  namespace fs = std::filesystem;
  std::error_code ec;
  fs::remove(staged(target), ec);
  for (fs::directory_iterator it(folder_of(target), ec), end; !ec && it != end; it.increment(ec)) {
    const std::string entry = it->path().filename().string();
    for (const std::string& prefix : {temp_prefix(target), temp_prefix(staged(target))})
      if (entry.size() == prefix.size() + 6 && entry.starts_with(prefix)) {
        std::error_code ignored;
        fs::remove(it->path(), ignored);
      }
  }
}

/// The save id a checkpoint file records, or empty when the file is missing, unreadable, corrupted
/// or has none.
inline std::string readable_save_id(const std::filesystem::path& path) {
  std::error_code ec;
  if (!std::filesystem::is_regular_file(path, ec)) return {};
  try {
    const SafetensorsFile file = SafetensorsFile::load(path);
    verify_checksum(file, true);
    const auto it = file.metadata().find("save_id");
    return it == file.metadata().end() ? std::string() : it->second;
  } catch (const error&) {
    return {};
  }
}

/// True when a save was killed between its renames: the state file is the new one and the model
/// file staged beside `model_target` is complete and from the same save, while the model file in
/// place is not.
inline bool completes_torn_pair(const std::filesystem::path& model_target, const std::filesystem::path& state_target) {
  const std::string staged_id = readable_save_id(staged(model_target));
  return !staged_id.empty() && staged_id == readable_save_id(state_target) && staged_id != readable_save_id(model_target);
}

/// Finishes a save killed between its two renames (the staged model completes the state file in
/// place), so the checkpoint under `prefix` is a matching pair again. Cheap when there is nothing to
/// finish: one stat of the staged model.
inline void finish_torn_save(const std::filesystem::path& model_target, const std::filesystem::path& state_target) {
  if (!completes_torn_pair(model_target, state_target)) return;
  rename_over(staged(model_target), model_target);
  sync_directory(model_target);
}

}  // namespace detail

/// Writes the model file alone (what PyTorch loads).
template <class T>
void save_model(const std::filesystem::path& path, const std::vector<ParamInfo>& table, std::span<const T> params,
                std::map<std::string, std::string> metadata = {}) {
  metadata.emplace("format", "pt");
  metadata.emplace("producer", "cupipe");
  detail::save_with_checksum(path, detail::entries(table, params, ""), std::move(metadata));
}

/// Reads a model file into the flat layout of `table`; throws listing every mismatch, or if the
/// file's checksum (when it has one: files from PyTorch do not) does not match its contents.
template <class T>
std::vector<T> load_model(const std::filesystem::path& path, const std::vector<ParamInfo>& table) {
  const SafetensorsFile file = SafetensorsFile::load(path);
  detail::verify_checksum(file, false);
  return detail::read_flat<T>(file, table, "");
}

/// Saves a trainer (anything with parameter_table(), parameters(), optimizer_state(slot)) and its
/// optimizer's state under `prefix`. For a pipeline spread over processes every rank calls it (the
/// gathers are collective) and only the trainer's writes_checkpoints() rank writes; every rank can
/// load the same files, whatever its stage count or replica count.
template <class Trainer, class Optimizer>
void save_checkpoint(const std::filesystem::path& prefix, Trainer& trainer, const Optimizer&, TrainingState state) {
  using T = typename std::decay_t<decltype(trainer.parameters())>::value_type;
  const auto table = trainer.parameter_table();
  // A default TrainingState records no updates, yet the optimizer state saved beside it is that of
  // the trainer's updates so far: take the trainer's count, or AdamW's bias correction and an LR
  // schedule would restart from 0 after a load (a newcomer's trainer did exactly that).
  if constexpr (requires { { trainer.updates() } -> std::convertible_to<std::int64_t>; })
    if (state.updates == 0) state.updates = trainer.updates();
  const std::string save_id = std::to_string(state.updates) + "-" + std::to_string(Rng(std::uint64_t(
      std::chrono::steady_clock::now().time_since_epoch().count())).next_u64());

  std::map<std::string, std::string> meta = state.extra;
  meta["save_id"] = save_id;
  meta["optimizer"] = std::string(Optimizer::name);
  meta["updates"] = std::to_string(state.updates);
  meta["rng"] = detail::rng_text(state.rng);
  meta["epoch"] = std::to_string(state.epoch);
  meta["batch"] = std::to_string(state.batch);
  const std::vector<T> params = trainer.parameters();
  std::vector<TensorEntry> tensors;
  for (std::size_t slot = 0; slot < Optimizer::slot_names.size(); ++slot) {
    std::vector<T> values = trainer.optimizer_state(slot);
    if (values.empty()) values.assign(params.size(), T(0));  // no update yet: zeros, as at start
    auto part = detail::entries(table, std::span<const T>(values), "." + std::string(Optimizer::slot_names[slot]));
    tensors.insert(tensors.end(), std::make_move_iterator(part.begin()), std::make_move_iterator(part.end()));
  }
  // Across processes every rank gathers (the calls above are collective); one rank writes.
  if constexpr (requires { trainer.writes_checkpoints(); })
    if (!trainer.writes_checkpoints()) return;
  // Both files are written in full beside their targets before either replaces its old version, so
  // a failure while writing (disk full, I/O error) leaves the previous checkpoint whole. A crash
  // between the two renames leaves the new state file beside the old model file and the complete new
  // model file staged; load_checkpoint finds it there by the save id and finishes the commit.
  const std::filesystem::path state_target = state_file(prefix), model_target = model_file(prefix);
  const std::filesystem::path state_staged = detail::staged(state_target), model_staged = detail::staged(model_target);
  // A torn pair is completed before anything is staged over its model (a failed or killed save would
  // otherwise take the only copy of it); what other killed saves left is only taking space.
  detail::finish_torn_save(model_target, state_target);
  detail::remove_leftovers(state_target);
  detail::remove_leftovers(model_target);
  try {
    detail::save_with_checksum(state_staged, tensors, meta);
    save_model(model_staged, table, std::span<const T>(params), {{"save_id", save_id}});
    detail::rename_over(state_staged, state_target);
    detail::rename_over(model_staged, model_target);
  } catch (...) {
    std::error_code ignored;
    std::filesystem::remove(state_staged, ignored);
    std::filesystem::remove(model_staged, ignored);
    throw;
  }
  detail::sync_directory(model_target);
}

/// Loads a checkpoint saved by save_checkpoint into `trainer` and returns the training state.
/// Throws, naming the file, on any mismatch: names, shapes, dtypes, optimizer, or a torn save.
template <class Trainer, class Optimizer>
TrainingState load_checkpoint(const std::filesystem::path& prefix, Trainer& trainer, const Optimizer& optimizer) {
  using T = typename std::decay_t<decltype(trainer.parameters())>::value_type;
  const auto table = trainer.parameter_table();
  const SafetensorsFile state_file_ = SafetensorsFile::load(state_file(prefix));
  detail::verify_checksum(state_file_, true);
  // A save killed between its two renames left the new model staged: finish that commit first.
  detail::finish_torn_save(model_file(prefix), state_file(prefix));
  const SafetensorsFile model = SafetensorsFile::load(model_file(prefix));
  detail::verify_checksum(model, true);
  if (detail::meta(model, "save_id") != detail::meta(state_file_, "save_id"))
    CUPIPE_THROW(model.path().string(), " and ", state_file_.path().string(),
                 " come from different saves (save ids ", detail::meta(model, "save_id"), " and ",
                 detail::meta(state_file_, "save_id"), "): a save was interrupted; use an older checkpoint");
  if (detail::meta(state_file_, "optimizer") != Optimizer::name)
    CUPIPE_THROW(state_file_.path().string(), ": holds ", detail::meta(state_file_, "optimizer"),
                 " state but the trainer uses ", Optimizer::name);

  TrainingState state;
  state.optimizer = detail::meta(state_file_, "optimizer");
  state.updates = detail::meta_int(state_file_, "updates");
  state.rng = detail::parse_rng(state_file_.path().string(), detail::meta(state_file_, "rng"));
  state.epoch = detail::meta_int(state_file_, "epoch");
  state.batch = detail::meta_int(state_file_, "batch");
  for (const auto& [key, value] : state_file_.metadata())
    if (key != "save_id" && key != "optimizer" && key != "updates" && key != "rng" && key != "epoch" && key != "batch" &&
        key != "checksum")
      state.extra[key] = value;

  // Everything is read and checked before the trainer is touched: a refused load changes nothing.
  const std::vector<T> params = detail::read_flat<T>(model, table, "");
  std::vector<std::vector<T>> slots;
  for (std::size_t slot = 0; slot < Optimizer::slot_names.size(); ++slot)
    slots.push_back(detail::read_flat<T>(state_file_, table, "." + std::string(Optimizer::slot_names[slot])));
  trainer.set_parameters(params);
  for (std::size_t slot = 0; slot < slots.size(); ++slot)
    trainer.set_optimizer_state(optimizer, slot, slots[slot], state.updates);
  return state;
}

}  // namespace cupipe::io
