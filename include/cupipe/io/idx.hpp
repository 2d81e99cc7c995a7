// SPDX-License-Identifier: Apache-2.0
// The IDX format of MNIST and Fashion-MNIST: bytes 0x00 0x00 <type> <rank>, then <rank> big-endian
// u32 extents, then the row-major data. Only type 0x08 (unsigned byte) is supported. Files may be
// gzip-compressed; that is detected from the gzip magic bytes 1f 8b, not from the file name.
#pragma once

#include <zlib.h>

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

#include "cupipe/core/error.hpp"
#include "cupipe/io/atomic_file.hpp"

namespace cupipe::io {

/// An IDX array: shape (1 to 4 extents) and the row-major unsigned bytes.
struct IdxArray {
  std::vector<std::int64_t> shape;
  std::vector<std::uint8_t> data;
};

namespace detail {

/// The bytes of a file, gunzipped on the fly if it starts with the gzip magic.
/// Corrupted, truncated or garbage-trailed gzip streams are cupipe::errors naming the file.
class MaybeGzipReader {
 public:
  explicit MaybeGzipReader(const std::filesystem::path& path) : file_(path), in_(64 * 1024) {
    fill_input(2);
    gzip_ = end_ >= 2 && in_[0] == 0x1f && in_[1] == 0x8b;
    if (gzip_ && inflateInit2(&stream_, 15 + 16) != Z_OK)  // 15-bit window, gzip wrapper only
      CUPIPE_THROW(file_.path().string(), ": zlib could not start decompressing");
  }
  MaybeGzipReader(const MaybeGzipReader&) = delete;
  MaybeGzipReader& operator=(const MaybeGzipReader&) = delete;
  ~MaybeGzipReader() {
    if (gzip_) inflateEnd(&stream_);
  }

  bool gzip() const noexcept { return gzip_; }
  /// The stored file's size (compressed, for gzip).
  std::uint64_t file_size() const noexcept { return file_.size(); }

  /// Reads up to `size` bytes of content; returns fewer only at its end.
  std::size_t read(std::uint8_t* out, std::size_t size) {
    return gzip_ ? inflate_into(out, size) : read_plain(out, size);
  }

  /// Reads and counts the bytes left, without keeping them.
  std::uint64_t skip_rest() {
    std::vector<std::uint8_t> scratch(64 * 1024);
    std::uint64_t total = 0;
    for (std::size_t n; (n = read(scratch.data(), scratch.size())) > 0;) total += n;
    return total;
  }

 private:
  /// Tops up the unread input in_[pos_, end_) to at least `want` bytes, unless the file ends first.
  void fill_input(std::size_t want) {
    if (end_ - pos_ >= want || file_done_) return;
    std::copy(in_.begin() + static_cast<std::ptrdiff_t>(pos_), in_.begin() + static_cast<std::ptrdiff_t>(end_),
              in_.begin());
    end_ -= pos_;
    pos_ = 0;
    const std::size_t got = file_.read(in_.data() + end_, in_.size() - end_);
    file_done_ = got < in_.size() - end_;
    end_ += got;
  }

  std::size_t read_plain(std::uint8_t* out, std::size_t size) {
    const std::size_t buffered = std::min(size, end_ - pos_);
    std::copy_n(in_.begin() + static_cast<std::ptrdiff_t>(pos_), buffered, out);
    pos_ += buffered;
    return buffered + (buffered < size ? file_.read(out + buffered, size - buffered) : 0);
  }

  std::size_t inflate_into(std::uint8_t* out, std::size_t size) {
    const std::string file = file_.path().string();
    std::size_t produced = 0;
    while (produced < size && !stream_done_) {
      if (pos_ == end_) fill_input(1);
      const std::size_t in_before = end_ - pos_;
      const std::size_t out_before = std::min<std::size_t>(size - produced, 1u << 30);
      stream_.next_in = in_.data() + pos_;
      stream_.avail_in = static_cast<uInt>(in_before);
      stream_.next_out = out + produced;
      stream_.avail_out = static_cast<uInt>(out_before);
      const int rc = inflate(&stream_, Z_NO_FLUSH);
      const std::size_t consumed = in_before - stream_.avail_in, made = out_before - stream_.avail_out;
      pos_ += consumed;
      produced += made;
      total_out_ += made;
      if (rc == Z_STREAM_END) {
        // Another gzip member may follow (as `cat a.gz b.gz` makes); anything else is garbage.
        fill_input(2);
        if (pos_ == end_) {
          stream_done_ = true;
        } else if (end_ - pos_ >= 2 && in_[pos_] == 0x1f && in_[pos_ + 1] == 0x8b) {
          inflateReset(&stream_);
        } else {
          std::uint64_t garbage = end_ - pos_;
          for (std::size_t n; (n = file_.read(in_.data(), in_.size())) > 0;) garbage += n;
          CUPIPE_THROW(file, ": ", garbage, " bytes of garbage after the end of the gzip stream");
        }
      } else if (rc == Z_DATA_ERROR || rc == Z_NEED_DICT || rc == Z_STREAM_ERROR) {
        CUPIPE_THROW(file, ": corrupted gzip stream after ", total_out_, " decompressed bytes: ",
                     stream_.msg ? stream_.msg : "invalid data");
      } else if (rc == Z_MEM_ERROR) {
        CUPIPE_THROW(file, ": out of memory while decompressing");
      } else if (consumed == 0 && made == 0 && pos_ == end_ && file_done_) {
        CUPIPE_THROW(file, ": truncated gzip stream: the file ends after ", total_out_,
                     " decompressed bytes, before the end-of-stream marker");
      }
    }
    return produced;
  }

  InputFile file_;
  std::vector<std::uint8_t> in_;
  std::size_t pos_ = 0, end_ = 0;  // the unread input is in_[pos_, end_)
  bool file_done_ = false;
  bool gzip_ = false;
  bool stream_done_ = false;
  std::uint64_t total_out_ = 0;
  z_stream stream_{};
};

inline const char* idx_type_name(std::uint8_t type) {
  switch (type) {
    case 0x08: return "unsigned byte";
    case 0x09: return "signed byte";
    case 0x0B: return "int16";
    case 0x0C: return "int32";
    case 0x0D: return "float32";
    case 0x0E: return "float64";
    default: return nullptr;
  }
}

inline std::string hex_byte(std::uint8_t b) {
  constexpr char digits[] = "0123456789abcdef";
  return std::string("0x") + digits[b >> 4] + digits[b & 15];
}

}  // namespace detail

/// Reads an IDX file of unsigned bytes, plain or gzip. Throws cupipe::error naming the file if it
/// is missing or unreadable, has the wrong magic or type, rank 0 or above 4, a truncated header or
/// data, bytes after the data, or a corrupted gzip stream.
inline IdxArray read_idx(const std::filesystem::path& path) {
  const std::string file = path.string();
  detail::MaybeGzipReader reader(path);
  const char* const after_gunzip = reader.gzip() ? " after gunzip" : "";

  std::array<std::uint8_t, 4> magic{};
  const std::size_t got_magic = reader.read(magic.data(), magic.size());
  if (got_magic < magic.size())
    CUPIPE_THROW(file, ": truncated header: the file has ", got_magic, " bytes", after_gunzip,
                 ", an IDX header needs at least 4");
  if (magic[0] != 0 || magic[1] != 0)
    CUPIPE_THROW(file, ": not an IDX file: it starts with ", detail::hex_byte(magic[0]), " ",
                 detail::hex_byte(magic[1]), ", expected 0x00 0x00 then the type and rank bytes");
  if (magic[2] != 0x08) {
    const char* type = detail::idx_type_name(magic[2]);
    CUPIPE_THROW(file, ": element type ", detail::hex_byte(magic[2]),
                 type ? std::string(" (") + type + ") is not supported" : std::string(" is not an IDX type"),
                 "; cupipe reads only 0x08 (unsigned byte)");
  }
  const int rank = magic[3];
  if (rank < 1 || rank > 4) CUPIPE_THROW(file, ": rank ", rank, " is not supported; expected 1 to 4 dimensions");

  const std::size_t header_size = 4 + 4 * static_cast<std::size_t>(rank);
  std::array<std::uint8_t, 16> extents{};
  const std::size_t got_extents = reader.read(extents.data(), 4 * static_cast<std::size_t>(rank));
  if (got_extents < 4 * static_cast<std::size_t>(rank))
    CUPIPE_THROW(file, ": truncated header: rank ", rank, " needs ", header_size, " header bytes but the file has ",
                 4 + got_extents, after_gunzip);

  IdxArray out;
  std::uint64_t data_size = 1;
  bool overflow = false;
  for (int axis = 0; axis < rank; ++axis) {
    const std::uint8_t* e = extents.data() + 4 * axis;
    const std::uint32_t extent = (std::uint32_t(e[0]) << 24) | (std::uint32_t(e[1]) << 16) |
                                 (std::uint32_t(e[2]) << 8) | std::uint32_t(e[3]);
    out.shape.push_back(extent);
    overflow = overflow || __builtin_mul_overflow(data_size, std::uint64_t(extent), &data_size);
  }
  // "60000 items of 28x28 (47040016 bytes)": the expected size of the whole file.
  std::string expected = std::to_string(out.shape[0]) + " items";
  for (int axis = 1; axis < rank; ++axis) expected += (axis == 1 ? " of " : "x") + std::to_string(out.shape[axis]);
  if (overflow || data_size > UINT64_MAX - header_size)
    CUPIPE_THROW(file, ": header says ", expected, ", more bytes than fit in 64 bits; the header is corrupted");
  const std::uint64_t expected_size = header_size + data_size;
  expected += " (" + std::to_string(expected_size) + " bytes)";

  if (!reader.gzip() && reader.file_size() != expected_size) {  // plain: known before reading anything
    if (reader.file_size() < expected_size)
      CUPIPE_THROW(file, ": truncated: header says ", expected, " but the file has ", reader.file_size(), " bytes");
    CUPIPE_THROW(file, ": ", reader.file_size() - expected_size, " extra bytes after the data: header says ",
                 expected, " but the file has ", reader.file_size(), " bytes");
  }

  // A gzip file's size is known only by decompressing it, so grow as the data arrives.
  constexpr std::size_t chunk = 16 << 20;
  std::uint64_t have = 0;
  while (have < data_size) {
    const std::size_t want = static_cast<std::size_t>(std::min<std::uint64_t>(chunk, data_size - have));
    out.data.resize(static_cast<std::size_t>(have) + want);
    const std::size_t got = reader.read(out.data.data() + have, want);
    have += got;
    if (got < want)
      CUPIPE_THROW(file, ": truncated: header says ", expected, " but the file has ", header_size + have, " bytes",
                   after_gunzip);
  }
  if (const std::uint64_t extra = reader.skip_rest(); extra > 0)
    CUPIPE_THROW(file, ": ", extra, " extra bytes after the data: header says ", expected, " but the file has ",
                 expected_size + extra, " bytes", after_gunzip);
  return out;
}

}  // namespace cupipe::io
