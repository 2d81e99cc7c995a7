// SPDX-License-Identifier: Apache-2.0
// cupipe::error: every failure in cupipe is reported by throwing this, with the file:line where it
// was detected and, where there is one, the failing call (an expression, or a library function).
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>

namespace cupipe {

class error : public std::runtime_error {
 public:
  error(std::string message, std::string call, std::string file, int line)
      : std::runtime_error(format(message, call, file, line)),
        message_(std::move(message)),
        call_(std::move(call)),
        file_(std::move(file)),
        line_(line) {}

  /// The message alone, without location or call.
  const std::string& message() const noexcept { return message_; }
  /// The failing call or checked expression; empty when there is none.
  const std::string& call() const noexcept { return call_; }
  const std::string& file() const noexcept { return file_; }
  int line() const noexcept { return line_; }

 private:
  static std::string format(const std::string& message, const std::string& call,
                            const std::string& file, int line) {
    std::string out = message;
    if (!call.empty()) out += " [" + call + "]";
    out += " (at " + std::string(shown_file(file)) + ":" + std::to_string(line) + ")";
    return out;
  }

  /// The file as what() names it: a library header from its include root ("cupipe/io/checkpoint.hpp",
  /// wherever it is installed or checked out), anything else as given. file() keeps the full path.
  static std::string_view shown_file(std::string_view file) {
    constexpr std::string_view include_dir = "/include/";
    const std::size_t at = file.rfind("/include/cupipe/");
    return at == std::string_view::npos ? file : file.substr(at + include_dir.size());
  }

  std::string message_;
  std::string call_;
  std::string file_;
  int line_;
};

namespace detail {

/// Concatenates anything that streams into one string: str("stage ", 2, " got ", shape).
template <class... Args>
std::string str(const Args&... args) {
  std::ostringstream out;
  (out << ... << args);
  return out.str();
}

[[noreturn]] inline void throw_error(std::string message, std::string_view call, const char* file,
                                     int line) {
  throw error(std::move(message), std::string(call), file, line);
}

}  // namespace detail
}  // namespace cupipe

/// Throws cupipe::error with the message built from the arguments.
#define CUPIPE_THROW(...) ::cupipe::detail::throw_error(::cupipe::detail::str(__VA_ARGS__), "", __FILE__, __LINE__)

/// Throws cupipe::error naming the condition when it does not hold.
#define CUPIPE_REQUIRE(cond, ...)                                                                  \
  do {                                                                                             \
    if (!(cond)) [[unlikely]]                                                                      \
      ::cupipe::detail::throw_error(::cupipe::detail::str(__VA_ARGS__), #cond, __FILE__, __LINE__); \
  } while (0)
