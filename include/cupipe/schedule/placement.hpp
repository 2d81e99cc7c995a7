// SPDX-License-Identifier: Apache-2.0
// Placement: which worker (physical stage) runs each virtual stage, and as which of its local chunks.
// A policy owns its placement; verify, simulate, weights and the runtime read it from the plan, so a
// V-shaped or any other layout is an ordinary policy.
#pragma once

#include <vector>

namespace cupipe::schedule {

struct Placement {
  int workers = 0;
  int chunks = 0;
  std::vector<int> worker;  ///< [virtual stage] -> worker
  std::vector<int> chunk;   ///< [virtual stage] -> local chunk on that worker
  std::vector<int> virtual_of;  ///< [worker * chunks + chunk] -> virtual stage

  constexpr int virtual_stage(int w, int local_chunk) const {
    return virtual_of[static_cast<std::size_t>(w * chunks + local_chunk)];
  }
  constexpr int worker_of(int virtual_stage_index) const { return worker[static_cast<std::size_t>(virtual_stage_index)]; }
  constexpr int chunk_of(int virtual_stage_index) const { return chunk[static_cast<std::size_t>(virtual_stage_index)]; }
  friend constexpr bool operator==(const Placement&, const Placement&) = default;
};

namespace detail {

/// Builds the table from a function k -> (worker, chunk); every (worker, chunk) pair must appear once.
template <class F>
constexpr Placement placement_from(int workers, int chunks, F&& locate) {
  Placement p{workers, chunks, {}, {}, std::vector<int>(static_cast<std::size_t>(workers * chunks), -1)};
  for (int k = 0; k < workers * chunks; ++k) {
    const auto [w, c] = locate(k);
    p.worker.push_back(w);
    p.chunk.push_back(c);
    p.virtual_of[static_cast<std::size_t>(w * chunks + c)] = k;
  }
  return p;
}

struct WorkerChunk {
  int worker;
  int chunk;
};

}  // namespace detail

/// Megatron-LM's layout: virtual stage k runs on worker k mod p as chunk k / p, so the model loops
/// over the workers V times.
constexpr Placement looped_placement(int workers, int chunks) {
  return detail::placement_from(workers, chunks, [workers](int k) { return detail::WorkerChunk{k % workers, k / workers}; });
}

/// The V shape of ZB-V and DualPipeV: two chunks per worker, down the workers and back up, so worker
/// w holds virtual stages w and 2p-1-w and the last virtual stage sits on worker 0 beside the first.
constexpr Placement v_shape_placement(int workers) {
  return detail::placement_from(workers, 2, [workers](int k) {
    return k < workers ? detail::WorkerChunk{k, 0} : detail::WorkerChunk{2 * workers - 1 - k, 1};
  });
}

}  // namespace cupipe::schedule
