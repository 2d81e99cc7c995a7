// SPDX-License-Identifier: Apache-2.0
// Which CPUs a thread may run on, and dealing them out to threads (Linux; elsewhere every function
// reports nothing and changes nothing).
//
// Two users: the pipeline's worker threads, each on a share of the process's CPUs
// (PipelineOptions::pin_workers), and the planner's contention threads, which stand for the processes
// of a node and so must not inherit the one core a launcher bound the calibrating rank to (Open MPI
// binds each rank to a core when it starts two or fewer: two threads on that core read x2.01 where
// two ranks on a core each measure about x1.3).
#pragma once

#include <cstddef>
#include <vector>

#if defined(__linux__)
#include <pthread.h>
#include <sched.h>
#endif

namespace cupipe::core::cpus {

#if defined(__linux__)
namespace detail {
inline std::vector<int> listed(const cpu_set_t& set) {
  std::vector<int> cpus;
  for (int c = 0; c < CPU_SETSIZE; ++c)
    if (CPU_ISSET(c, &set)) cpus.push_back(c);
  return cpus;
}
inline cpu_set_t set_of(const std::vector<int>& cpus) {
  cpu_set_t set;
  CPU_ZERO(&set);
  for (const int c : cpus)
    if (c >= 0 && c < CPU_SETSIZE) CPU_SET(c, &set);
  return set;
}
}  // namespace detail
#endif

/// The CPUs the calling thread may run on, in order; empty where the OS does not say.
inline std::vector<int> allowed() {
#if defined(__linux__)
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof set, &set) != 0) return {};
  return detail::listed(set);
#else
  return {};
#endif
}

/// `cpus` dealt in order into `n` contiguous shares whose sizes differ by at most one; empty where
/// there are fewer CPUs than shares (or no share is asked for).
inline std::vector<std::vector<int>> shares(const std::vector<int>& cpus, std::size_t n) {
  if (n == 0 || cpus.size() < n) return {};
  std::vector<std::vector<int>> out(n);
  for (std::size_t i = 0; i < n; ++i)
    out[i].assign(cpus.begin() + std::ptrdiff_t(i * cpus.size() / n), cpus.begin() + std::ptrdiff_t((i + 1) * cpus.size() / n));
  return out;
}

#if defined(__linux__)
/// Runs `thread` on `cpus` alone; false where the OS refuses (the thread's CPUs are then unchanged).
inline bool pin(pthread_t thread, const std::vector<int>& cpus) {
  if (cpus.empty()) return false;
  const cpu_set_t set = detail::set_of(cpus);
  return pthread_setaffinity_np(thread, sizeof set, &set) == 0;
}
#endif

/// Lets the calling thread run on every CPU of this machine that its control group allows (the
/// kernel narrows a mask of every CPU to the cgroup's cpuset: a Slurm job's CPUs of the node), and
/// returns them; a binding of the thread or its process (a launcher's, taskset's) is widened.
/// Empty, and the thread unchanged, where the OS refuses or does not say.
inline std::vector<int> widen_to_machine() {
#if defined(__linux__)
  cpu_set_t every;
  CPU_ZERO(&every);
  for (int c = 0; c < CPU_SETSIZE; ++c) CPU_SET(c, &every);
  if (pthread_setaffinity_np(pthread_self(), sizeof every, &every) != 0) return {};
  return allowed();
#else
  return {};
#endif
}

/// For thread `i` of `n` that stand for processes with cores of their own: widens the calling thread
/// to the machine (widen_to_machine), then keeps it on its share i of those CPUs where there are at
/// least `n` (one CPU each where there are as many), or on all of them where there are fewer (the
/// threads then time-slice, as the processes would). Returns the CPUs the thread now runs on; empty
/// where the OS refused (the thread keeps the CPUs it had).
inline std::vector<int> spread_over_machine(std::size_t i, std::size_t n) {
  std::vector<int> machine = widen_to_machine();
  if (machine.empty() || i >= n) return machine;
  std::vector<std::vector<int>> dealt = shares(machine, n);
  if (dealt.empty()) return machine;
#if defined(__linux__)
  if (!pin(pthread_self(), dealt[i])) return machine;
#endif
  return dealt[i];
}

}  // namespace cupipe::core::cpus
