// SPDX-License-Identifier: Apache-2.0
// write_file_atomically: after a crash a saved file holds either its old contents or all of its new
// ones, never a mix. The new bytes go to a temp file beside the target, which is fsynced and renamed
// over the target, and then the directory is fsynced so the rename itself survives a power loss.
// Also the pieces the io/ readers share: detail::InputFile, a checked reader, and error formatting.
#pragma once

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <span>
#include <string>
#include <string_view>
#include <system_error>
#include <utility>

#include "cupipe/core/error.hpp"

namespace cupipe::io {

namespace detail {

/// errno's text, e.g. "No such file or directory" (thread-safe, unlike std::strerror).
inline std::string errno_text(int code) { return std::generic_category().message(code); }

/// "(2, 3)"; a single extent prints as "(5,)" like Shape and Python.
inline std::string format_shape(std::span<const std::int64_t> shape) {
  std::string out = "(";
  for (std::size_t i = 0; i < shape.size(); ++i) {
    if (i) out += ", ";
    out += std::to_string(shape[i]);
  }
  if (shape.size() == 1) out += ",";
  return out + ")";
}

}  // namespace detail

/// The open temp file a writer callback fills. write() throws cupipe::error naming the target path.
class FileSink {
 public:
  FileSink(int fd, std::filesystem::path target) : fd_(fd), target_(std::move(target)) {}
  FileSink(const FileSink&) = delete;
  FileSink& operator=(const FileSink&) = delete;

  void write(const void* data, std::size_t size) {
    const auto* bytes = static_cast<const std::byte*>(data);
    while (size > 0) {
      const ::ssize_t n = ::write(fd_, bytes, size);
      if (n < 0) {
        if (errno == EINTR) continue;
        const int code = errno;
        CUPIPE_THROW(target_.string(), ": write failed after ", written_, " bytes: ", detail::errno_text(code));
      }
      bytes += n;
      size -= static_cast<std::size_t>(n);
      written_ += static_cast<std::uint64_t>(n);
    }
  }
  void write(std::span<const std::byte> bytes) { write(bytes.data(), bytes.size()); }
  void write(std::string_view text) { write(text.data(), text.size()); }

  std::uint64_t bytes_written() const noexcept { return written_; }
  /// The file being replaced (not the temp file).
  const std::filesystem::path& target() const noexcept { return target_; }

 private:
  int fd_;
  std::filesystem::path target_;
  std::uint64_t written_ = 0;
};

namespace detail {

/// Renames `from` over `to` (atomic within one filesystem).
inline void rename_over(const std::filesystem::path& from, const std::filesystem::path& to) {
  if (::rename(from.c_str(), to.c_str()) != 0) {
    const int code = errno;
    CUPIPE_THROW(to.string(), ": cannot rename '", from.string(), "' over it: ", errno_text(code));
  }
}

/// The folder a path's file lives in ("." for a bare name).
inline std::filesystem::path folder_of(const std::filesystem::path& path) {
  return path.has_parent_path() ? path.parent_path() : std::filesystem::path(".");
}

/// The hidden name write_file_atomically gives its temp file for `target`, without mkostemp's six
/// random characters: ".NAME.tmp.". Built by appending: `"." + name + ...` trips GCC 12's
/// -Wrestrict false positive (PR 105329).
inline std::string temp_prefix(const std::filesystem::path& target) {
  std::string prefix = ".";
  prefix += target.filename().string();
  prefix += ".tmp.";
  return prefix;
}

/// fsync of the directory holding `path`, so that renames in it survive a power loss.
inline void sync_directory(const std::filesystem::path& path) {
  const std::filesystem::path dir = folder_of(path);
  const int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) {
    const int code = errno;
    CUPIPE_THROW(path.string(), ": written, but cannot open its directory '", dir.string(), "' to fsync it: ",
                 errno_text(code));
  }
  const int synced = ::fsync(fd);
  const int code = errno;
  ::close(fd);
  if (synced != 0)
    CUPIPE_THROW(path.string(), ": written, but fsync of its directory '", dir.string(), "' failed: ", errno_text(code));
}

}  // namespace detail

/// Replaces `target` with what `writer` writes. If anything fails (the writer throws, the disk is
/// full, the rename is refused) the previous file is left untouched, the temp file is removed, and
/// the error is rethrown; cupipe's own errors name the path and the errno text.
inline void write_file_atomically(const std::filesystem::path& target,
                                  const std::function<void(FileSink&)>& writer) {
  namespace fs = std::filesystem;
  CUPIPE_REQUIRE(target.has_filename(), "write_file_atomically: '", target.string(), "' does not name a file");
  const fs::path dir = detail::folder_of(target);
  // A hidden name in the same directory: rename() is atomic only within one filesystem.
  std::string temp = (dir / (detail::temp_prefix(target) + "XXXXXX")).string();
  int fd = ::mkostemp(temp.data(), O_CLOEXEC);
  if (fd < 0) {
    const int code = errno;
    CUPIPE_THROW(target.string(), ": cannot create a temporary file in '", dir.string(), "': ", detail::errno_text(code));
  }
  try {
    // mkostemp creates the file 0600; a saved file should be as readable as any other output.
    if (::fchmod(fd, 0644) != 0) {
      const int code = errno;
      CUPIPE_THROW(target.string(), ": cannot set the permissions of '", temp, "': ", detail::errno_text(code));
    }
    FileSink sink(fd, target);
    writer(sink);
    if (::fsync(fd) != 0) {
      const int code = errno;
      CUPIPE_THROW(target.string(), ": fsync of '", temp, "' failed: ", detail::errno_text(code));
    }
    const int closed = ::close(fd);
    fd = -1;
    if (closed != 0) {
      const int code = errno;
      CUPIPE_THROW(target.string(), ": closing '", temp, "' failed: ", detail::errno_text(code));
    }
    detail::rename_over(temp, target);
  } catch (...) {
    if (fd >= 0) ::close(fd);
    ::unlink(temp.c_str());
    throw;
  }
  detail::sync_directory(target);
}

/// Throws unless a file can be written at `target` now: its folder exists and accepts a new file (the
/// check creates and removes a temporary one). For output paths a long run writes at its end, so a
/// mistyped folder fails in the first second instead of after the work. `what` names the setting.
inline void check_writable(const std::filesystem::path& target, std::string_view what) {
  namespace fs = std::filesystem;
  if (!target.has_filename()) CUPIPE_THROW(what, " '", target.string(), "' does not name a file");
  const fs::path dir = detail::folder_of(target);
  std::error_code ec;
  if (!fs::is_directory(dir, ec))
    CUPIPE_THROW(what, " '", target.string(), "': the folder '", dir.string(), "' does not exist");
  if (fs::is_directory(target, ec)) CUPIPE_THROW(what, " '", target.string(), "' is a folder, not a file");
  std::string probe = (dir / ".cupipe-write-check.XXXXXX").string();
  const int fd = ::mkostemp(probe.data(), O_CLOEXEC);
  if (fd < 0) {
    const int code = errno;
    CUPIPE_THROW(what, " '", target.string(), "': cannot create files in '", dir.string(), "': ", detail::errno_text(code));
  }
  ::close(fd);
  ::unlink(probe.c_str());
}

/// Replaces `target` with `bytes`, atomically as above.
inline void write_file_atomically(const std::filesystem::path& target, std::span<const std::byte> bytes) {
  write_file_atomically(target, [bytes](FileSink& sink) { sink.write(bytes); });
}

/// Replaces `target` with `text`, atomically as above.
inline void write_file_atomically(const std::filesystem::path& target, std::string_view text) {
  write_file_atomically(target, [text](FileSink& sink) { sink.write(text); });
}

namespace detail {

/// A regular file opened for reading; every failure is a cupipe::error naming the path.
class InputFile {
 public:
  explicit InputFile(std::filesystem::path path) : path_(std::move(path)) {
    fd_ = ::open(path_.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd_ < 0) {
      const int code = errno;
      CUPIPE_THROW(path_.string(), ": cannot open: ", errno_text(code));
    }
    struct ::stat info {};
    if (::fstat(fd_, &info) != 0) {
      const int code = errno;
      ::close(fd_);
      CUPIPE_THROW(path_.string(), ": cannot stat: ", errno_text(code));
    }
    if (!S_ISREG(info.st_mode)) {
      ::close(fd_);
      CUPIPE_THROW(path_.string(), ": not a regular file", S_ISDIR(info.st_mode) ? " (it is a directory)" : "");
    }
    size_ = static_cast<std::uint64_t>(info.st_size);
  }
  InputFile(const InputFile&) = delete;
  InputFile& operator=(const InputFile&) = delete;
  ~InputFile() { ::close(fd_); }

  const std::filesystem::path& path() const noexcept { return path_; }
  /// The size when opened.
  std::uint64_t size() const noexcept { return size_; }

  /// Reads up to `size` bytes; returns fewer only at the end of the file.
  std::size_t read(void* data, std::size_t size) {
    auto* bytes = static_cast<std::byte*>(data);
    std::size_t done = 0;
    while (done < size) {
      const ::ssize_t n = ::read(fd_, bytes + done, size - done);
      if (n == 0) break;
      if (n < 0) {
        if (errno == EINTR) continue;
        const int code = errno;
        CUPIPE_THROW(path_.string(), ": read failed: ", errno_text(code));
      }
      done += static_cast<std::size_t>(n);
    }
    return done;
  }

 private:
  std::filesystem::path path_;
  int fd_ = -1;
  std::uint64_t size_ = 0;
};

}  // namespace detail
}  // namespace cupipe::io
