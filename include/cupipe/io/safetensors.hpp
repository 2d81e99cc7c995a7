// SPDX-License-Identifier: Apache-2.0
// The Hugging Face safetensors format, readable by PyTorch and numpy:
//   u64 little-endian N | N bytes of JSON header | data buffer
// The header maps each tensor name to {"dtype": "F32", "shape": [..], "data_offsets": [begin, end]}
// (offsets into the buffer), plus an optional "__metadata__" object of string values. We write
// tensors sorted by name, packed back to back, and pad the header with spaces so the buffer starts
// 8-byte aligned. Loading checks everything a corrupted file could get wrong before trusting it.
//
// Use:
//   save_safetensors(path, std::vector{make_entry("w", {2, 3}, w_values)}, {{"step", "10"}});
//   auto file = SafetensorsFile::load(path);
//   std::vector<float> w = file.read<float>("w", {2, 3});
#pragma once

#include <algorithm>
#include <bit>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <functional>
#include <map>
#include <set>
#include <nlohmann/json.hpp>
#include <span>
#include <string>
#include <string_view>
#include <tuple>
#include <type_traits>
#include <vector>

#include "cupipe/core/dtype.hpp"
#include "cupipe/core/error.hpp"
#include "cupipe/io/atomic_file.hpp"

namespace cupipe::io {

static_assert(std::endian::native == std::endian::little,
              "cupipe::io stores tensors in their in-memory byte order, which must be little-endian");

/// One named tensor held in host memory: row-major, little-endian, numel(shape) × size_of(dtype) bytes.
struct TensorEntry {
  std::string name;
  DType dtype = DType::f32;
  std::vector<std::int64_t> shape;
  std::vector<std::byte> data;
};

/// The same without owning anything, to save tensors without copying them first.
struct TensorEntryView {
  std::string_view name;
  DType dtype = DType::f32;
  std::span<const std::int64_t> shape;
  std::span<const std::byte> data;

  TensorEntryView() = default;
  TensorEntryView(std::string_view name_, DType dtype_, std::span<const std::int64_t> shape_,
                  std::span<const std::byte> data_)
      : name(name_), dtype(dtype_), shape(shape_), data(data_) {}
  TensorEntryView(const TensorEntry& entry)  // NOLINT: implicit by design
      : name(entry.name), dtype(entry.dtype), shape(entry.shape), data(entry.data) {}
};

namespace detail {

/// numel × size_of(dtype) in bytes, or false if an extent is negative or the product overflows.
inline bool byte_size(std::span<const std::int64_t> shape, DType dtype, std::uint64_t& bytes) {
  std::uint64_t total = size_of(dtype);
  for (std::int64_t extent : shape) {
    if (extent < 0 || __builtin_mul_overflow(total, static_cast<std::uint64_t>(extent), &total)) return false;
  }
  bytes = total;
  return true;
}

inline std::string dtype_list() {
  std::string out;
  for (DType t : {DType::f32, DType::f64, DType::bf16, DType::f16, DType::i32, DType::i64, DType::u8}) {
    if (!out.empty()) out += ", ";
    out += name(t);
  }
  return out;
}

/// "a, b, c" for error messages, shortened after `limit` names.
inline std::string name_list(const std::vector<std::string>& names, std::size_t limit = 20) {
  if (names.empty()) return "(none)";
  std::string out;
  for (std::size_t i = 0; i < names.size() && i < limit; ++i) out += (i ? ", '" : "'") + names[i] + "'";
  if (names.size() > limit) out += " and " + std::to_string(names.size() - limit) + " more";
  return out;
}

}  // namespace detail

/// Writes `tensors` and `metadata` to `path` atomically (see atomic_file.hpp), tensors sorted by name.
/// Throws, leaving any previous file intact, on a duplicate or empty name, the reserved name
/// "__metadata__", or data whose size is not numel × dtype size.
inline void save_safetensors(const std::filesystem::path& path, std::span<const TensorEntryView> tensors,
                             const std::map<std::string, std::string>& metadata = {}) {
  std::vector<const TensorEntryView*> sorted;
  sorted.reserve(tensors.size());
  for (const TensorEntryView& t : tensors) sorted.push_back(&t);
  std::sort(sorted.begin(), sorted.end(), [](auto* a, auto* b) { return a->name < b->name; });

  nlohmann::json header = nlohmann::json::object();
  if (!metadata.empty()) header["__metadata__"] = metadata;
  std::uint64_t offset = 0;
  for (std::size_t i = 0; i < sorted.size(); ++i) {
    const TensorEntryView& t = *sorted[i];
    const std::string name(t.name);
    CUPIPE_REQUIRE(!name.empty(), path.string(), ": cannot save a tensor with an empty name");
    CUPIPE_REQUIRE(name != "__metadata__", path.string(),
                   ": cannot save a tensor named '__metadata__'; safetensors reserves that key");
    CUPIPE_REQUIRE(i == 0 || sorted[i - 1]->name != t.name, path.string(), ": tensor '", name,
                   "' is given twice; names must be unique");
    std::uint64_t bytes = 0;
    CUPIPE_REQUIRE(detail::byte_size(t.shape, t.dtype, bytes), path.string(), ": tensor '", name,
                   "': shape ", detail::format_shape(t.shape), " has a negative extent or too many elements");
    CUPIPE_REQUIRE(t.data.size() == bytes, path.string(), ": tensor '", name, "': shape ",
                   detail::format_shape(t.shape), " of ", cupipe::name(t.dtype), " needs ", bytes,
                   " bytes but ", t.data.size(), " were given");
    header[name] = {{"dtype", std::string(cupipe::name(t.dtype))},
                    {"shape", std::vector<std::int64_t>(t.shape.begin(), t.shape.end())},
                    {"data_offsets", {offset, offset + bytes}}};
    offset += bytes;
  }

  std::string text;
  try {
    text = header.dump();
  } catch (const nlohmann::json::exception& e) {  // a name or metadata string that is not UTF-8
    CUPIPE_THROW(path.string(), ": cannot write the header: ", e.what());
  }
  text.append((8 - text.size() % 8) % 8, ' ');  // the buffer then starts at a multiple of 8
  const std::uint64_t header_size = text.size();

  write_file_atomically(path, [&](FileSink& sink) {
    sink.write(&header_size, sizeof header_size);
    sink.write(std::string_view(text));
    for (const TensorEntryView* t : sorted) sink.write(t->data);
  });
}

/// The overload for owning entries, e.g. a std::vector<TensorEntry>.
inline void save_safetensors(const std::filesystem::path& path, std::span<const TensorEntry> tensors,
                             const std::map<std::string, std::string>& metadata = {}) {
  const std::vector<TensorEntryView> views(tensors.begin(), tensors.end());
  save_safetensors(path, std::span<const TensorEntryView>(views), metadata);
}

/// An entry holding a copy of typed host values; throws if their count is not numel(shape).
template <class T>
TensorEntry make_entry(std::string name, std::vector<std::int64_t> shape, std::span<const T> values) {
  static_assert(requires { dtype_of<T>::value; },
                "make_entry<T>: T must be float, double, bfloat16, int32_t, int64_t or uint8_t");
  std::uint64_t bytes = 0;
  CUPIPE_REQUIRE(detail::byte_size(shape, dtype_v<T>, bytes), "make_entry '", name, "': shape ",
                 detail::format_shape(shape), " has a negative extent or too many elements");
  CUPIPE_REQUIRE(bytes == values.size_bytes(), "make_entry '", name, "': shape ", detail::format_shape(shape),
                 " has ", bytes / sizeof(T), " elements but ", values.size(), " values were given");
  TensorEntry entry{std::move(name), dtype_v<T>, std::move(shape), std::vector<std::byte>(values.size_bytes())};
  if (!values.empty()) std::memcpy(entry.data.data(), values.data(), values.size_bytes());
  return entry;
}

template <class T>
TensorEntry make_entry(std::string name, std::vector<std::int64_t> shape, const std::vector<T>& values) {
  return make_entry(std::move(name), std::move(shape), std::span<const T>(values));
}

/// A loaded safetensors file: every tensor in host memory, checked against the format's rules.
class SafetensorsFile {
 public:
  /// Reads and validates `path`; throws cupipe::error naming the file (and tensor) on any problem.
  static SafetensorsFile load(const std::filesystem::path& path);

  const std::filesystem::path& path() const noexcept { return path_; }
  const std::map<std::string, std::string>& metadata() const noexcept { return metadata_; }
  bool contains(std::string_view name) const { return tensors_.find(name) != tensors_.end(); }
  std::size_t size() const noexcept { return tensors_.size(); }
  /// Tensor names, sorted.
  std::vector<std::string> names() const {
    std::vector<std::string> out;
    out.reserve(tensors_.size());
    for (const auto& [name, entry] : tensors_) out.push_back(name);
    return out;
  }

  /// The tensor called `name`; throws naming it and listing the tensors the file does have.
  const TensorEntry& at(std::string_view name) const {
    const auto it = tensors_.find(name);
    if (it == tensors_.end())
      CUPIPE_THROW(path_.string(), ": no tensor named '", name, "'; the file has ", detail::name_list(names()));
    return it->second;
  }

  /// A copy of tensor `name` as T values; throws unless its dtype is T's and its shape is `expected_shape`.
  template <class T>
  std::vector<T> read(std::string_view name, const std::vector<std::int64_t>& expected_shape) const {
    static_assert(requires { dtype_of<T>::value; },
                  "SafetensorsFile::read<T>: T must be float, double, bfloat16, int32_t, int64_t or uint8_t");
    const TensorEntry& entry = at(name);
    if (entry.dtype != dtype_v<T> || entry.shape != expected_shape)
      CUPIPE_THROW(path_.string(), ": tensor '", name, "': expected ", cupipe::name(dtype_v<T>), " ",
                   detail::format_shape(expected_shape), " but the file has ", cupipe::name(entry.dtype), " ",
                   detail::format_shape(entry.shape));
    std::vector<T> out(entry.data.size() / sizeof(T));
    if (!out.empty()) std::memcpy(out.data(), entry.data.data(), entry.data.size());
    return out;
  }

 private:
  std::filesystem::path path_;
  std::map<std::string, TensorEntry, std::less<>> tensors_;
  std::map<std::string, std::string> metadata_;
};

namespace detail {

/// Above this the length field is surely corrupted: real headers are kilobytes.
inline constexpr std::uint64_t max_safetensors_header = 100'000'000;
/// Deepest nesting a header may have. A valid one needs 3 (header object, tensor entry, shape array);
/// a file nesting 75,000 arrays would otherwise overflow the stack of whatever walks the value.
inline constexpr int max_safetensors_depth = 16;

/// A JSON value from an untrusted file, for an error message: scalars as written (cut at 60
/// characters), arrays and objects by their size only, so a message never serialises a whole value.
inline std::string excerpt(const nlohmann::json& value) {
  const auto count = [](std::size_t n, const char* what) {
    return std::to_string(n) + " " + what + (n == 1 ? "" : "s");
  };
  if (value.is_array()) return "an array of " + count(value.size(), "element");
  if (value.is_object()) return "an object of " + count(value.size(), "key");
  std::string text = value.dump();
  if (text.size() > 60) text = text.substr(0, 57) + "...";
  return text;
}

/// The text of data_offsets for a message: "[0,8]" when it is a short array of scalars.
inline std::string excerpt_offsets(const nlohmann::json& offsets) {
  if (!offsets.is_array() || offsets.size() > 4) return excerpt(offsets);
  std::string text = "[";
  for (std::size_t i = 0; i < offsets.size(); ++i) {
    if (i) text += ',';  // appended, not `"," + excerpt(...)`: GCC 12 warns on that (-Wrestrict, PR 105329)
    text += excerpt(offsets[i]);
  }
  return text + "]";
}

/// An integer JSON value that fits in int64 and is >= 0, or false.
inline bool non_negative_integer(const nlohmann::json& value, std::int64_t& out) {
  if (value.is_number_unsigned()) {
    const auto v = value.get<std::uint64_t>();
    if (v > static_cast<std::uint64_t>(INT64_MAX)) return false;
    out = static_cast<std::int64_t>(v);
    return true;
  }
  if (value.is_number_integer() && value.get<std::int64_t>() >= 0) {
    out = value.get<std::int64_t>();
    return true;
  }
  return false;
}

/// Where one tensor's bytes lie, before they are read.
struct PendingTensor {
  TensorEntry entry;
  std::uint64_t begin = 0, end = 0;
};

inline PendingTensor parse_tensor_header(const std::string& file, const std::string& name,
                                         const nlohmann::json& info) {
  const std::string where = file + ": tensor '" + name + "'";
  if (!info.is_object())
    CUPIPE_THROW(where, ": entry is a JSON ", info.type_name(),
                 ", expected an object with \"dtype\", \"shape\" and \"data_offsets\"");
  for (const char* key : {"dtype", "shape", "data_offsets"})
    if (!info.contains(key)) CUPIPE_THROW(where, ": entry has no \"", key, "\"");

  PendingTensor out;
  out.entry.name = name;
  const nlohmann::json& dtype = info.at("dtype");
  if (!dtype.is_string()) CUPIPE_THROW(where, ": dtype is a JSON ", dtype.type_name(), ", expected a string such as \"F32\"");
  if (!parse_dtype(dtype.get_ref<const std::string&>(), out.entry.dtype))
    CUPIPE_THROW(where, ": unsupported dtype \"", dtype.get_ref<const std::string&>(), "\"; cupipe reads ", dtype_list());

  const nlohmann::json& shape = info.at("shape");
  if (!shape.is_array()) CUPIPE_THROW(where, ": shape is a JSON ", shape.type_name(), ", expected an array of integers");
  for (std::size_t i = 0; i < shape.size(); ++i) {
    std::int64_t extent = 0;
    if (!non_negative_integer(shape[i], extent))
      CUPIPE_THROW(where, ": shape[", i, "] is ", excerpt(shape[i]), ", expected a non-negative integer");
    out.entry.shape.push_back(extent);
  }

  const nlohmann::json& offsets = info.at("data_offsets");
  std::int64_t begin = 0, end = 0;
  if (!offsets.is_array() || offsets.size() != 2 || !non_negative_integer(offsets[0], begin) ||
      !non_negative_integer(offsets[1], end))
    CUPIPE_THROW(where, ": data_offsets is ", excerpt_offsets(offsets), ", expected [begin, end] with non-negative integers");
  if (end < begin) CUPIPE_THROW(where, ": data_offsets [", begin, ", ", end, "] end before they begin");
  out.begin = static_cast<std::uint64_t>(begin);
  out.end = static_cast<std::uint64_t>(end);

  std::uint64_t bytes = 0;
  if (!byte_size(out.entry.shape, out.entry.dtype, bytes))
    CUPIPE_THROW(where, ": shape ", format_shape(out.entry.shape), " has more elements than fit in 64 bits");
  if (out.end - out.begin != bytes)
    CUPIPE_THROW(where, ": data_offsets [", begin, ", ", end, "] hold ", out.end - out.begin, " bytes but shape ",
                 format_shape(out.entry.shape), " of ", cupipe::name(out.entry.dtype), " needs ", bytes);
  return out;
}

/// Checks the tensors tile [0, buffer_size) exactly; sorts them by offset.
inline void check_layout(const std::string& file, std::vector<PendingTensor>& tensors, std::uint64_t buffer_size) {
  std::sort(tensors.begin(), tensors.end(),
            [](const PendingTensor& a, const PendingTensor& b) { return std::tie(a.begin, a.end) < std::tie(b.begin, b.end); });
  std::uint64_t covered = 0;  // bytes [0, covered) belong to the tensors seen so far
  const PendingTensor* previous = nullptr;
  for (const PendingTensor& t : tensors) {
    if (t.end > buffer_size)
      CUPIPE_THROW(file, ": tensor '", t.entry.name, "': data_offsets [", t.begin, ", ", t.end,
                   "] run past the end of the ", buffer_size, "-byte data buffer (file truncated?)");
    if (t.begin < covered)
      CUPIPE_THROW(file, ": tensors '", previous->entry.name, "' [", previous->begin, ", ", previous->end,
                   "] and '", t.entry.name, "' [", t.begin, ", ", t.end, "] overlap");
    if (t.begin > covered)
      CUPIPE_THROW(file, ": hole in the data buffer: no tensor holds bytes [", covered, ", ", t.begin, ")",
                   previous ? " after '" + previous->entry.name + "'" : std::string(), ", before '", t.entry.name, "'");
    covered = t.end;
    previous = &t;
  }
  if (covered != buffer_size)
    CUPIPE_THROW(file, ": ", buffer_size - covered, " bytes after the last tensor's data: the tensors hold ",
                 covered, " bytes but the data buffer has ", buffer_size);
}

}  // namespace detail

inline SafetensorsFile SafetensorsFile::load(const std::filesystem::path& path) {
  const std::string file = path.string();
  detail::InputFile input(path);
  const std::uint64_t file_size = input.size();
  if (file_size < 8)
    CUPIPE_THROW(file, ": not a safetensors file: it has ", file_size,
                 " bytes, fewer than the 8-byte header length that starts one");
  std::uint64_t header_size = 0;
  if (input.read(&header_size, 8) != 8) CUPIPE_THROW(file, ": truncated while reading the header length");
  if (header_size > detail::max_safetensors_header)
    CUPIPE_THROW(file, ": header length ", header_size, " is absurd (the limit is ", detail::max_safetensors_header,
                 " bytes); the file is corrupted or not a safetensors file");
  if (header_size > file_size - 8)
    CUPIPE_THROW(file, ": truncated: the header length says ", header_size, " bytes but only ", file_size - 8,
                 " bytes follow it");

  std::string text(header_size, '\0');
  if (input.read(text.data(), text.size()) != text.size())
    CUPIPE_THROW(file, ": truncated while reading the ", header_size, "-byte header");

  // nlohmann::json stops at a NUL as if the text ended there, which would hide what follows.
  if (const std::size_t nul = text.find('\0'); nul != std::string::npos)
    CUPIPE_THROW(file, ": header has a NUL byte at offset ", nul, "; a safetensors header is JSON text");

  // The parser callback rejects a repeated key, which JSON parsers would silently let win.
  std::vector<std::set<std::string, std::less<>>> keys_per_object;
  const auto reject_duplicates = [&](int depth, nlohmann::json::parse_event_t event, nlohmann::json& parsed) {
    using event_t = nlohmann::json::parse_event_t;
    if (depth > detail::max_safetensors_depth)
      CUPIPE_THROW(file, ": the header nests deeper than ", detail::max_safetensors_depth,
                   " levels (a safetensors header needs 3); the file is corrupted or hostile");
    if (event == event_t::object_start) keys_per_object.emplace_back();
    if (event == event_t::object_end) keys_per_object.pop_back();
    if (event == event_t::key && !keys_per_object.back().insert(parsed.get<std::string>()).second) {
      if (depth == 1) CUPIPE_THROW(file, ": the header names tensor '", parsed.get<std::string>(), "' twice");
      CUPIPE_THROW(file, ": the header has the key '", parsed.get<std::string>(), "' twice in one object");
    }
    return true;
  };
  nlohmann::json header;
  try {
    header = nlohmann::json::parse(text, reject_duplicates);
  } catch (const nlohmann::json::exception& e) {
    CUPIPE_THROW(file, ": header is not valid JSON: ", e.what());
  }
  if (!header.is_object()) CUPIPE_THROW(file, ": header is a JSON ", header.type_name(), ", expected an object");

  SafetensorsFile out;
  out.path_ = path;
  std::vector<detail::PendingTensor> pending;
  for (const auto& [key, value] : header.items()) {
    if (key != "__metadata__") {
      pending.push_back(detail::parse_tensor_header(file, key, value));
      continue;
    }
    if (!value.is_object())
      CUPIPE_THROW(file, ": __metadata__ is a JSON ", value.type_name(), ", expected an object of strings");
    for (const auto& [meta_key, meta_value] : value.items()) {
      if (!meta_value.is_string())
        CUPIPE_THROW(file, ": metadata value for '", meta_key, "' is a JSON ", meta_value.type_name(), " (",
                     detail::excerpt(meta_value), "), expected a string");
      out.metadata_[meta_key] = meta_value.get<std::string>();
    }
  }

  detail::check_layout(file, pending, file_size - 8 - header_size);
  for (detail::PendingTensor& t : pending) {  // in offset order, so the reads are sequential
    t.entry.data.resize(t.end - t.begin);
    if (input.read(t.entry.data.data(), t.entry.data.size()) != t.entry.data.size())
      CUPIPE_THROW(file, ": truncated while reading tensor '", t.entry.name, "' (the file shrank while being read)");
    std::string name = t.entry.name;
    out.tensors_.emplace(std::move(name), std::move(t.entry));
  }
  return out;
}

}  // namespace cupipe::io
