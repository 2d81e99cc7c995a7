// SPDX-License-Identifier: Apache-2.0
// Tensor parallelism (Megatron-LM's scheme, Shoeybi et al., 2019): layers split over a group of
// Parts ranks, each rank holding part t of the weights and computing part t of the work.
//
//   ColumnParallelLinear<In, Out, Parts>  rank t holds output rows [t Out/P, (t+1) Out/P) of W and b:
//                                         the input is whole (the same on every rank), the output
//                                         is the rank's slice of features. The backward's input
//                                         gradient is a partial sum, summed over the group.
//   RowParallelLinear<In, Out, Parts>     rank t holds input columns [t In/P, ...) of W; its input
//                                         is the rank's slice of features; the output is summed
//                                         over the group, then the whole bias (replicated) added.
//   TensorParallelAttention<C, H, T, P>   GPT-2 attention split by heads: c_attn column-parallel
//                                         (the rank's heads of q, k and v), the heads' attention
//                                         local, c_proj row-parallel.
//   VocabParallelTokenPositionEmbedding<V, T, C, P>
//                                         wte split by vocabulary rows: each rank looks up its ids,
//                                         one sum assembles the rows, wpe (replicated) is added.
//   VocabParallelCrossEntropy<V, P>       the loss over a ColumnParallelLinear head's logit columns
//                                         (the rank's part of the vocabulary): the ranks exchange
//                                         three numbers per row (max, sum of exponentials, the
//                                         label's logit), never the logits (Megatron's
//                                         vocab_parallel_cross_entropy).
//
// A transformer block's two halves then sum once in the forward (after c_proj) and once in the
// backward (before ln_1 / ln_2), as Megatron's f and g operators do. Everything between the sums
// (LayerNorm, residual adds, replicated biases) is computed identically on every rank of the group,
// so replicated parameters keep identical gradients without a sum.
//
// ColumnParallelLinear and TensorParallelAttention share Linear's and CausalSelfAttention's code (their
// one-part case). The group: the backend context's `tensor_group` (a TensorGroup: for host ranks
// comm::MpiCommunicator::tensor_group(), for device ranks comm::NcclCommunicator::tensor_group()). Each tensor's ParamSpec says how the whole tensor is split
// (TensorSplit), so layers::tensor_parallel::shard and unshard move parameters between the whole model's
// layout and a rank's, by name. A split layer initialises by drawing its whole layer's values
// (whole_layer_t) from the whole model's stream and keeping its part, so a tensor-parallel model
// starts exactly where the whole model does, without the whole model's array on any rank.
#pragma once

#include <algorithm>
#include <array>
#include <cmath>
#include <cstddef>
#include <span>
#include <string>
#include <type_traits>
#include <vector>

#include "cupipe/core/error.hpp"
#include "cupipe/core/memory.hpp"
#include "cupipe/core/rng.hpp"
#include "cupipe/core/tensor_group.hpp"
#include "cupipe/layers/attention.hpp"
#include "cupipe/layers/embedding.hpp"
#include "cupipe/layers/layer.hpp"
#include "cupipe/layers/linear.hpp"
#include "cupipe/layers/loss.hpp"
#include "cupipe/layers/sequential.hpp"
#include "cupipe/layers/tensor_group_sum.hpp"

namespace cupipe {

template <index_t In, index_t Out, int Parts, bool Bias = true>
struct ColumnParallelLinear : detail::OutputSplitLinear<In, Out, Parts, Bias> {
  static std::string describe() {
    return "ColumnParallelLinear<" + std::to_string(In) + ", " + std::to_string(Out) + ", " + std::to_string(Parts) + ">";
  }
};

/// ColumnParallelLinear followed by GELU on each rank's slice: LinearGELU<In, Out> split by output rows.
template <index_t In, index_t Out, int Parts>
struct ColumnParallelLinearGELU : detail::OutputSplitLinear<In, Out, Parts, true, true> {
  static std::string describe() {
    return "ColumnParallelLinearGELU<" + std::to_string(In) + ", " + std::to_string(Out) + ", " + std::to_string(Parts) + ">";
  }
};

template <index_t In, index_t Out, int Parts, bool Bias = true>
struct RowParallelLinear {
  static_assert(In > 0 && Out > 0 && Parts > 0, "RowParallelLinear<In, Out, Parts> needs positive sizes");
  static_assert(In % Parts == 0, "RowParallelLinear<In, Out, Parts>: Parts must divide In");
  static constexpr index_t part_in = In / Parts;
  static constexpr index_t in_features = part_in;
  static constexpr index_t out_features_for(index_t) { return Out; }
  static constexpr bool takes_token_ids = false;
  static constexpr bool is_loss = false;
  static constexpr std::array<ParamSpec, Bias ? 2 : 1> params(index_t) {
    if constexpr (Bias) return {{{"weight", Out, part_in, split_over<Parts>(TensorSplit::cols), Parts}, {"bias", Out, 0}}};
    else return {{{"weight", Out, part_in, split_over<Parts>(TensorSplit::cols), Parts}}};
  }
  static constexpr index_t saved_per_row(index_t) { return 0; }
  static constexpr double forward_flops_per_sample(index_t) { return 2.0 * part_in * Out; }
  static std::string describe() {
    return "RowParallelLinear<" + std::to_string(In) + ", " + std::to_string(Out) + ", " + std::to_string(Parts) + ">";
  }
  template <class T>
  static void init(std::span<T> p, index_t, Rng& rng) {
    const double bound = 1.0 / std::sqrt(double(In));
    for (T& w : p) w = T(rng.uniform(-bound, bound));
  }

  // x (n, In / Parts), this rank's features -> y (n, Out) = sum over the group of x_t W_t^T, + b
  template <class B, class T>
  static void forward(B& be, const T* p, ConstViewOn<B, T> x, ViewOn<B, T> y, ViewOn<B, T>) {
    gemm(be, ops::Transpose::no, ops::Transpose::yes, T(1), x, ConstViewOn<B, T>{p, Shape{Out, part_in}}, T(0), y);
    if constexpr (Bias && Parts > 1 && std::is_same_v<T, bfloat16>) {
      // bf16: the bias joins the fp32 sum before its one rounding.
      tensor_group_sum<Parts>(be, y, "RowParallelLinear", ConstViewOn<B, T>{p + Out * part_in, Shape{Out}});
    } else {
      tensor_group_sum<Parts>(be, y, "RowParallelLinear");
      if constexpr (Bias) bias_add(be, y, ConstViewOn<B, T>{p + Out * part_in, Shape{Out}});  // once, after the sum
    }
  }
  // dx (n, In / Parts) = dy W_t: dy is whole on every rank, so no sum
  template <class B, class T>
  static void backward_input(B& be, const T* p, ConstViewOn<B, T>, ConstViewOn<B, T>, ConstViewOn<B, T> dy, ViewOn<B, T> dx) {
    if (!dx.empty()) gemm(be, ops::Transpose::no, ops::Transpose::no, T(1), dy, ConstViewOn<B, T>{p, Shape{Out, part_in}}, T(0), dx);
  }
  template <class B, class T = typename B::value_type>
  static void backward_weight(B& be, ConstViewOn<B, T> x, ConstViewOn<B, T>, ConstViewOn<B, T> dy, grad_t<B>* g) {
    gemm(be, ops::Transpose::yes, ops::Transpose::no, T(1), dy, x, T(1), ViewOn<B, grad_t<B>>{g, Shape{Out, part_in}});
    if constexpr (Bias) bias_backward(be, dy, ViewOn<B, grad_t<B>>{g + Out * part_in, Shape{Out}});
  }
};

/// CausalSelfAttention<C, Heads, SeqLen> split by heads over Parts ranks (detail::HeadSplitAttention):
/// rank t runs heads [t H/P, (t+1) H/P). Parameters, in nanoGPT's names, as parts of nanoGPT's
/// tensors: c_attn.weight (3 C/P, C) and c_attn.bias (3 C/P) are the rank's rows of each of q, k and
/// v; c_proj.weight (C, C/P) its columns; c_proj.bias (C) whole.
template <index_t C, index_t Heads, index_t SeqLen, int Parts>
struct TensorParallelAttention : detail::HeadSplitAttention<C, Heads, SeqLen, Parts> {
  static std::string describe() {
    return "TensorParallelAttention<" + std::to_string(C) + ", " + std::to_string(Heads) + ", " + std::to_string(SeqLen) +
           ", " + std::to_string(Parts) + ">";
  }
};

/// GPT-2's token and position embedding with wte split by vocabulary over Parts ranks
/// (detail::VocabSplitTokenPositionEmbedding): wte.weight (V/P, C) is the rank's rows of nanoGPT's
/// table, wpe.weight (T, C) whole.
template <index_t Vocab, index_t SeqLen, index_t Dim, int Parts>
struct VocabParallelTokenPositionEmbedding : detail::VocabSplitTokenPositionEmbedding<Vocab, SeqLen, Dim, Parts> {};

/// SoftmaxCrossEntropy<Classes> over logits split by columns over Parts ranks (the output of a
/// ColumnParallelLinear head): rank t holds logits of classes [t C/P, (t+1) C/P) and all the labels.
/// Forward: each rank's per-row (max, sum of exp(z - max), label's logit or 0) is gathered over the
/// group (3 P numbers per row), and every rank forms each row's whole log-sum-exp, max_t m_t +
/// log(sum_t exp(m_t - max) s_t), and the same loss. Backward: the same exchange, then each rank's
/// columns of softmax - onehot. The loss agrees with the unsplit one to rounding (the exponentials
/// are summed per part first).
template <index_t Classes, int Parts>
struct VocabParallelCrossEntropy : LayerDefaults {
  static_assert(Classes > 1 && Parts > 0 && Classes % Parts == 0,
                "VocabParallelCrossEntropy<Classes, Parts>: Parts must divide Classes");
  static constexpr index_t classes = Classes;  ///< every rank's labels range over all of them
  static constexpr index_t part_classes = Classes / Parts;
  static constexpr index_t in_features = part_classes;
  static constexpr index_t out_features_for(index_t) { return 1; }
  static constexpr bool is_loss = true;
  static constexpr double forward_flops_per_sample(index_t) { return 5.0 * part_classes; }
  static std::string describe() {
    return "VocabParallelCrossEntropy<" + std::to_string(Classes) + ", " + std::to_string(Parts) + ">";
  }

  /// Logits in the storage precision; the exchanged statistics, each row's log-sum-exp and the loss
  /// in the compute precision (the same type, except for bf16 storage).
  template <class B, class L>
  static void forward(B& be, ConstViewOn<B, typename B::value_type> logits, ConstViewOn<B, std::int32_t> labels,
                      ViewOn<B, L> loss, index_t normalizer) {
    static_assert(std::is_same_v<L, grad_t<B>>, "VocabParallelCrossEntropy: the loss is in the backend's compute type");
    CUPIPE_REQUIRE(normalizer > 0, describe(), ": normalizer must be positive, got ", normalizer);
    CUPIPE_REQUIRE(loss.numel() == 1, describe(), ": the loss is one value, got ", loss.shape());
    const std::vector<L> rows = row_terms<B>(be, logits, labels);
    L total = 0;
    for (std::size_t r = 0; r < rows.size(); r += 2) total += rows[r] - rows[r + 1];
    const L value = total / L(normalizer);
    be.upload(std::span<const L>(&value, 1), loss.data());
  }
  template <class B, class T>
  static void backward(B& be, ConstViewOn<B, T> logits, ConstViewOn<B, std::int32_t> labels, ViewOn<B, T> dlogits,
                       index_t normalizer) {
    using G = grad_t<B>;
    const std::vector<G> rows = row_terms<B>(be, logits, labels);
    std::vector<G> lse(rows.size() / 2);
    for (std::size_t r = 0; r < lse.size(); ++r) lse[r] = rows[2 * r];
    auto device_lse = be.template allocate<G>(lse.size(), MemoryTag::workspace);
    be.upload(std::span<const G>(lse), device_lse.data());
    softmax_cross_entropy_part_backward(be, logits, labels, ConstViewOn<B, G>{device_lse.data(), Shape{logits.rows()}},
                                        dlogits, normalizer, part(be));
  }

  template <class L, class T, class Space>
  static void check_finite(L loss, TensorView<const T, Space> logits, TensorView<const std::int32_t, Space> labels) {
    detail::check_loss_finite(&describe, loss, logits, labels);
  }

 private:
  template <class B>
  static ops::VocabPart part(B& be) {
    return {index_t(tensor_group_rank<Parts>(be, "VocabParallelCrossEntropy")) * part_classes, Classes};
  }
  /// (whole log-sum-exp, label's logit) of each row, from every rank's statistics, in the compute
  /// type.
  template <class B>
  static std::vector<grad_t<B>> row_terms(B& be, ConstViewOn<B, typename B::value_type> logits,
                                          ConstViewOn<B, std::int32_t> labels) {
    using G = grad_t<B>;
    if (logits.cols() != part_classes || labels.numel() != logits.rows())
      CUPIPE_THROW(describe(), ": expected logits (n, ", part_classes, ") and labels (n,) but got logits ", logits.shape(),
                   " and labels ", labels.shape());
    const index_t n = logits.rows();
    auto stats = be.template allocate<G>(std::size_t(n * 3), MemoryTag::workspace);
    softmax_cross_entropy_part_stats(be, logits, labels, ViewOn<B, G>{stats.data(), Shape{n, 3}}, part(be));
    const std::vector<G> all =
        tensor_group_gather<Parts>(be, ConstViewOn<B, G>{stats.data(), Shape{n, 3}}, "VocabParallelCrossEntropy");
    std::vector<G> out(std::size_t(2 * n));
    for (index_t r = 0; r < n; ++r) {
      const auto at = [&](int t, int k) { return all[std::size_t((index_t(t) * n + r) * 3 + k)]; };
      G max = at(0, 0), label = 0, sum = 0;
      for (int t = 1; t < Parts; ++t) max = std::max(max, at(t, 0));
      for (int t = 0; t < Parts; ++t) {
        if (at(t, 1) != G(0)) sum += std::exp(at(t, 0) - max) * at(t, 1);
        label += at(t, 2);
      }
      out[std::size_t(2 * r)] = max + std::log(sum);
      out[std::size_t(2 * r + 1)] = label;
    }
    return out;
  }
};

// The whole layers the split ones are parts of (see whole_layer).
template <index_t In, index_t Out, int Parts, bool Bias>
struct whole_layer<ColumnParallelLinear<In, Out, Parts, Bias>> {
  using type = Linear<In, Out, Bias>;
};
template <index_t In, index_t Out, int Parts>
struct whole_layer<ColumnParallelLinearGELU<In, Out, Parts>> {
  using type = LinearGELU<In, Out>;
};
template <index_t In, index_t Out, int Parts, bool Bias>
struct whole_layer<RowParallelLinear<In, Out, Parts, Bias>> {
  using type = Linear<In, Out, Bias>;
};
template <index_t C, index_t Heads, index_t SeqLen, int Parts>
struct whole_layer<TensorParallelAttention<C, Heads, SeqLen, Parts>> {
  using type = CausalSelfAttention<C, Heads, SeqLen>;
};
template <index_t Vocab, index_t SeqLen, index_t Dim, int Parts>
struct whole_layer<VocabParallelTokenPositionEmbedding<Vocab, SeqLen, Dim, Parts>> {
  using type = TokenPositionEmbedding<Vocab, SeqLen, Dim>;
};
template <index_t Vocab, index_t SeqLen, index_t Dim, int Parts>
struct whole_layer<detail::VocabSplitTokenPositionEmbedding<Vocab, SeqLen, Dim, Parts>> {
  using type = TokenPositionEmbedding<Vocab, SeqLen, Dim>;
};

namespace layers::tensor_parallel {

namespace detail {
// cupipe::detail::split_rows_of, split_cols_of and for_each_split_run: layers/sequential.hpp (split layers' initialisation uses them).

/// Elements of the flat array a parameter table describes.
inline index_t total_of(const std::vector<ParamInfo>& table) {
  index_t total = 0;
  for (const ParamInfo& p : table) total = std::max(total, p.offset + p.numel);
  return total;
}

/// The whole model's tensor of the same name as `part` (a tensor of a tensor-parallel model).
inline const ParamInfo& whole_of(const std::vector<ParamInfo>& whole_table, const ParamInfo& part, std::size_t i) {
  CUPIPE_REQUIRE(i < whole_table.size() && whole_table[i].name == part.name, "tensor_parallel: parameter ", i, " '",
                 part.name, "' of the tensor-parallel model is '", i < whole_table.size() ? whole_table[i].name : "",
                 "' in the whole model; the two models must have the same layers");
  const ParamInfo& whole = whole_table[i];
  const index_t parts = part.split == TensorSplit::none ? 1 : part.parts;
  CUPIPE_REQUIRE(whole.numel == part.numel * parts, "tensor_parallel: '", part.name, "' has ", part.numel,
                 " values in ", parts, " part(s), but ", whole.numel, " in the whole model");
  return whole;
}
}  // namespace detail

/// The whole model's parameter table from a tensor-parallel model's (`parts`): each split tensor at
/// its whole shape, offsets laid out afresh in the same order; the same table for a model that splits
/// nothing.
inline std::vector<ParamInfo> whole_table(const std::vector<ParamInfo>& parts) {
  std::vector<ParamInfo> out;
  out.reserve(parts.size());
  index_t offset = 0;
  for (const ParamInfo& p : parts) {
    ParamInfo w = p;
    const index_t r = cupipe::detail::split_rows_of(p), c = cupipe::detail::split_cols_of(p), P = p.parts;
    const bool matrix = p.shape.rank() == 2;
    switch (p.split) {
      case TensorSplit::none: break;
      case TensorSplit::rows:
      case TensorSplit::expert_rows:
      case TensorSplit::row_thirds: w.shape = matrix ? Shape{r * P, c} : Shape{r * P}; break;
      case TensorSplit::cols: w.shape = Shape{r, c * P}; break;
    }
    w.numel = w.shape.numel();
    w.offset = offset;
    w.split = TensorSplit::none;
    w.parts = 1;
    offset += w.numel;
    out.push_back(std::move(w));
  }
  return out;
}

/// The largest number of parts any tensor of `table` is split into over the tensor-parallel group
/// (1: a model that splits nothing so), or with `experts` over the expert-parallel group
/// (TensorSplit::expert_rows).
inline int parts_of(const std::vector<ParamInfo>& table, bool experts = false) {
  int parts = 1;
  for (const ParamInfo& p : table)
    if (p.split != TensorSplit::none && (p.split == TensorSplit::expert_rows) == experts) parts = std::max(parts, p.parts);
  return parts;
}

/// This rank's parameters (part t of every split tensor, the whole of every other) from the whole
/// model's, matched by name: `whole_table`/`whole` are the whole model's parameter_table() and
/// values, `part_table` the tensor-parallel model's.
template <class T>
std::vector<T> shard(const std::vector<ParamInfo>& whole_table, const std::vector<ParamInfo>& part_table,
                     std::span<const T> whole, int t) {
  CUPIPE_REQUIRE(whole_table.size() == part_table.size(), "layers::tensor_parallel::shard: the whole model has ",
                 whole_table.size(), " parameter tensors, the tensor-parallel one ", part_table.size());
  const index_t total = detail::total_of(part_table), whole_total = detail::total_of(whole_table);
  CUPIPE_REQUIRE(index_t(whole.size()) == whole_total, "layers::tensor_parallel::shard: got ", whole.size(),
                 " values for a whole model of ", whole_total, " parameters");
  std::vector<T> out(static_cast<std::size_t>(total));
  for (std::size_t i = 0; i < part_table.size(); ++i) {
    const ParamInfo& part = part_table[i];
    const ParamInfo& from = detail::whole_of(whole_table, part, i);
    cupipe::detail::for_each_split_run(part, t, [&](index_t at, index_t whole_at, index_t n) {
      std::copy_n(whole.begin() + (from.offset + whole_at), n, out.begin() + (part.offset + at));
    });
  }
  return out;
}

/// The whole model's values from every rank's part (collective over `group`, host memory): each
/// rank places its parts, the first rank the replicated tensors, and one sum assembles them.
template <class T>
std::vector<T> unshard(const std::vector<ParamInfo>& whole_table, const std::vector<ParamInfo>& part_table,
                       std::span<const T> part_values, TensorGroup& group) {
  CUPIPE_REQUIRE(whole_table.size() == part_table.size(), "layers::tensor_parallel::unshard: the whole model has ",
                 whole_table.size(), " parameter tensors, the tensor-parallel one ", part_table.size());
  const index_t total = detail::total_of(whole_table), part_total = detail::total_of(part_table);
  CUPIPE_REQUIRE(index_t(part_values.size()) == part_total, "layers::tensor_parallel::unshard: got ", part_values.size(),
                 " values for a part of ", part_total, " parameters");
  std::vector<T> out(static_cast<std::size_t>(total), T(0));
  const int t = group.rank();
  for (std::size_t i = 0; i < part_table.size(); ++i) {
    const ParamInfo& part = part_table[i];
    const ParamInfo& to = detail::whole_of(whole_table, part, i);
    if (part.split == TensorSplit::none && t != 0) continue;
    cupipe::detail::for_each_split_run(part, t, [&](index_t at, index_t whole_at, index_t n) {
      std::copy_n(part_values.begin() + (part.offset + at), n, out.begin() + (to.offset + whole_at));
    });
  }
  group.sum(out.data(), out.size());
  return out;
}

/// Sum of squares of a tensor-parallel model's values (gradients, for the global norm) as the whole
/// model's: split tensors summed over the group, replicated ones counted once. Collective.
template <class T>
double sum_of_squares(const std::vector<ParamInfo>& part_table, std::span<const T> values, TensorGroup& group) {
  double split = 0, replicated = 0;
  for (const ParamInfo& p : part_table) {
    double s = 0;
    for (index_t i = 0; i < p.numel; ++i) s += double(values[std::size_t(p.offset + i)]) * double(values[std::size_t(p.offset + i)]);
    (p.split == TensorSplit::none ? replicated : split) += s;
  }
  double sums[1] = {split};
  group.sum(sums, 1);
  return sums[0] + replicated;
}

}  // namespace layers::tensor_parallel
}  // namespace cupipe
