// SPDX-License-Identifier: Apache-2.0
// share_prediction: Pipeline::predict across processes. The last stage's ranks hold the output; a
// sum over the pipeline, in which every other rank adds zeros, gives it to every rank. A
// tensor-parallel model whose head is split by columns (a vocabulary-parallel lm_head) has each rank
// of the group place its columns, and a sum over the group joins them.
#pragma once

#include <algorithm>
#include <cstddef>
#include <span>
#include <type_traits>
#include <vector>

#include "cupipe/comm/communicator.hpp"
#include "cupipe/core/tensor.hpp"
#include "cupipe/pipeline/hand_over.hpp"

namespace cupipe::pipeline {

/// `last`: the last stage's context where this rank runs it (null elsewhere), `result` its output
/// for `rows` rows, `Features` columns of `Parts`; `host` receives rows x Features * Parts values.
/// G: the type the sums travel in (a narrower T is widened for them: exact, since one rank holds
/// each value and the others add zeros).
template <class G, index_t Features, int Parts, class Backend, class Result, class T>
void share_prediction(Backend* last, const Result& result, std::span<T> host, index_t rows, comm::Communicator& comm,
                      TensorGroup* group) {
  constexpr index_t width = Features * Parts;
  std::fill(host.begin(), host.end(), T(0));
  if (last) {
    if constexpr (Parts > 1) {
      std::vector<T> part(static_cast<std::size_t>(rows * Features));
      last->download(result.data(), std::span<T>(part));
      const index_t first = index_t(group->rank()) * Features;
      for (index_t r = 0; r < rows; ++r)
        std::copy_n(part.begin() + r * Features, Features, host.begin() + (r * width + first));
    } else {
      last->download(result.data(), host);
    }
  }
  if constexpr (std::is_same_v<T, G>) {
    if constexpr (Parts > 1) group->sum(host.data(), host.size());
    comm.sum_over_stages(host.data(), host.size());
  } else {
    std::vector<G> wide(host.size());
    convert_values(host.data(), wide.data(), host.size());
    if constexpr (Parts > 1) group->sum(wide.data(), wide.size());
    comm.sum_over_stages(wide.data(), wide.size());
    convert_values(wide.data(), host.data(), host.size());
  }
}

}  // namespace cupipe::pipeline
