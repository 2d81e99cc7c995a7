// SPDX-License-Identifier: Apache-2.0
// Compressed hand-overs (PipelineOptions::hand_over): each link between neighbouring virtual stages
// may carry its activations forward and its gradients back in a narrower precision (core/wire.hpp:
// bf16, or FP8 E4M3 with a per-tensor scale). HandOverWires says which link carries what.
// Pipelines with one backend send the packed message (pipeline/wire_transport.hpp): fewer bytes.
// A pipeline with a backend per worker converts each value on the way (HandOverTransport), so there
// send_over makes the values a link delivers, a rounded copy in the sender's memory (the sender's
// own tensor stays as it was: its backward reads it), which that transport sends at full size.
#pragma once

#include <algorithm>
#include <cstddef>
#include <utility>
#include <vector>

#include "cupipe/core/error.hpp"
#include "cupipe/core/memory.hpp"
#include "cupipe/core/tensor.hpp"
#include "cupipe/core/wire.hpp"

namespace cupipe::pipeline {

class HandOverWires {
 public:
  HandOverWires() = default;
  /// `links`: empty (every link at full precision), one entry (every link), or one per link, entry k
  /// for the link between virtual stages k and k + 1 (`virtual_stages` - 1 of them).
  HandOverWires(std::vector<Wire> links, int virtual_stages) : links_(std::move(links)) {
    const std::size_t per_link = std::size_t(std::max(virtual_stages - 1, 0));
    CUPIPE_REQUIRE(links_.size() <= 1 || links_.size() == per_link, "PipelineOptions::hand_over has ", links_.size(),
                   " entries for ", virtual_stages, " virtual stages: give none (full precision), one (every link) or "
                   "one per link between neighbouring virtual stages (", per_link, ")");
  }
  /// The precision of the link between virtual stages a and b (neighbours, either direction).
  Wire between(int a, int b) const noexcept {
    if (links_.empty()) return Wire::full;
    if (links_.size() == 1) return links_.front();
    return links_[std::size_t(std::min(a, b))];
  }

 private:
  std::vector<Wire> links_;
};

/// Calls send(view) with `data` as a link of precision `wire` delivers it: `data` itself at full
/// precision, else a rounded copy in `be`'s memory (ops::wire_round_trip), freed after the send (a
/// transport copies what it sends before it returns, or orders the copy on the device's stream).
template <class B, class U, class Send>
void send_over(B& be, Wire wire, TensorView<const U, typename B::space> data, Send&& send) {
  if (wire == Wire::full) return send(data);
  auto rounded = be.template allocate<U>(data.numel(), MemoryTag::workspace);
  const TensorView<U, typename B::space> out{rounded.data(), data.shape()};
  wire_round_trip(be, data, out, wire);
  send(TensorView<const U, typename B::space>{out});
}

}  // namespace cupipe::pipeline
