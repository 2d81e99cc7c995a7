// SPDX-License-Identifier: Apache-2.0
// Test support for expert parallelism (the mixture-of-experts layer split over ranks):
// LocalExpertGroup: an expert-parallel group (moe::ExpertGroup) of threads in one process, for tests
// that run a mixture-of-experts layer's ranks side by side without MPI: each thread holds one
// group member, and the members meet at a barrier (every wait under a deadline, never spinning).
// One group (holders() 1). The sums add the ranks' values (host memory) in rank order, as
// MPI_Allreduce on two ranks does; the all-to-all moves its data when the ranks finish it, with
// std::memcpy, or with a given copy for device memory (then device_memory() is true, as NCCL's
// group: the CUDA tests pass cudaMemcpy, so a device backend's layers hand it their rows as they are).
// expert_part: a rank's parameters from the whole layer's. ExpertReference: the host's whole layer
// on two ranks' rows, the oracle of the CUDA and NCCL checks. on_threads: a rank per thread.
#pragma once

#include <algorithm>
#include <array>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <exception>
#include <functional>
#include <mutex>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "cupipe/backend/host/ops.hpp"
#include "cupipe/core/error.hpp"
#include "cupipe/core/rng.hpp"
#include "cupipe/core/shape.hpp"
#include "cupipe/layers/layer.hpp"
#include "cupipe/moe/expert_group.hpp"

namespace cupipe::testing {

/// What the members of one group share: a barrier and each member's buffers at the current call.
class LocalExperts {
 public:
  /// Copies `bytes` from `from` to `to` (the all-to-all's data).
  using Copy = std::function<void(void* to, const void* from, std::size_t bytes)>;
  /// `copy`: how the all-to-all moves its data (empty: host memory, std::memcpy).
  explicit LocalExperts(int size, Copy copy = {}, std::chrono::seconds deadline = std::chrono::seconds(120))
      : send_(std::size_t(size)), receive_(std::size_t(size)), send_counts_(std::size_t(size)),
        receive_counts_(std::size_t(size)), copy_(std::move(copy)), size_(size), deadline_(deadline) {}
  int size() const { return size_; }
  bool device_memory() const { return bool(copy_); }
  void copy(void* to, const void* from, std::size_t bytes) const {
    if (bytes == 0) return;
    if (copy_) copy_(to, from, bytes);
    else std::memcpy(to, from, bytes);
  }

  /// Waits until every member arrived; throws past the deadline (a member that failed never comes).
  void barrier(const char* what) {
    std::unique_lock<std::mutex> lock(mutex_);
    const long generation = generation_;
    if (++arrived_ == size_) {
      arrived_ = 0;
      ++generation_;
      changed_.notify_all();
      return;
    }
    if (!changed_.wait_for(lock, deadline_, [&] { return generation_ != generation; }))
      CUPIPE_THROW("a local expert group's ", what, ": not every member arrived within ", deadline_.count(), " s");
  }

  // Each member's pointers for the call in progress (written before a barrier, read after it).
  std::vector<const void*> send_;
  std::vector<void*> receive_;
  std::vector<const std::int64_t*> send_counts_, receive_counts_;

 private:
  Copy copy_;
  int size_;
  std::chrono::seconds deadline_;
  std::mutex mutex_;
  std::condition_variable changed_;
  int arrived_ = 0;
  long generation_ = 0;
};

class LocalExpertGroup final : public moe::ExpertGroup {
 public:
  LocalExpertGroup(LocalExperts& shared, int rank) : shared_(shared), rank_(rank) {}
  int size() const override { return shared_.size(); }
  int rank() const override { return rank_; }
  int holders() const override { return 1; }
  const char* name() const override { return "a local expert group"; }
  bool device_memory() const override { return shared_.device_memory(); }
  void sum(float* data, std::size_t n) override { sum_in_rank_order(data, n); }
  void sum(double* data, std::size_t n) override { sum_in_rank_order(data, n); }
  void sum_over_holders(float*, std::size_t) override {}
  void sum_over_holders(double*, std::size_t) override {}

  void exchange_counts(const std::int64_t* send, std::int64_t* receive, std::size_t per_rank) override {
    shared_.send_[std::size_t(rank_)] = send;
    shared_.barrier("counts' exchange");
    for (int q = 0; q < size(); ++q) {
      const auto* from = static_cast<const std::int64_t*>(shared_.send_[std::size_t(q)]) + per_rank * std::size_t(rank_);
      std::copy_n(from, per_rank, receive + per_rank * std::size_t(q));
    }
    shared_.barrier("counts' exchange, read");
  }
  void start_all_to_all(const float* send, const std::int64_t* sc, float* receive, const std::int64_t* rc) override {
    start(send, sc, receive, rc);
  }
  void start_all_to_all(const double* send, const std::int64_t* sc, double* receive, const std::int64_t* rc) override {
    start(send, sc, receive, rc);
  }
  void finish_all_to_all() override { finish_(); }

  /// All-to-alls this member finished.
  int all_to_alls = 0;

 private:
  template <class T>
  void start(const T* send, const std::int64_t* send_counts, T* receive, const std::int64_t* receive_counts) {
    counts_.assign(send_counts, send_counts + size());
    receive_counts_.assign(receive_counts, receive_counts + size());
    shared_.send_[std::size_t(rank_)] = send;
    shared_.receive_[std::size_t(rank_)] = receive;
    shared_.send_counts_[std::size_t(rank_)] = counts_.data();
    finish_ = [this, receive] {
      shared_.barrier("all-to-all");
      std::int64_t at = 0;
      for (int q = 0; q < size(); ++q) {
        const std::int64_t* theirs = shared_.send_counts_[std::size_t(q)];
        std::int64_t offset = 0;
        for (int r = 0; r < rank_; ++r) offset += theirs[r];
        CUPIPE_REQUIRE(theirs[rank_] == receive_counts_[std::size_t(q)], "a local expert group: rank ", q, " sends ",
                       theirs[rank_], " values to rank ", rank_, ", which expects ", receive_counts_[std::size_t(q)]);
        const T* from = static_cast<const T*>(shared_.send_[std::size_t(q)]) + offset;
        shared_.copy(receive + at, from, std::size_t(theirs[rank_]) * sizeof(T));
        at += theirs[rank_];
      }
      shared_.barrier("all-to-all, read");
      ++all_to_alls;
    };
  }
  template <class T>
  void sum_in_rank_order(T* data, std::size_t n) {
    shared_.receive_[std::size_t(rank_)] = data;
    shared_.barrier("sum");
    std::vector<T> total(n, T(0));
    for (int q = 0; q < size(); ++q)
      for (std::size_t i = 0; i < n; ++i) total[i] += static_cast<const T*>(shared_.receive_[std::size_t(q)])[i];
    shared_.barrier("sum, read");
    std::copy(total.begin(), total.end(), data);
  }

  LocalExperts& shared_;
  int rank_;
  std::vector<std::int64_t> counts_, receive_counts_;
  std::function<void()> finish_;
};

/// Rank `rank`'s parameters of an expert-parallel layer `Part` from the whole layer's (`Whole`):
/// every tensor Part holds whole is copied, every split one's rank-th share (TensorSplit::expert_rows).
template <class Whole, class Part, class T>
std::vector<T> expert_part(const std::vector<T>& whole, index_t width, int rank) {
  std::vector<T> part;
  std::size_t at = 0;
  const auto whole_specs = Whole::params(width);
  const auto part_specs = Part::params(width);
  CUPIPE_REQUIRE(whole_specs.size() == part_specs.size(), "expert_part: a part has the whole layer's tensors");
  for (std::size_t i = 0; i < whole_specs.size(); ++i) {
    const std::size_t n = std::size_t(part_specs[i].numel()), of = std::size_t(whole_specs[i].numel());
    const std::size_t first = at + (n == of ? 0 : n * std::size_t(rank));
    part.insert(part.end(), whole.begin() + std::ptrdiff_t(first), whole.begin() + std::ptrdiff_t(first + n));
    at += of;
  }
  return part;
}

/// Two ranks' rows for a check of an expert-parallel layer, and the host's whole layer (`Whole`) on
/// each rank's: its parameters `p` from Whole::init with `seed`, each rank's n rows of x and dy
/// uniform in [-1, 1]; y, dx and the parameters' gradient per rank, and that gradient summed over the
/// two (what each rank's experts must get: expert_part(summed, ...)).
template <class Whole, class T>
struct ExpertReference {
  std::vector<T> p, summed;
  std::array<std::vector<T>, 2> x, dy, y, dx, g;

  ExpertReference(index_t width, index_t n, std::uint64_t seed) {
    index_t params = 0;
    for (const ParamSpec& spec : Whole::params(width)) params += spec.numel();
    Rng rng(seed);
    p.resize(static_cast<std::size_t>(params));
    Whole::init(std::span<T>(p), width, rng);
    const Shape rows{n, width}, saved_shape{n, Whole::saved_per_row(width)};
    for (std::size_t t = 0; t < 2; ++t) {
      for (auto* v : {&x[t], &dy[t]}) {
        v->resize(std::size_t(n * width));
        for (T& e : *v) e = T(rng.uniform(-1, 1));
      }
      backend::Host<T> host;
      std::vector<T> saved(std::size_t(saved_shape.numel()));
      y[t].resize(std::size_t(n * width));
      dx[t].resize(std::size_t(n * width));
      g[t].assign(p.size(), T(0));
      const ConstView<T> xv{x[t].data(), rows}, dyv{dy[t].data(), rows};
      const TensorView<T> sv{saved.data(), saved_shape};
      Whole::forward(host, p.data(), xv, TensorView<T>{y[t].data(), rows}, sv);
      Whole::backward_input(host, p.data(), xv, sv, dyv, TensorView<T>{dx[t].data(), rows});
      Whole::backward_weight(host, xv, sv, dyv, g[t].data());
    }
    summed.resize(p.size());
    for (std::size_t i = 0; i < p.size(); ++i) summed[i] = g[0][i] + g[1][i];
  }
};

/// Runs `each(rank)` for ranks 0 .. size - 1 on a thread each; rethrows the first rank's error.
template <class Each>
void on_threads(int size, Each&& each) {
  std::vector<std::exception_ptr> errors(static_cast<std::size_t>(size));
  std::vector<std::thread> threads;
  for (int t = 0; t < size; ++t)
    threads.emplace_back([&, t] {
      try {
        each(t);
      } catch (...) {
        errors[std::size_t(t)] = std::current_exception();
      }
    });
  for (auto& thread : threads) thread.join();
  for (const auto& e : errors)
    if (e) std::rethrow_exception(e);
}

}  // namespace cupipe::testing
