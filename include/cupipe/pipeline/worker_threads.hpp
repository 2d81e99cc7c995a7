// SPDX-License-Identifier: Apache-2.0
// WorkerThreads: one thread per local worker, started at the first step and kept until the pipeline
// is destroyed. Each waits on a condition between steps (no spinning), runs the step's job for its
// worker and reports back; the caller's thread waits until every worker is done. Before, each step
// made and joined a std::jthread per worker: 10-20 us of thread creation per worker and step, a
// cold stack and cache for every step's first action, and a fresh thread for the OS to place.
//
// Where asked (PipelineOptions::pin_workers), each thread runs on cores of its own: Linux's
// wake-affine placement otherwise puts a worker woken by its neighbour's message on the neighbour's
// core, where it waits for a time slice while another core idles (perf sched on a 2-core VM: both
// workers of a 2-stage MLP on one core, 2.5 ms waits in a 12 ms step).
//
// The wait for the workers has no deadline of its own: a worker's waits (receives, sends,
// collectives) each have one and fail the step, and its compute ends by itself. The job runs with
// no heap allocation: it is a pointer to the caller's callable and a trampoline.
#pragma once

#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <mutex>
#include <thread>
#include <utility>
#include <vector>

#include <unistd.h>

#include "cupipe/core/cpus.hpp"
#include "cupipe/core/error.hpp"

namespace cupipe::pipeline {

class WorkerThreads {
 public:
  /// The threads run the workers `workers` (their indices; this process's workers). `pin`: with two
  /// or more of them and at least as many CPUs allowed to this process, thread i runs on the i-th
  /// share of the allowed CPUs (one CPU each where there are as many CPUs as workers; Linux;
  /// elsewhere, or where the OS refuses, the threads stay unpinned).
  explicit WorkerThreads(std::vector<int> workers, bool pin = false) : workers_(std::move(workers)), pin_(pin) {}
  WorkerThreads(const WorkerThreads&) = delete;
  WorkerThreads& operator=(const WorkerThreads&) = delete;
  ~WorkerThreads() {
    {
      std::lock_guard lock(mutex_);
      stop_ = true;
    }
    start_.notify_all();
    // jthreads join here.
  }

  /// Calls job(w) on worker w's thread for every worker and returns when all have returned. A job
  /// should not throw; if one does, the first exception is rethrown here after every worker is done.
  /// One run at a time: a second caller while one runs is an error.
  template <class Job>
  void run(Job& job) {
    std::unique_lock lock(mutex_);
    CUPIPE_REQUIRE(remaining_ == 0, "Pipeline: a step was started while another step of the same pipeline runs "
                                    "(steps of one pipeline must not overlap: call them from one thread)");
    if (threads_.empty()) start_threads();
    else
      CUPIPE_REQUIRE(::getpid() == owner_, "Pipeline: used in a process made by fork() after its first step; the "
                                           "worker threads stayed in the parent (make a new Pipeline in the child)");
    job_ = &job;
    call_ = [](void* j, int w) { (*static_cast<Job*>(j))(w); };
    failure_ = nullptr;
    remaining_ = int(workers_.size());
    ++generation_;
    start_.notify_all();
    done_.wait(lock, [&] { return remaining_ == 0; });
    job_ = nullptr;
    if (failure_) std::rethrow_exception(std::exchange(failure_, nullptr));
  }

  /// Threads this object started (over its life): one per worker, whatever the number of steps.
  std::size_t threads_started() const noexcept { return started_; }
  /// The CPUs each worker's thread is pinned to (its share), in the order of the workers given;
  /// empty where they are not pinned (not asked, too few CPUs, one worker, not Linux, or the OS
  /// refused).
  const std::vector<std::vector<int>>& pinned_cpus() const noexcept { return pinned_; }

 private:
  void start_threads() {
    owner_ = ::getpid();
    threads_.reserve(workers_.size());
    for (int w : workers_) threads_.emplace_back([this, w] { loop(w); });
    started_ += workers_.size();
    if (pin_) pin_threads();
  }

  /// Each thread on its own share of the allowed CPUs, all or none (a refusal unpins the ones
  /// already pinned): the CPUs in order, dealt into contiguous shares whose sizes differ by at
  /// most one. A worker's BLAS threads inherit its share.
  void pin_threads() {
#if defined(__linux__)
    if (threads_.size() < 2) return;
    const std::vector<int> allowed = core::cpus::allowed();
    std::vector<std::vector<int>> shares = core::cpus::shares(allowed, threads_.size());
    if (shares.empty()) return;
    for (std::size_t i = 0; i < threads_.size(); ++i)
      if (!core::cpus::pin(threads_[i].native_handle(), shares[i])) {
        for (std::size_t j = 0; j < i; ++j) core::cpus::pin(threads_[j].native_handle(), allowed);
        return;
      }
    pinned_ = std::move(shares);
#endif
  }

  void loop(int w) {
    std::uint64_t seen = 0;
    std::unique_lock lock(mutex_);
    while (true) {
      start_.wait(lock, [&] { return stop_ || generation_ != seen; });
      if (stop_) return;
      seen = generation_;
      void* job = job_;
      void (*call)(void*, int) = call_;
      lock.unlock();
      std::exception_ptr failure;
      try {
        call(job, w);
      } catch (...) {
        failure = std::current_exception();
      }
      lock.lock();
      if (failure && !failure_) failure_ = failure;
      if (--remaining_ == 0) done_.notify_one();
    }
  }

  std::vector<int> workers_;
  std::mutex mutex_;
  std::condition_variable start_, done_;
  std::uint64_t generation_ = 0;
  int remaining_ = 0;
  bool stop_ = false;
  void* job_ = nullptr;
  void (*call_)(void*, int) = nullptr;
  std::exception_ptr failure_;
  std::size_t started_ = 0;
  bool pin_ = false;
  std::vector<std::vector<int>> pinned_;
  pid_t owner_ = 0;
  std::vector<std::jthread> threads_;  // last: joined first, while the members above exist
};

}  // namespace cupipe::pipeline
