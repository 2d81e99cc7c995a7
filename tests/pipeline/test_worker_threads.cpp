// SPDX-License-Identifier: Apache-2.0
// WorkerThreads (pipeline/worker_threads.hpp): one thread per worker for the pool's life, each step's
// job run on all of them at once, an exception carried back to the caller, and threads that are
// gone once the pool is.
#include "cupipe/pipeline/worker_threads.hpp"

#include <catch2/catch.hpp>

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
