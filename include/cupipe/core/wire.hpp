// SPDX-License-Identifier: Apache-2.0
// Wire: the precision a stage-to-stage hand-over carries (PipelineOptions::hand_over). `full` sends
// the storage type; `bf16` rounds each value to bfloat16; `e4m3` scales the tensor so that its
// largest magnitude is 448 and rounds each value to FP8 E4M3 (core/float8.hpp), then scales back.
// The receiver gets exactly what a compressed message would give it, on every backend.
//
// The packed message (ops::wire_pack and ops::wire_unpack) is what a compressed link moves:
// - bf16: each value's bfloat16, 2 bytes;
// - e4m3: an 8-byte header, then each value's E4M3 code, 1 byte. The header holds the tensor's
//   largest magnitude as a double (the scale is 448 over it), 0 for a tensor of zeros, and NaN when
//   some value is not finite: such a tensor arrives as all NaN, so the receiver's checks see it.
// The bytes sit in a buffer of the storage type, rounded up to whole elements (wire_elements), so
// every transport moves them as it moves any message. A bf16 link over bf16 storage packs nothing.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "cupipe/core/error.hpp"
#include "cupipe/core/shape.hpp"

namespace cupipe {

enum class Wire : std::uint8_t { full, bf16, e4m3 };

constexpr std::string_view name(Wire wire) noexcept {
  constexpr std::array<std::string_view, 3> names{"full", "bf16", "e4m3"};
  return names[std::size_t(wire)];
}

/// "full", "bf16" or "e4m3"; anything else is an error naming the choices.
inline Wire parse_wire(std::string_view text) {
  for (Wire w : {Wire::full, Wire::bf16, Wire::e4m3})
    if (name(w) == text) return w;
  CUPIPE_THROW("hand-over precision '", std::string(text), "' is not one of full, bf16, e4m3");
}

/// PipelineOptions::hand_over from text: one precision for every link ("bf16"), or one per link,
/// comma-separated ("full,e4m3,bf16"). "full" alone gives none: full precision everywhere.
inline std::vector<Wire> parse_wires(std::string_view text) {
  std::vector<Wire> links;
  while (true) {
    const std::size_t comma = text.find(',');
    links.push_back(parse_wire(text.substr(0, comma)));
    if (comma == std::string_view::npos) break;
    text.remove_prefix(comma + 1);
  }
  if (links.size() == 1 && links.front() == Wire::full) links.clear();
  return links;
}

/// The text parse_wires reads back: "full" for none, else the entries comma-separated.
inline std::string wires_text(const std::vector<Wire>& links) {
  if (links.empty()) return "full";
  std::string text;
  for (Wire w : links) text += (text.empty() ? "" : ",") + std::string(name(w));
  return text;
}

/// Bytes before an e4m3 message's codes: its largest magnitude as a double.
inline constexpr std::size_t wire_header_bytes = 8;

/// Whether a link of precision `wire` over storage T sends a packed message (fewer bytes).
template <class T>
constexpr bool wire_packs(Wire wire) noexcept {
  return wire == Wire::e4m3 || (wire == Wire::bf16 && sizeof(T) > 2);
}

/// Bytes of the packed message of n values: the header and one code each (e4m3), or 2 each (bf16).
constexpr std::size_t wire_bytes(Wire wire, index_t n) noexcept {
  return wire == Wire::e4m3 ? wire_header_bytes + std::size_t(n) : 2 * std::size_t(n);
}

/// Elements of T that hold the packed message of n values (wire_packs<T>(wire)).
template <class T>
constexpr index_t wire_elements(Wire wire, index_t n) noexcept {
  return index_t((wire_bytes(wire, n) + sizeof(T) - 1) / sizeof(T));
}

}  // namespace cupipe
