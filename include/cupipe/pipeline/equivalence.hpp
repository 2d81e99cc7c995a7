// SPDX-License-Identifier: Apache-2.0
// EquivalenceCheck: PipelineOptions::check_equivalence = N runs the first N train_steps both ways:
// through the pipeline, and through the same model unpipelined (one worker, one microbatch, GPipe) on
// the same backend, from the pipeline's weights and optimizer state as they are before each step. It
// compares the loss, then every parameter tensor's gradient, then every tensor's weights after the
// update, and throws at the first that differs by more than the bound for the precision: the step,
// the tensor by its state_dict name, the virtual stage and worker that hold it, and both values at
// the largest difference. A failed check restores the weights and optimizer state from before the
// step, as any failed step does. Flush schedules in one process; refused otherwise.
//
// The figure compared is a tensor's relative difference: the largest |pipeline - reference| over the
// largest |reference| (both over the tensor). The pipeline sums a weight gradient over microbatches
// where the reference makes one pass over the batch, so the two differ by rounding only: the bound
// is a few thousand units in the last place of the compute type (relative_bound below).
#pragma once

#include <cmath>
#include <cstdint>
#include <limits>
#include <memory>
#include <span>
#include <string>
#include <type_traits>
#include <vector>

#include "cupipe/core/documents.hpp"
#include "cupipe/core/error.hpp"
#include "cupipe/core/tensor.hpp"
#include "cupipe/pipeline/options.hpp"
#include "cupipe/pipeline/stage_list.hpp"
#include "cupipe/pipeline/stats.hpp"
#include "cupipe/schedule/policies/one_f_one_b.hpp"
#include "cupipe/schedule/policy.hpp"

namespace cupipe {
template <class Stages, schedule::SchedulePolicy Schedule, class Backend>
class Pipeline;
}  // namespace cupipe

namespace cupipe::pipeline {

/// The bound on a tensor's relative difference for compute type G and storage type T.
template <class T, class G>
constexpr double relative_bound() {
  if constexpr (sizeof(T) < sizeof(G) || sizeof(T) < 4) return 3e-2;  // 16-bit storage: activations round to 8 bits
  else if constexpr (sizeof(G) >= 8) return 1e-9;
  else return 1e-4;
}

/// The largest |a - b| over the largest |b| in [offset, offset + n), and where the largest |a - b| is.
struct TensorDifference {
  double relative = 0;
  std::size_t at = 0;
};
template <class G>
TensorDifference tensor_difference(std::span<const G> a, std::span<const G> b) {
  double worst = 0, scale = 0;
  TensorDifference out;
  for (std::size_t i = 0; i < a.size(); ++i) {
    const double d = std::abs(double(a[i]) - double(b[i]));
    scale = std::max(scale, std::abs(double(b[i])));
    if (!(d <= worst)) {  // NaN counts as the worst
      worst = d;
      out.at = i;
    }
  }
  out.relative = std::isnan(worst) ? std::numeric_limits<double>::infinity() : (scale > 0 ? worst / scale : worst);
  return out;
}

template <class Model, class Backend, bool Mixed>
class EquivalenceCheck {
 public:
  /// The same model on one worker of `Backend` (the first worker's backend: with backend::PerWorker
  /// naming one type for every worker, that type).
  /// None for workers of different types, which check_equivalence refuses.
  using Reference = std::conditional_t<Mixed, int, Pipeline<detail::counted_partition<Model, 1>, schedule::GPipe, Backend>>;

  EquivalenceCheck(const PipelineOptions& options, bool flush)
      : steps_(options.check_equivalence), seed_(options.seed), packed_(options.packed_sequences) {
    CUPIPE_REQUIRE(steps_ >= 0, "PipelineOptions::check_equivalence is ", steps_, "; give the number of steps to check (0: none)");
    if (steps_ == 0) return;
    CUPIPE_REQUIRE(flush, "PipelineOptions::check_equivalence: this schedule updates inside the step (asynchronous), "
                          "so no unpipelined step computes the same update; it checks flush schedules");
    CUPIPE_REQUIRE(!options.communicator, "PipelineOptions::check_equivalence: the pipeline runs across processes; "
                                          "it checks a pipeline whose stages all run in this process");
    CUPIPE_REQUIRE(!options.post_validation, "PipelineOptions::check_equivalence checks train_step; with "
                                              "post_validation, train_steps overlaps the steps: turn one off");
    CUPIPE_REQUIRE(!Mixed, "PipelineOptions::check_equivalence: the workers have backends of different types; it "
                           "checks a pipeline with one backend, against the same model on one worker of it");
  }

  /// Whether the next train_step is checked.
  bool due() const noexcept { return done_ < steps_; }

  /// One train_step of `pipe` with the check (Pipe: the Pipeline; its forward_backward and step are
  /// train_step's two halves in one process).
  template <class In, class Pipe, class Optimizer>
  StepStats train_step(Pipe& pipe, ConstView<In> x, ConstView<std::int32_t> labels, const Optimizer& optimizer,
                       DocumentStarts documents = {}) {
    using G = typename Pipe::G;
    const int step = done_++;
    if constexpr (!Mixed) {
      if (!reference_)
        reference_ = std::make_unique<Reference>(PipelineOptions{.microbatches = 1, .seed = seed_, .packed_sequences = packed_});
      Reference& ref = *reference_;
      const std::vector<G> weights = pipe.parameters();
      std::vector<std::vector<G>> slots;
      const std::int64_t updates = pipe.updates();
      for (std::size_t s = 0; s < Optimizer::slot_names.size(); ++s) {
        slots.push_back(pipe.optimizer_state(s));  // empty before the first update: then zeros, as fresh
        if (slots.back().empty()) slots.back().assign(weights.size(), G(0));
      }
      // The weights and optimizer state from before the step, into `into`.
      const auto set_state = [&](auto& into) {
        into.set_parameters(weights);
        for (std::size_t s = 0; s < slots.size(); ++s) into.set_optimizer_state(optimizer, s, slots[s], updates);
      };
      set_state(ref);
      StepStats stats = pipe.forward_backward(x, labels, documents);
      const StepStats want = ref.forward_backward(x, labels, documents);
      try {
        compare<Pipe>(step, "loss", std::vector<G>{G(stats.loss)}, std::vector<G>{G(want.loss)}, false);
        compare<Pipe>(step, "gradient", pipe.gradients(), ref.gradients(), true);
      } catch (...) {
        pipe.step(optimizer);  // clears both models' gradients; the state comes back below
        ref.step(optimizer);
        set_state(pipe);
        throw;
      }
      stats.grad_norm = pipe.step(optimizer);
      ref.step(optimizer);
      try {
        compare<Pipe>(step, "weights after the update", pipe.parameters(), ref.parameters(), true);
      } catch (...) {
        set_state(pipe);
        throw;
      }
      return stats;
    } else {
      (void)pipe, (void)x, (void)labels, (void)optimizer, (void)step, (void)documents;
      CUPIPE_THROW("PipelineOptions::check_equivalence: refused for mixed backends");
    }
  }

 private:
  template <class Pipe, class G>
  static void compare(int step, const char* what, const std::vector<G>& got, const std::vector<G>& want, bool per_tensor) {
    constexpr double bound = relative_bound<typename Pipe::T, G>();
    if (!per_tensor) {
      const TensorDifference d = tensor_difference<G>(got, want);
      if (d.relative > bound)
        CUPIPE_THROW("check_equivalence: step ", step, ": the ", what, " is ", double(got[0]), " through the pipeline and ",
                     double(want[0]), " unpipelined, a relative difference of ", d.relative, " over the bound ", bound);
      return;
    }
    CUPIPE_REQUIRE(got.size() == want.size(), "check_equivalence: ", got.size(), " values against ", want.size());
    for (const ParamInfo& t : Pipe::parameter_table()) {
      const auto o = std::size_t(t.offset), n = std::size_t(t.numel);
      const TensorDifference d = tensor_difference<G>(std::span<const G>(got).subspan(o, n), std::span<const G>(want).subspan(o, n));
      if (d.relative <= bound) continue;
      const int k = virtual_stage_of<Pipe>(t.offset);
      CUPIPE_THROW("check_equivalence: step ", step, ": the ", what, " of '", t.name, "' (virtual stage ", k,
                   ", on worker ", Pipe::worker_of(k), ") differs from the unpipelined model's by ", d.relative,
                   " (relative) over the bound ", bound, "; at element ", d.at, ": ", double(got[o + d.at]),
                   " through the pipeline, ", double(want[o + d.at]), " unpipelined");
    }
  }
  /// The virtual stage whose parameters hold flat offset `offset`.
  template <class Pipe>
  static int virtual_stage_of(index_t offset) {
    using Stages = typename Pipe::stage_list;
    int found = 0;
    index_t first = 0;
    [&]<std::size_t... K>(std::index_sequence<K...>) {
      ((offset >= first ? (found = int(K), first += Stages::template stage<K>::param_count, 0) : 0), ...);
    }(std::make_index_sequence<Stages::size>());
    return found;
  }

  int steps_ = 0;
  int done_ = 0;
  std::uint64_t seed_ = 0;
  bool packed_ = false;  ///< PipelineOptions::packed_sequences: the reference takes the borders too
  std::unique_ptr<Reference> reference_;
};

}  // namespace cupipe::pipeline
