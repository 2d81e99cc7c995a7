// SPDX-License-Identifier: Apache-2.0
// Wire: the precision a stage-to-stage hand-over carries (PipelineOptions::hand_over). `full` sends
// the storage type; `bf16` rounds each value to bfloat16; `e4m3` scales the tensor so that its
// largest magnitude is 448 and rounds each value to FP8 E4M3 (core/float8.hpp), then scales back.
// The receiver gets exactly what a compressed message would give it, on every backend.
#pragma once

#include <array>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "cupipe/core/error.hpp"

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

}  // namespace cupipe
