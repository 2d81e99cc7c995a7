// SPDX-License-Identifier: Apache-2.0
// CommTransport: workers in other processes, through a comm::Communicator (MPI for host ranks, NCCL
// for device ranks). Data goes straight from the backend's memory when the communicator takes that
// memory (host backend and MPI, CUDA backend and NCCL); a CUDA backend under MPI stages through host
// memory. A worker's message to itself (a V-shaped placement's turn) stays in the process. abort()
// interrupts the communicator's point-to-point waits (Communicator::interrupt_waits), so a worker
// waiting for another process stops as one waiting on a mailbox does (Aborted), not at its deadline.
#pragma once

#include <memory>
#include <span>
#include <vector>

#include "cupipe/comm/communicator.hpp"
#include "cupipe/core/error.hpp"
#include "cupipe/core/memory.hpp"
#include "cupipe/pipeline/local_transport.hpp"
#include "cupipe/pipeline/transport.hpp"

namespace cupipe::pipeline {

template <class Backend>
class CommTransport final : public Transport<Backend> {
 public:
  using typename Transport<Backend>::T;
  using typename Transport<Backend>::buffer;

  CommTransport(std::shared_ptr<comm::Communicator> communicator, std::vector<Backend*> backends, double timeout_seconds)
      : comm_(std::move(communicator)), backends_(backends), timeout_(timeout_seconds), self_(backends, timeout_seconds) {
    CUPIPE_REQUIRE(!host_accessible<typename Backend::space> || !comm_->device_memory(), "Pipeline: a ", Backend::name,
                   " backend keeps its data in host memory, but the communicator moves device memory (use MPI)");
  }

  void begin_step(std::size_t capacity) override {
    comm_->resume_waits();
    self_.begin_step(capacity);
  }

  std::size_t send(int from, int to, const MessageKey& key, ConstViewOn<Backend, T> data) override {
    if (from == to) return self_.send(from, to, key, data);
    Backend& source = *backends_[std::size_t(from)];
    const auto describe = [&] { return "sending " + describe_message(key, "to", to); };
    const std::size_t bytes = std::size_t(data.numel()) * sizeof(T);
    if (direct()) {
      // A device communicator orders the send after the kernels queued on the stream (events); the
      // host waits for nothing. Host memory has nothing queued.
      if (void* stream = queue_of(source)) {
        comm_->send(to, key, data.data(), bytes, describe, stream);
        return bytes;
      }
      source.synchronize();
      comm_->send(to, key, data.data(), bytes, describe);
      return bytes;
    }
    std::vector<T> host(static_cast<std::size_t>(data.numel()));
    source.download(data.data(), std::span<T>(host));
    comm_->send(to, key, host.data(), bytes, describe);
    return bytes;
  }

  buffer spare(int at, index_t elements) override { return self_.spare(at, elements); }
  void recycle(int at, buffer&& message) override { self_.recycle(at, std::move(message)); }

  buffer receive(int at, int peer, const MessageKey& key, index_t elements) override {
    if (at == peer) return self_.receive(at, peer, key, elements);
    Backend& be = *backends_[std::size_t(at)];
    buffer data = self_.spare(at, elements);
    const auto describe = [&] { return "waiting for " + describe_message(key, "from", peer); };
    const std::size_t bytes = std::size_t(elements) * sizeof(T);
    try {
      if (direct()) {
        // The block may have come straight back from work still queued on this worker's stream; a
        // transport writing on its own stream must not start before that work is done. A device
        // communicator orders that with an event; the worker's queued kernels keep running while
        // the host waits for the message (within the transfer timeout).
        if (void* stream = queue_of(be)) {
          comm_->receive(peer, key, data.data(), bytes, timeout_, describe, stream);
          return data;
        }
        be.synchronize();
        comm_->receive(peer, key, data.data(), bytes, timeout_, describe);
        return data;
      }
      std::vector<T> host(static_cast<std::size_t>(elements));
      comm_->receive(peer, key, host.data(), bytes, timeout_, describe);
      be.upload(std::span<const T>(host), data.data());
      return data;
    } catch (const comm::Interrupted&) {
      throw Aborted{};
    }
  }

  void abort() override {
    self_.abort();
    comm_->interrupt_waits();
  }

  void finish_step() override { comm_->complete_sends(timeout_); }

 private:
  bool direct() const { return comm::reads_backend_memory<Backend>(*comm_); }

  /// The backend's CUDA stream, opaque, for a device communicator; null for host memory, and while
  /// an overlapped F&B pair runs on two streams (the host then synchronises the active one, which
  /// produced the data, as before). The stream must be on the communicator's device.
  void* queue_of(Backend& be) const {
    if constexpr (requires { be.stream(); be.context().overlapping(); }) {
      if (!comm_->device_memory() || be.context().overlapping()) return nullptr;
      return static_cast<void*>(be.stream());
    } else {
      return (void)be, nullptr;
    }
  }

  std::shared_ptr<comm::Communicator> comm_;
  std::vector<Backend*> backends_;
  double timeout_;
  LocalTransport<Backend> self_;
};

}  // namespace cupipe::pipeline
