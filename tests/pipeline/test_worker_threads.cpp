// SPDX-License-Identifier: Apache-2.0
// WorkerThreads (pipeline/worker_threads.hpp): one thread per worker for the pool's life, each step's
// job run on all of them at once, an exception carried back to the caller, threads that are gone
// once the pool is, and threads pinned each to its own share of the CPUs where asked.
#include "cupipe/pipeline/worker_threads.hpp"

#include "cupipe/core/cpus.hpp"

#include <catch2/catch.hpp>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <mutex>
#include <stdexcept>
#include <thread>
#include <vector>

namespace {

using cupipe::pipeline::WorkerThreads;

TEST_CASE("worker threads: the same thread runs a worker's job at every step", "[pipeline][threads]") {
  WorkerThreads threads({0, 2, 5});
  std::vector<std::thread::id> first(6), now(6);
  std::vector<int> runs(6, 0);
  auto job = [&](int w) {
    now[std::size_t(w)] = std::this_thread::get_id();
    ++runs[std::size_t(w)];
  };
  threads.run(job);
  first = now;
  for (int step = 0; step < 50; ++step) {
    threads.run(job);
    CHECK(now == first);
  }
  CHECK(threads.threads_started() == 3);
  CHECK(runs == std::vector<int>{51, 0, 51, 0, 0, 51});
  CHECK(first[0] != first[2]);
  CHECK(first[0] != std::this_thread::get_id());
}

TEST_CASE("worker threads: every worker's job runs at the same time", "[pipeline][threads]") {
  // Each job waits until all three have started: run in turn, they would never finish. The wait has
  // a deadline, so a broken pool fails the test instead of hanging it.
  WorkerThreads threads({0, 1, 2});
  std::mutex mutex;
  std::condition_variable cv;
  int arrived = 0;
  std::atomic<int> met{0};
  auto job = [&](int) {
    std::unique_lock lock(mutex);
    ++arrived;
    cv.notify_all();
    if (cv.wait_for(lock, std::chrono::seconds(20), [&] { return arrived % 3 == 0; })) ++met;
  };
  for (int step = 0; step < 5; ++step) threads.run(job);
  CHECK(met == 15);
}

TEST_CASE("worker threads: a job's exception reaches the caller after every worker is done", "[pipeline][threads]") {
  WorkerThreads threads({0, 1});
  std::atomic<int> finished{0};
  auto failing = [&](int w) {
    if (w == 1) throw std::runtime_error("worker 1 failed");
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    ++finished;
  };
  CHECK_THROWS_WITH(threads.run(failing), "worker 1 failed");
  CHECK(finished == 1);  // worker 0 had finished its job before run() returned
  auto fine = [&](int) { ++finished; };
  threads.run(fine);  // the pool runs on
  CHECK(finished == 3);
  CHECK(threads.threads_started() == 2);
}

}  // namespace

#if defined(__linux__)
TEST_CASE("worker threads: pinned ones each run on a share of the CPUs of their own, unpinned ones on any",
          "[pipeline][threads]") {
  const std::vector<int> allowed = cupipe::core::cpus::allowed();
  REQUIRE_FALSE(allowed.empty());
  auto idle = [](int) {};
  for (const std::size_t count : {std::size_t(2), std::size_t(3)}) {
    std::vector<int> workers(count);
    for (std::size_t i = 0; i < count; ++i) workers[i] = int(i);
    std::vector<std::vector<int>> seen(count);
    auto job = [&](int w) { seen[std::size_t(w)] = cupipe::core::cpus::allowed(); };
    {
      WorkerThreads loose(workers);
      loose.run(job);
      CHECK(loose.pinned_cpus().empty());
      for (const std::vector<int>& cpus : seen) CHECK(cpus == allowed);
    }
    WorkerThreads pinned(workers, true);
    pinned.run(job);
    if (allowed.size() < count) {  // too few CPUs to give each its own
      CHECK(pinned.pinned_cpus().empty());
      for (const std::vector<int>& cpus : seen) CHECK(cpus == allowed);
      continue;
    }
    // Contiguous shares of the allowed CPUs, in order, sizes within one of each other, and each
    // thread runs on its own.
    REQUIRE(pinned.pinned_cpus().size() == count);
    std::vector<int> dealt;
    std::size_t least = allowed.size(), most = 0;
    for (std::size_t i = 0; i < count; ++i) {
      const std::vector<int>& share = pinned.pinned_cpus()[i];
      CHECK(seen[i] == share);
      dealt.insert(dealt.end(), share.begin(), share.end());
      least = std::min(least, share.size());
      most = std::max(most, share.size());
    }
    CHECK(dealt == allowed);
    CHECK(least >= 1);
    CHECK(most - least <= 1);
    if (allowed.size() == count)
      for (std::size_t i = 0; i < count; ++i) CHECK(seen[i] == std::vector<int>{allowed[i]});
    // The caller's thread (which runs a flush update) stays free.
    CHECK(cupipe::core::cpus::allowed() == allowed);
  }
  // One worker is never pinned.
  WorkerThreads one({3}, true);
  one.run(idle);
  CHECK(one.pinned_cpus().empty());
  // More workers than CPUs: none pinned.
  std::vector<int> many(allowed.size() + 1);
  for (std::size_t i = 0; i < many.size(); ++i) many[i] = int(i);
  WorkerThreads crowded(many, true);
  crowded.run(idle);
  CHECK(crowded.pinned_cpus().empty());
}
#endif
