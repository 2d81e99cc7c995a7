// SPDX-License-Identifier: Apache-2.0
// planner_check's GPT: gpt::tiny (4 blocks of 128 channels, context 64, vocabulary 256, tied
// embedding) in float on the host backend, on random tokens.
#include "check.hpp"

#include "cupipe/gpt/model.hpp"

namespace planner_check {
namespace {

using Model = gpt::Model<gpt::tiny>;
using Host = backend::Host<float>;
constexpr index_t context = gpt::tiny.context;

struct Data {
  std::vector<std::int32_t> ids, labels;
  explicit Data(index_t sequences) {
    Rng rng(5);
    for (index_t i = 0; i < sequences * context; ++i) {
      ids.push_back(std::int32_t(rng.below(gpt::tiny.vocab)));
      labels.push_back(std::int32_t(rng.below(gpt::tiny.vocab)));
    }
  }
  index_t rows() const { return index_t(ids.size()); }
};

}  // namespace

ModelCheck gpt_check() {
  ModelCheck c;
  c.name = "gpt";
  c.description = "gpt::tiny (4 blocks, 128 channels, context 64, vocabulary 256, tied), float";
  c.default_batch = 8;
  c.stage_counts = {1, 2};
  c.calibrate = [](index_t samples, const std::vector<int>& counts) {
    const Data d(samples);
    return planner::calibrate<Model, Host>(ConstView<std::int32_t>{d.ids.data(), Shape{d.rows(), 1}}, 3, context, counts);
  };
  c.split = partition_cuts<Model, 1, 2, 4>;
  c.run = [](const planner::Layout& layout, index_t samples, const RunOptions& o) {
    const Data d(samples * layout.batches);
    return run_layout<Model, Host, 1, 2>(layout, ConstView<std::int32_t>{d.ids.data(), Shape{d.rows(), 1}},
                                         ConstView<std::int32_t>{d.labels.data(), Shape{d.rows()}}, o);
  };
  return c;
}

}  // namespace planner_check
