// SPDX-License-Identifier: Apache-2.0
// The key of a pipeline message: what it carries, for which virtual stage, for which microbatch.
// In-process mailboxes and inter-process transports use the same key.
#pragma once

#include <compare>
#include <cstdint>

namespace cupipe::comm {

/// What a message carries: an activation going forward or a gradient going backward.
enum class Flow : std::uint8_t { activation, gradient };

struct MessageKey {
  Flow flow;
  int virtual_stage;  ///< the receiving virtual stage
  int microbatch;
  auto operator<=>(const MessageKey&) const = default;
};

/// The key as one integer: (microbatch, virtual stage, flow) packed as MpiCommunicator's tag, which
/// flight-recorder dumps name beside the key.
constexpr long long message_tag(const MessageKey& key) {
  return (static_cast<long long>(key.microbatch) << 11) | (static_cast<long long>(key.virtual_stage) << 1) |
         static_cast<long long>(key.flow);
}

}  // namespace cupipe::comm
