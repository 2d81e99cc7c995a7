// SPDX-License-Identifier: Apache-2.0
// The planner's measured link costs: what a hand-over between two stages costs (latency and
// bandwidth fitted to two message sizes) in one process (local_link, through the LocalTransport the
// pipeline uses there) or between ranks (rank_link, through a Communicator), how long a worker
// blocked in its mailbox takes to wake (wake_seconds), and what the data-parallel and
// tensor-parallel sums cost (replica_sum_bandwidth, tensor_sum_cost), and an expert group's
// all-to-all (all_to_all_cost). calibrate.hpp puts the
// in-process figures into a CostModel; the ones between ranks are collective and left to the caller.
#pragma once

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <limits>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "cupipe/comm/communicator.hpp"
#include "cupipe/core/error.hpp"
#include "cupipe/core/memory.hpp"
#include "cupipe/core/shape.hpp"
#include "cupipe/core/tensor.hpp"
#include "cupipe/core/tensor_group.hpp"
#include "cupipe/moe/expert_group.hpp"
#include "cupipe/pipeline/local_transport.hpp"
#include "cupipe/pipeline/rebalance.hpp"

namespace cupipe::planner {

/// A hand-over's cost.
struct LinkCost {
  double latency = 0;           ///< seconds
  double bytes_per_second = 0;  ///< 0: free
};

namespace detail {
/// Latency and bandwidth through two (bytes, seconds) points; a size that took no longer gives a
/// free bandwidth (0). Where the line through them meets zero bytes below zero seconds (a transport
/// whose cost per byte grows with the size, as MPI's does when it fragments a large message), the
/// small message's whole time is the latency, so small messages are not predicted free.
inline LinkCost fit_link(double t_small, double t_large, double bytes_small, double bytes_large) {
  LinkCost out;
  const double per_byte = std::max(0.0, (t_large - t_small) / (bytes_large - bytes_small));
  out.bytes_per_second = per_byte > 0 ? 1.0 / per_byte : 0.0;
  const double intercept = t_small - per_byte * bytes_small;
  out.latency = intercept > 0 ? intercept : std::max(0.0, t_small);
  return out;
}
}  // namespace detail

/// Measured cost of an in-process hand-over between two workers' contexts of `Backend`, as the
/// pipeline makes it (LocalTransport: allocate on the receiver, copy, post; then take): latency and
/// bandwidth fitted to messages of `small` and `large` values (median of `repeats` each).
template <class Backend>
LinkCost local_link(index_t small = index_t(1) << 10, index_t large = index_t(1) << 20, int repeats = 9) {
  using T = typename Backend::value_type;
  CUPIPE_REQUIRE(small >= 1 && large > small, "planner: time hand-overs of two sizes, got ", small, " and ", large, " values");
  Backend a, b;
  pipeline::LocalTransport<Backend> link({&a, &b}, 60);
  auto data = a.template allocate<T>(large, MemoryTag::activations);
  fill(a, ViewOn<Backend, T>{data.data(), Shape{large}}, T(1));
  const auto time = [&](index_t n) {
    int j = 0;
    return cupipe::detail::median_seconds(repeats, [&] {
      link.begin_step(1);
      const comm::MessageKey key{comm::Flow::activation, 1, j++};
      link.send(0, 1, key, ConstViewOn<Backend, T>{data.data(), Shape{n}});
      (void)link.receive(1, 0, key, n);
      b.synchronize();
    });
  };
  const double t_small = time(small), t_large = time(large);
  return detail::fit_link(t_small, t_large, double(small) * sizeof(T), double(large) * sizeof(T));
}

/// Measured bytes per second of a forward record's copy between a context of `Backend` and host
/// memory, one way (CostModel::offload_bytes_per_second): the backend's download and then upload
/// of `values` values, as activation offload moves a record out and back (StageExecutor::send_out,
/// bring_back), the median of `repeats` round trips over twice the bytes. 0 for a backend whose
/// memory is host memory: there offload only moves a record from one host buffer to another and
/// frees nothing, so the planner must not offer it.
template <class Backend>
double offload_bandwidth(index_t values = index_t(1) << 20, int repeats = 5) {
  using T = typename Backend::value_type;
  CUPIPE_REQUIRE(values >= 1 && repeats >= 1, "planner: time offload copies of at least one value, once");
  if constexpr (host_accessible<typename Backend::space>) return 0.0;
  Backend be;
  auto data = be.template allocate<T>(values, MemoryTag::activations);
  fill(be, ViewOn<Backend, T>{data.data(), Shape{values}}, T(1));
  HostBuffer<T> host(values, nullptr, MemoryTag::activations, BlockFill::none);
  be.synchronize();
  const double seconds = cupipe::detail::median_seconds(repeats, [&] {
    be.download(data.data(), host.span());
    be.upload(std::span<const T>(host.span()), data.data());
    be.synchronize();
  });
  return seconds > 0 ? 2.0 * double(values) * sizeof(T) / seconds : 0.0;
}

/// Measured seconds after which a worker blocked in its mailbox runs once a message for it is
/// posted (CostModel::wake_seconds): two threads pass a one-value message back and forth through a
/// LocalTransport, as two workers of a pipeline do, `round_trips` times after a few to warm up;
/// half the median round trip, less half the same round trip made on one thread (the copies and
/// the bookkeeping, which the planner charges to the sender's action), is the figure. Never negative.
/// On a lightly loaded Linux host it is tens of microseconds: a sleeping thread is woken by the
/// scheduler, not by the post.
template <class Backend>
double wake_seconds(int round_trips = 101) {
  using T = typename Backend::value_type;
  CUPIPE_REQUIRE(round_trips >= 1, "planner: time at least one round trip, got ", round_trips);
  Backend a, b;
  pipeline::LocalTransport<Backend> link({&a, &b}, 60);
  auto there = a.template allocate<T>(1, MemoryTag::activations);
  fill(a, ViewOn<Backend, T>{there.data(), Shape{1}}, T(1));
  a.synchronize();
  constexpr int warm = 5;
  const int total = warm + round_trips;
  link.begin_step(2);
  std::exception_ptr failed;
  // Worker 1 takes each message and sends it straight back.
  std::thread echo([&] {
    try {
      for (int j = 0; j < total; ++j) {
        auto message = link.receive(1, 0, comm::MessageKey{comm::Flow::activation, 1, j}, 1);
        link.send(1, 0, comm::MessageKey{comm::Flow::gradient, 0, j}, ConstViewOn<Backend, T>{message.data(), Shape{1}});
      }
    } catch (...) {
      failed = std::current_exception();
      link.abort();
    }
  });
  std::vector<double> halves;
  try {
    for (int j = 0; j < total; ++j) {
      const auto start = std::chrono::steady_clock::now();
      link.send(0, 1, comm::MessageKey{comm::Flow::activation, 1, j}, ConstViewOn<Backend, T>{there.data(), Shape{1}});
      (void)link.receive(0, 1, comm::MessageKey{comm::Flow::gradient, 0, j}, 1);
      a.synchronize();
      if (j >= warm) halves.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() / 2);
      // Give the echo thread time to block again, as a worker between its actions does.
      std::this_thread::sleep_for(std::chrono::microseconds(200));
    }
  } catch (const pipeline::Aborted&) {  // the echo thread failed first: its error is the one
    echo.join();
    if (failed) std::rethrow_exception(failed);
    throw;
  } catch (...) {
    link.abort();
    echo.join();
    throw;
  }
  echo.join();
  if (failed) std::rethrow_exception(failed);
  const double half = cupipe::detail::median(std::move(halves));
  // The same round trip made on one thread: its half is a hand-over's own cost.
  link.begin_step(1);
  int k = 0;
  const double alone = cupipe::detail::median_seconds(round_trips, [&] {
    const comm::MessageKey key{comm::Flow::activation, 1, k}, back{comm::Flow::gradient, 0, k};
    ++k;
    link.send(0, 1, key, ConstViewOn<Backend, T>{there.data(), Shape{1}});
    auto message = link.receive(1, 0, key, 1);
    link.send(1, 0, back, ConstViewOn<Backend, T>{message.data(), Shape{1}});
    (void)link.receive(0, 1, back, 1);
    a.synchronize();
  }) / 2;
  return std::max(0.0, half - alone);
}

/// Measured cost of a hand-over between this replica's stages 0 and 1 through `comm`, as the pipeline
/// makes it between processes (MPI between host ranks, NCCL between GPUs): a ping-pong of `small`
/// and `large` values of Backend's type, in Backend's memory where the communicator reads it (else
/// in host memory, as CommTransport stages it), one warm-up and at least `repeats` round trips per
/// size, alternating; half the fastest round trip, fitted to latency + bytes / bandwidth. Collective
/// over the replica's stages: every stage calls it (stages past 1 only wait), and every stage returns
/// stage 0's figures, or every stage throws where the large size never took longer than the small.
template <class Backend>
LinkCost rank_link(comm::Communicator& comm, Backend& be, index_t small = index_t(1) << 10,
                   index_t large = index_t(1) << 20, int repeats = 9, double timeout_seconds = 60) {
  using T = typename Backend::value_type;
  const comm::Topology& topology = comm.topology();
  CUPIPE_REQUIRE(topology.stages >= 2, "planner: a link between ranks needs two pipeline stages, this run has ",
                 topology.stages);
  CUPIPE_REQUIRE(small >= 1 && large > small, "planner: time hand-overs of two sizes, got ", small, " and ", large, " values");
  const int stage = topology.stage();
  double t_small = 0, t_large = 0;
  if (stage <= 1) {
    const bool direct = comm::reads_backend_memory<Backend>(comm);
    auto on_backend = be.template allocate<T>(direct ? large : 0, MemoryTag::workspace);
    std::vector<T> on_host(direct ? 0 : std::size_t(large), T(1));
    if (direct) {
      fill(be, ViewOn<Backend, T>{on_backend.data(), Shape{large}}, T(1));
      be.synchronize();
    }
    void* data = direct ? static_cast<void*>(on_backend.data()) : static_cast<void*>(on_host.data());
    int j = 0;
    const auto describe = [] { return std::string("the planner's link measurement between stages 0 and 1"); };
    const auto round_trip = [&](index_t n) {
      const std::size_t bytes = std::size_t(n) * sizeof(T);
      const comm::MessageKey there{comm::Flow::activation, 1, j}, back{comm::Flow::gradient, 0, j};
      ++j;
      if (stage == 0) {
        comm.send(1, there, data, bytes, describe);
        comm.receive(1, back, data, bytes, timeout_seconds, describe);
      } else {
        comm.receive(0, there, data, bytes, timeout_seconds, describe);
        comm.send(0, back, data, bytes, describe);
      }
    };
    const auto time = [&](index_t n) {
      const auto start = std::chrono::steady_clock::now();
      round_trip(n);
      return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() / 2;
    };
    round_trip(small);  // warm-up: connections, buffers
    round_trip(large);
    // The two sizes alternate and each keeps its fastest round trip: other processes on the machine
    // only ever add time (a descheduled rank costs milliseconds), so the fastest is the link's own
    // cost, and a burst of load cannot land on one size alone. Where the large message still looks
    // no slower than the small one, more rounds follow (the same count on both ranks: stage 1 takes
    // stage 0's verdict with the echo), up to four times as many.
    t_small = t_large = std::numeric_limits<double>::infinity();
    for (int round = 0; round < 4 * repeats; ++round) {
      t_small = std::min(t_small, time(small));
      t_large = std::min(t_large, time(large));
      int more = round + 1 < repeats || t_large <= t_small ? 1 : 0;
      // Stage 0 decides; stage 1 learns the decision in one small message each round.
      const comm::MessageKey verdict{comm::Flow::activation, 2, j++};
      if (stage == 0) {
        comm.send(1, verdict, &more, sizeof more, describe);
      } else {
        comm.receive(0, verdict, &more, sizeof more, timeout_seconds, describe);
      }
      if (!more) break;
    }
    comm.complete_sends(timeout_seconds);
  }
  t_small = comm.sum_over_stages(stage == 0 ? t_small : 0.0);
  t_large = comm.sum_over_stages(stage == 0 ? t_large : 0.0);
  // Every stage holds stage 0's figures now, so every stage refuses them together.
  CUPIPE_REQUIRE(t_large > t_small, "planner: the link measurement between stages 0 and 1 is inconsistent: ",
                 large * sizeof(T), " bytes never took longer than ", small * sizeof(T), " bytes in ", 4 * repeats,
                 " round trips each (the fastest: ", t_large * 1e6, " us against ", t_small * 1e6,
                 " us); the machine is too busy to measure it");
  return detail::fit_link(t_small, t_large, double(small) * sizeof(T), double(large) * sizeof(T));
}

/// Measured bandwidth of the data-parallel gradient sum through `comm`, in the planner's terms
/// (CostModel::allreduce_bytes_per_second: a ring moves 2 (d - 1) / d of the bytes per replica):
/// `values` floats summed over each stage's replicas, one warm-up, then `rounds` rounds of `repeats`
/// sums, each round's median averaged over every rank; the fastest round. Collective over every
/// rank. 0 (free) with one replica.
///
/// The fastest round, since a process's first sums can be far slower than its steady state: in
/// gpt_train under mpirun (4 processes, 2 cores) the first round through a fresh communicator
/// measured 0.05 GB/s and the next two 1.4 and 2.15, while training's sums run warm.
inline double replica_sum_bandwidth(comm::Communicator& comm, index_t values = index_t(1) << 20, int repeats = 5,
                                    int rounds = 3) {
  const comm::Topology& topology = comm.topology();
  if (topology.replicas < 2) return 0.0;
  CUPIPE_REQUIRE(values >= 1, "planner: sum at least one value, got ", values);
  CUPIPE_REQUIRE(repeats >= 1 && rounds >= 1, "planner: time at least one round of one sum, got ", rounds, " of ", repeats);
  std::vector<float> data(static_cast<std::size_t>(values), 1.0f);
  comm.sum_over_replicas(data.data(), data.size());  // warm-up
  double fastest = std::numeric_limits<double>::infinity();
  for (int round = 0; round < rounds; ++round) {
    const double seconds = cupipe::detail::median_seconds(repeats, [&] { comm.sum_over_replicas(data.data(), data.size()); });
    fastest = std::min(fastest, comm.sum_over_world(seconds) / double(topology.world));  // every rank: the same value
  }
  const double d = double(topology.replicas);
  return fastest > 0 ? 2.0 * (d - 1) / d * double(values) * sizeof(float) / fastest : 0.0;
}

/// Seconds per call and bandwidth of a sum over `comm`'s tensor-parallel group (every rank of the
/// world takes part): the mean over the ranks of the median of `repeats` sums of 1 value (the
/// latency) and of `values` values. Zero where the group has one rank.
inline LinkCost tensor_sum_cost(comm::Communicator& comm, index_t values = index_t(1) << 18, int repeats = 7) {
  TensorGroup* group = comm.tensor_group();
  if (group == nullptr || group->size() < 2) return {};
  CUPIPE_REQUIRE(values >= 2, "planner: time the tensor-parallel sum on at least two values, got ", values);
  std::vector<float> data(static_cast<std::size_t>(values), 1.0f);
  const double small = cupipe::detail::median_seconds(repeats, [&] { group->sum(data.data(), 1); });
  const double large = cupipe::detail::median_seconds(repeats, [&] { group->sum(data.data(), data.size()); });
  const double world = double(comm.topology().world);
  const double latency = comm.sum_over_world(small) / world, whole = comm.sum_over_world(large) / world;
  const double t = double(group->size());
  const double bytes = 2.0 * (t - 1) / t * double(values - 1) * sizeof(float);
  return {latency, whole > latency ? bytes / (whole - latency) : 0.0};
}

/// Seconds per all-to-all and bandwidth over `comm`'s expert group (Communicator::expert_group), in
/// the planner's terms (CostModel::all_to_all_latency and all_to_all_bytes_per_second: the bytes
/// that leave a rank, (ranks - 1) / ranks of what it sends): the mean over the world of the median
/// of `repeats` all-to-alls, started and finished, in which each rank sends 1 value to each rank of
/// the group (the latency) and `values` in all. Collective over every rank. Zero without a group
/// of 2 or more.
inline LinkCost all_to_all_cost(comm::Communicator& comm, index_t values = index_t(1) << 18, int repeats = 7) {
  moe::ExpertGroup* group = comm.expert_group();
  if (group == nullptr || group->size() < 2) return {};
  const auto ranks = std::size_t(group->size());
  CUPIPE_REQUIRE(values >= index_t(2 * ranks), "planner: time the all-to-all on at least 2 values per rank, got ", values);
  const auto per_rank = static_cast<std::int64_t>(std::size_t(values) / ranks);
  std::vector<float> send(ranks * std::size_t(per_rank), 1.0f), receive(send.size());
  const auto exchange = [&](std::int64_t each) {
    const std::vector<std::int64_t> counts(ranks, each);
    group->start_all_to_all(send.data(), counts.data(), receive.data(), counts.data());
    group->finish_all_to_all();
  };
  exchange(per_rank);  // warm-up
  const double small = cupipe::detail::median_seconds(repeats, [&] { exchange(1); });
  const double large = cupipe::detail::median_seconds(repeats, [&] { exchange(per_rank); });
  const double world = double(comm.topology().world);
  const double latency = comm.sum_over_world(small) / world, whole = comm.sum_over_world(large) / world;
  const double leaving = double(ranks - 1) * double(per_rank - 1) * sizeof(float);  // beyond the latency's value each
  return {latency, whole > latency ? leaving / (whole - latency) : 0.0};
}

}  // namespace cupipe::planner
