// SPDX-License-Identifier: Apache-2.0
// fp8::DelayedScales: the bookkeeping of per-tensor delayed scaling (fp8::PerTensorDelayed) for one
// backend context, shared by the host emulation (fp8::GemmEmulator, fp8/recipe.hpp) and the CUDA
// path (backend::CudaFp8<fp8::PerTensorDelayed>, backend/cuda/fp8.cuh), so both scale alike.
//
// Each GEMM of a layer is an entry, named by (key, role): the layer's tensor and which of its GEMMs.
// An entry has two operands, A and B, each with an amax history (fp8/delayed_scaling.hpp): A is x
// (E4M3) in the forward and dy (E5M2) in the gradients, B is W, W^T or x^T (E4M3). Through a step
// the scales stay fixed and each use of an operand adds its amax to the step's (add); end_step takes
// every operand's step amax over the tensor-parallel group, in one collective, and records it. An
// operand with no history yet (the first step) is scaled by its own amax (the caller's, per use).
//
// The entries are numbered in the order of their first use, which is the order of the layers' GEMMs
// and so the same on every rank of a tensor-parallel group: the reduction sends them in that order.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <map>
#include <tuple>
#include <vector>

#include "cupipe/core/error.hpp"
#include "cupipe/core/float8.hpp"
#include "cupipe/core/tensor_group.hpp"
#include "cupipe/fp8/delayed_scaling.hpp"

namespace cupipe::fp8 {

/// Which of a layer's GEMMs: y = x W^T, dx = dy W, or dW = dy^T x.
enum class GemmRole : std::uint8_t { forward, input_grad, weight_grad };

/// An operand of a GEMM: A (x or dy) or B (W, W^T or x^T).
enum class Operand : std::uint8_t { a, b };

class DelayedScales {
 public:
  static constexpr float unused = -1.0f;  ///< a step amax of an operand not used this step (amaxes are >= 0)

  /// `history` steps of amaxes per operand, and the scale 2^margin larger than they need.
  explicit DelayedScales(int history = 16, int margin = 0) : history_(history), margin_(margin) {
    (void)DelayedScaling<float8_e4m3>(history, margin);  // checks both
  }

  /// The entry of (key, role), numbered on its first use.
  std::size_t entry(const void* key, GemmRole role) {
    const auto [it, added] = index_.try_emplace({key, role}, entries_.size());
    if (added)
      entries_.push_back(Entry{role, DelayedScaling<float8_e4m3>(history_, margin_), DelayedScaling<float8_e5m2>(history_, margin_),
                               DelayedScaling<float8_e4m3>(history_, margin_)});
    return it->second;
  }
  /// The entry of (key, role) if it was used, else none.
  const std::size_t* find(const void* key, GemmRole role) const {
    const auto it = index_.find({key, role});
    return it == index_.end() ? nullptr : &it->second;
  }
  std::size_t size() const noexcept { return entries_.size(); }
  GemmRole role(std::size_t e) const { return entries_.at(e).role; }

  /// Whether the operand has a history (from the second step on).
  bool recorded(std::size_t e, Operand o) const {
    const Entry& x = entries_.at(e);
    return o == Operand::b ? x.b.recorded() : x.role == GemmRole::forward ? x.a4.recorded() : x.a5.recorded();
  }
  /// The scale the operand is quantised with this step (1 without a history).
  float scale(std::size_t e, Operand o) const {
    const Entry& x = entries_.at(e);
    return o == Operand::b ? x.b.scale() : x.role == GemmRole::forward ? x.a4.scale() : x.a5.scale();
  }
  /// The operand's history, as its format quantises (a4: E4M3, a5: E5M2; b: E4M3).
  const DelayedScaling<float8_e4m3>& e4m3_history(std::size_t e, Operand o) const {
    const Entry& x = entries_.at(e);
    return o == Operand::b ? x.b : x.a4;
  }
  const DelayedScaling<float8_e5m2>& e5m2_history(std::size_t e) const { return entries_.at(e).a5; }

  /// Whether uses add their amaxes to the step's: false for inference (backend::Inference), so an
  /// evaluation between steps does not change the scales training uses.
  bool recording = true;

  /// One use of the operand saw `amax`: the step's amax is the largest (nothing while not recording).
  void add(std::size_t e, Operand o, float amax) {
    if (!recording) return;
    float& step = o == Operand::a ? entries_.at(e).step_a : entries_.at(e).step_b;
    step = std::max(step, amax);
  }
  /// The step's amaxes so far, two per entry (A, B) in entry order; `unused` where none.
  std::vector<float> step_amaxes() const {
    std::vector<float> out;
    out.reserve(2 * entries_.size());
    for (const Entry& x : entries_) out.insert(out.end(), {x.step_a, x.step_b});
    return out;
  }

  /// Closes a step: each operand's step amax, the largest over `group`'s ranks (none, or a group of
  /// one: this rank's own), joins its history, and the step's amaxes start again. `amax` (optional):
  /// the step's amaxes as step_amaxes() lays them out, from where the GEMMs kept them (the device),
  /// taking the place of add()'s. Ranks with a different number of entries fail, naming the group.
  void end_step(TensorGroup* group, std::vector<float> amax = {}) {
    if (amax.empty()) amax = step_amaxes();
    CUPIPE_REQUIRE(amax.size() == 2 * entries_.size(), "fp8::DelayedScales::end_step: ", amax.size(), " amaxes for ",
                   entries_.size(), " GEMMs (two operands each)");
    if (group != nullptr && group->size() > 1) amax = max_over(*group, amax);
    for (std::size_t i = 0; i < entries_.size(); ++i) {
      Entry& x = entries_[i];
      if (amax[2 * i] >= 0) (x.role == GemmRole::forward ? x.a4.record(amax[2 * i]) : x.a5.record(amax[2 * i]));
      if (amax[2 * i + 1] >= 0) x.b.record(amax[2 * i + 1]);
      x.step_a = x.step_b = unused;
    }
  }

 private:
  struct Entry {
    GemmRole role;
    DelayedScaling<float8_e4m3> a4;  ///< A in the forward (x)
    DelayedScaling<float8_e5m2> a5;  ///< A in the gradients (dy)
    DelayedScaling<float8_e4m3> b;
    float step_a = unused, step_b = unused;
  };

  /// The element-wise largest of every rank's `amax` (an unused -1 loses to any amax), through an
  /// all-gather made of the group's sum: each rank fills its own slot and leaves the others 0, so
  /// every slot's sum is its rank's values exactly. First the ranks check that they bring as many.
  static std::vector<float> max_over(TensorGroup& group, const std::vector<float>& amax) {
    const std::size_t ranks = std::size_t(group.size()), me = std::size_t(group.rank()), n = amax.size();
    try {
      std::vector<double> counts(ranks, 0.0);
      counts[me] = double(n);
      group.sum(counts.data(), ranks);
      for (std::size_t r = 0; r < ranks; ++r)
        CUPIPE_REQUIRE(counts[r] == double(n), "rank ", r, " of the group has ", counts[r], " FP8 operands and rank ", me,
                       " has ", n, ": the ranks run different models or splits");
      std::vector<float> all(ranks * n, 0.0f);
      std::copy(amax.begin(), amax.end(), all.begin() + std::ptrdiff_t(me * n));
      group.sum(all.data(), all.size());
      std::vector<float> out(n, unused);
      for (std::size_t r = 0; r < ranks; ++r)
        for (std::size_t i = 0; i < n; ++i) out[i] = std::max(out[i], all[r * n + i]);
      return out;
    } catch (const std::exception& e) {
      CUPIPE_THROW("fp8 delayed scaling: the step's amax reduction over the tensor-parallel group (", ranks,
                   " ranks, this one ", me, ") failed: ", e.what());
    }
  }

  int history_, margin_;
  std::map<std::tuple<const void*, GemmRole>, std::size_t> index_;
  std::vector<Entry> entries_;  ///< in order of first use: the same on every rank of a group
};

}  // namespace cupipe::fp8
