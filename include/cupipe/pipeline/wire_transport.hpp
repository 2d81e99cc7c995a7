// SPDX-License-Identifier: Apache-2.0
// WireTransport: compressed hand-overs with fewer bytes on the wire (PipelineOptions::hand_over).
// It wraps the pipeline's transport (LocalTransport or CommTransport) when some link packs: a message
// on such a link leaves as its packed form (core/wire.hpp: bf16 values, or an E4M3 code per value
// after an 8-byte header), which the inner transport moves as any message, in a buffer of the
// storage type a half or about a quarter the size; the receiver unpacks it into a message of the
// full size (ops::wire_pack, ops::wire_unpack on the workers' backends). Both buffers come from the
// inner transport's spares and go back to them, so a steady host run allocates nothing for them.
//
// The receiver computes with ops::wire_round_trip's values, bitwise, for every finite tensor. A
// tensor with a value that is not finite arrives as all NaN (the round trip keeps it unchanged),
// so the receiver's checks see it either way.
//
// Which link a message crossed follows from its key: an activation for virtual stage k came over
// the link (k - 1, k), a gradient for k over (k, k + 1). Pipelines with a backend per worker
// (HandOverTransport) round with the round trip instead and send full messages.
#pragma once

#include <cstddef>
#include <memory>
#include <utility>
#include <vector>

#include "cupipe/core/memory.hpp"
#include "cupipe/core/tensor.hpp"
#include "cupipe/core/wire.hpp"
#include "cupipe/pipeline/hand_over_wire.hpp"
#include "cupipe/pipeline/transport.hpp"

namespace cupipe::pipeline {

template <class Backend>
class WireTransport final : public Transport<Backend> {
 public:
  using typename Transport<Backend>::T;
  using typename Transport<Backend>::buffer;

  /// `backends[w]`: worker w's context (null for workers of other processes), which packs what w
  /// sends and unpacks what it receives.
  WireTransport(std::unique_ptr<Transport<Backend>> inner, std::vector<Backend*> backends, HandOverWires wires)
      : inner_(std::move(inner)), backends_(std::move(backends)), wires_(std::move(wires)) {}

  /// Whether a pipeline with these links needs a WireTransport: some link packs over storage T.
  static bool needed(const std::vector<Wire>& links) {
    for (Wire w : links)
      if (wire_packs<T>(w)) return true;
    return false;
  }

  void begin_step(std::size_t capacity) override { inner_->begin_step(capacity); }

  std::size_t send(int from, int to, const MessageKey& key, ConstViewOn<Backend, T> data) override {
    const Wire wire = wire_of(key);
    if (!wire_packs<T>(wire)) return inner_->send(from, to, key, data);
    const index_t elements = wire_elements<T>(wire, data.numel());
    buffer packed = inner_->spare(from, elements);
    const ViewOn<Backend, T> out{packed.data(), Shape{elements}};
    wire_pack(*backends_[std::size_t(from)], data, out, wire);
    const std::size_t sent = inner_->send(from, to, key, ConstViewOn<Backend, T>{out});
    inner_->recycle(from, std::move(packed));  // the inner transport copied it, or ordered its copy
    return sent;
  }

  buffer receive(int at, int peer, const MessageKey& key, index_t elements) override {
    const Wire wire = wire_of(key);
    if (!wire_packs<T>(wire)) return inner_->receive(at, peer, key, elements);
    const index_t packed_elements = wire_elements<T>(wire, elements);
    buffer packed = inner_->receive(at, peer, key, packed_elements);
    buffer values = inner_->spare(at, elements);
    wire_unpack(*backends_[std::size_t(at)], ConstViewOn<Backend, T>{packed.data(), Shape{packed_elements}},
                ViewOn<Backend, T>{values.data(), Shape{elements}}, wire);
    inner_->recycle(at, std::move(packed));
    return values;
  }

  buffer spare(int at, index_t elements) override { return inner_->spare(at, elements); }
  void recycle(int at, buffer&& message) override { inner_->recycle(at, std::move(message)); }
  void abort() override { inner_->abort(); }
  void finish_step() override { inner_->finish_step(); }

 private:
  Wire wire_of(const MessageKey& key) const {
    const int k = key.virtual_stage;
    return key.flow == Flow::activation ? wires_.between(k - 1, k) : wires_.between(k, k + 1);
  }

  std::unique_ptr<Transport<Backend>> inner_;
  std::vector<Backend*> backends_;
  HandOverWires wires_;
};

}  // namespace cupipe::pipeline
