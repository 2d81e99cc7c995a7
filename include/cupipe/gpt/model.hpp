// SPDX-License-Identifier: Apache-2.0
// GPT-2 as nanoGPT and llm.c define it, as a cupipe model (a Sequential the pipeline splits):
//   TokenPositionEmbedding (wte, wpe)
//   L x { Residual<ln_1, attn>, Residual<ln_2, mlp.c_fc + GELU, mlp.c_proj> }   (pre-LayerNorm blocks;
//   c_fc is a LinearGELU: Linear then GELU in one layer, so CUDA runs the GELU in the GEMM's epilogue)
//   ln_f, lm_head (no bias; tied to wte unless Config::tied is false), mean cross-entropy over every
//   position.
// Each block is two layers of the model, so a pipeline may cut between its attention and its MLP.
// With Config::experts, every moe_every-th block's MLP is a mixture of experts (layers/moe.hpp).
// Sizes are a gpt::Config template argument: gpt::Model<gpt::tiny>.
//
// Parameter names: Sequential's "<layer>.<name>" ("3.attn.c_attn.weight"); nanogpt_name() turns
// them into nanoGPT's state_dict names ("transformer.h.1.attn.c_attn.weight"), with the same shapes
// (Linear weights (out, in)), so a nanoGPT GPT module loads a checkpoint with load_state_dict.
#pragma once

#include <charconv>
#include <cmath>
#include <cstddef>
#include <span>
#include <string>
#include <string_view>
#include <utility>

#include "cupipe/core/error.hpp"
#include "cupipe/layers/layers.hpp"

namespace cupipe::gpt {

struct Config {
  index_t vocab = 256;     ///< V: token ids are in [0, V)
  index_t context = 64;    ///< T: tokens per sequence (the block size)
  index_t layers = 4;      ///< L: transformer blocks
  index_t heads = 4;       ///< H: attention heads, dividing C
  index_t channels = 128;  ///< C: the residual stream's width
  bool tied = true;        ///< lm_head shares wte's weights (GPT-2); false: its own
  /// Mixture of experts (layers/moe.hpp): 0, every MLP dense; E, the MLP of every moe_every-th block
  /// (blocks moe_every - 1, 2 moe_every - 1, ...) is E experts of the dense MLP's shape, top_k per token.
  index_t experts = 0;
  index_t top_k = 2;
  index_t moe_every = 1;
  double capacity_factor = 0;  ///< 0: dropless; else an expert's slots per sequence, moe::Routing::capacity

  constexpr index_t head_dim() const { return channels / heads; }
  /// Whether block b's MLP is a mixture of experts.
  constexpr bool moe_block(index_t b) const { return experts > 0 && b % moe_every == moe_every - 1; }
  constexpr index_t moe_blocks() const { return experts > 0 ? layers / moe_every : 0; }
  /// Elements of the flat parameter array: a tied lm_head is a second copy of wte there.
  constexpr index_t parameters() const { return dense_parameters() + moe_blocks() * moe_extra(experts); }
  /// Distinct parameters, as PyTorch counts them (a tied tensor once).
  constexpr index_t unique_parameters() const { return parameters() - (tied ? vocab * channels : 0); }
  /// The distinct parameters one token uses: each MoE block's router and top_k of its experts.
  constexpr index_t active_parameters() const {
    return dense_parameters() + moe_blocks() * moe_extra(top_k) - (tied ? vocab * channels : 0);
  }
  /// Model FLOPs of one training token (forward and backward), as PaLM and llm.c count them for MFU:
  /// 6 per distinct parameter a token uses (a tied table once; an MoE block's router and active
  /// experts) plus 6 L C T for causal attention's two products.
  constexpr double flops_per_token() const {
    return 6.0 * double(active_parameters()) + 6.0 * double(layers) * double(channels) * double(context);
  }
  /// The parameters of the model with every MLP dense (a tied lm_head counted twice).
  constexpr index_t dense_parameters() const {
    const index_t C = channels;
    const index_t block = 2 * 2 * C + (3 * C * C + 3 * C) + (C * C + C) + mlp_parameters();
    return vocab * C + context * C + layers * block + 2 * C + vocab * C;
  }
  constexpr index_t mlp_parameters() const { return (4 * channels * channels + 4 * channels) + (4 * channels * channels + channels); }
  /// What an MoE block has beyond a dense one, counting `e` experts: the router and e - 1 more MLPs.
  constexpr index_t moe_extra(index_t e) const { return experts * channels + (e - 1) * mlp_parameters(); }
};

/// Byte-level text on a CPU: V 256, T 64, 4 blocks of C 128 with 4 heads (0.83 M parameters).
inline constexpr Config tiny{256, 64, 4, 4, 128};
/// GPT-2 small's shape, for GPUs: GPT-2's vocabulary padded to 50304 as llm.c does, T 1024, 12
/// blocks, 12 heads, C 768 (124 M parameters).
inline constexpr Config gpt2_124m{50304, 1024, 12, 12, 768};

/// GPT-2's initialisation of layer L (nanoGPT's _init_weights): matrices from N(0, 0.02), those whose
/// name ends in "c_proj.weight" (the projections into the residual stream) from N(0, 0.02 / sqrt(2 *
/// Layers)); vectors 0. Wrap a Named layer, so that the names are the model's.
template <class L, index_t Layers>
struct Init : L {
  template <class T>
  static void init(std::span<T> p, index_t in, Rng& rng) {
    std::size_t at = 0;
    for (const ParamSpec& spec : L::params(in)) {
      const bool matrix = spec.cols != 0;
      const bool projection = spec.name.ends_with("c_proj.weight");
      const double std = projection ? 0.02 / std::sqrt(2.0 * double(Layers)) : 0.02;
      for (index_t i = 0; i < spec.numel(); ++i) p[at++] = matrix ? T(std * rng.normal()) : T(0);
    }
  }
};

/// The head's Linear: LinearNoBias<C, V>, or over TP ranks column-parallel (each rank's rows of the
/// vocabulary, the logits' columns the VocabParallelCrossEntropy takes).
template <index_t V, index_t C, int TP>
using HeadLinear = std::conditional_t<TP == 1, LinearNoBias<C, V>, ColumnParallelLinear<C, V, TP, false>>;

/// lm_head tied to wte: a second copy of the table in the flat array, drawn from the embedding's random
/// stream with the embedding's formula (N(0, 0.02), wte's draws come first), so the copies start
/// bitwise equal; the flush update sums their gradients, so they stay equal (Megatron's scheme for
/// an embedding and a head on different stages). Over TP ranks both copies are split by vocabulary
/// rows alike, so each rank's parts are tied.
template <index_t V, index_t C, int TP = 1>
struct TiedLMHead : Named<"lm_head", HeadLinear<V, C, TP>> {
  static constexpr bool tied_to_input_embedding = true;
  template <class T>
  static void init(std::span<T> p, index_t, Rng& rng) {
    for (T& w : p) w = T(0.02 * rng.normal());
  }
  static std::string describe() { return "lm_head (tied to wte): " + HeadLinear<V, C, TP>::describe(); }
};

}  // namespace cupipe::gpt

namespace cupipe {
template <class L, index_t Layers>
struct passes_of<gpt::Init<L, Layers>> : passes_of<L> {};
template <class L, index_t Layers>
struct whole_layer<gpt::Init<L, Layers>> {
  using type = gpt::Init<whole_layer_t<L>, Layers>;
};
template <index_t V, index_t C, int TP>
struct whole_layer<gpt::TiedLMHead<V, C, TP>> {
  using type = gpt::TiedLMHead<V, C, 1>;
};
}  // namespace cupipe

namespace cupipe::gpt {

template <Config c, int TP = 1>
using Head = std::conditional_t<c.tied, TiedLMHead<c.vocab, c.channels, TP>,
                                Init<Named<"lm_head", HeadLinear<c.vocab, c.channels, TP>>, c.layers>>;

template <Config c>
using AttentionHalf = Residual<Named<"ln_1", LayerNorm<c.channels>>,
                               Init<Named<"attn", CausalSelfAttention<c.channels, c.heads, c.context>>, c.layers>>;
template <Config c>
using MlpHalf = Residual<Named<"ln_2", LayerNorm<c.channels>>,
                         Init<Named<"mlp.c_fc", LinearGELU<c.channels, 4 * c.channels>>, c.layers>,
                         Init<Named<"mlp.c_proj", Linear<4 * c.channels, c.channels>>, c.layers>>;

/// The routing of c's MoE blocks (the balance and z-loss coefficients moe::Routing's defaults).
template <Config c>
inline constexpr moe::Routing routing_of{c.experts, c.top_k, c.capacity_factor};

/// A block's MLP as a mixture of c.experts experts of MlpHalf's shape: mlp.router.weight,
/// mlp.experts.c_fc.*, mlp.experts.c_proj.* (the projections initialised as c_proj's).
/// With EP > 1, one rank's part of it: c.experts / EP experts (layers/moe.hpp's expert parallelism).
template <Config c, int EP = 1>
using MoeHalf =
    Residual<Named<"ln_2", LayerNorm<c.channels>>,
             Init<Named<"mlp", MixtureOfExperts<c.channels, 4 * c.channels, c.context, routing_of<c>, EP>>, c.layers>>;

/// The two halves of a block split over TP tensor-parallel ranks (layers/tensor_parallel.hpp):
/// attention by heads, the MLP by its hidden width (c_fc column-parallel, c_proj row-parallel).
template <Config c, int TP>
using TensorParallelAttentionHalf =
    Residual<Named<"ln_1", LayerNorm<c.channels>>,
             Init<Named<"attn", TensorParallelAttention<c.channels, c.heads, c.context, TP>>, c.layers>>;
template <Config c, int TP>
using TensorParallelMlpHalf =
    Residual<Named<"ln_2", LayerNorm<c.channels>>,
             Init<Named<"mlp.c_fc", ColumnParallelLinearGELU<c.channels, 4 * c.channels, TP>>, c.layers>,
             Init<Named<"mlp.c_proj", RowParallelLinear<4 * c.channels, c.channels, TP>>, c.layers>>;

namespace detail {
template <Config c, std::size_t I, int EP>
using mlp_half_t = std::conditional_t<c.moe_block(index_t(I / 2)), MoeHalf<c, EP>, MlpHalf<c>>;

template <Config c, int TP, std::size_t I, int EP>
using half_t = std::conditional_t<TP == 1, std::conditional_t<I % 2 == 0, AttentionHalf<c>, mlp_half_t<c, I, EP>>,
                                  std::conditional_t<I % 2 == 0, TensorParallelAttentionHalf<c, TP>, TensorParallelMlpHalf<c, TP>>>;

template <Config c, int TP>
using embedding_t = std::conditional_t<TP == 1, TokenPositionEmbedding<c.vocab, c.context, c.channels>,
                                       VocabParallelTokenPositionEmbedding<c.vocab, c.context, c.channels, TP>>;
template <Config c, int TP>
using loss_t = std::conditional_t<TP == 1, SoftmaxCrossEntropy<c.vocab>, VocabParallelCrossEntropy<c.vocab, TP>>;

template <Config c, int TP, int EP, std::size_t... I>
auto model_of(std::index_sequence<I...>)
    -> Sequential<embedding_t<c, TP>, half_t<c, TP, I, EP>..., Named<"ln_f", LayerNorm<c.channels>>, Head<c, TP>, loss_t<c, TP>>;
}  // namespace detail

template <Config c>
concept ValidConfig = c.vocab > 1 && c.context > 0 && c.layers > 0 && c.heads > 0 && c.channels > 0 &&
                      c.channels % c.heads == 0 &&
                      (c.experts == 0 || (c.top_k >= 1 && c.top_k <= c.experts && c.moe_every >= 1 &&
                                          c.moe_every <= c.layers && c.capacity_factor >= 0));

/// The model: inputs are token ids (B * T rows of whole sequences), labels the next token of each.
template <Config c>
  requires ValidConfig<c>
using Model = decltype(detail::model_of<c, 1, 1>(std::make_index_sequence<std::size_t(2 * c.layers)>()));

/// One rank's part of Model<c> split over TP tensor-parallel ranks (dense models only): the blocks' attention by heads
/// and MLP by hidden width, wte and lm_head by vocabulary rows (the loss is vocabulary-parallel: the
/// logits are never gathered); wpe, the LayerNorms and the row-parallel biases whole on every rank.
/// The parameter names are Model<c>'s, so layers::tensor_parallel::shard and unshard map one onto the
/// other. TP must divide the heads and the vocabulary.
template <Config c, int TP>
  requires ValidConfig<c> && (TP >= 1) && (c.heads % TP == 0) && (c.vocab % TP == 0) && (TP == 1 || c.experts == 0)
using TensorParallelModel = decltype(detail::model_of<c, TP, 1>(std::make_index_sequence<std::size_t(2 * c.layers)>()));

/// One rank's part of Model<c> (a model with experts) split over EP expert-parallel ranks: every MoE
/// block holds c.experts / EP of its experts (rank t experts [t E / EP, (t + 1) E / EP)) and the whole
/// router; every other tensor whole. The names are Model<c>'s, as TensorParallelModel's are, so
/// checkpoints move between the two. EP must divide the experts.
template <Config c, int EP>
  requires ValidConfig<c> && (EP >= 1) && (c.experts > 0) && (c.experts % EP == 0)
using ExpertParallelModel = decltype(detail::model_of<c, 1, EP>(std::make_index_sequence<std::size_t(2 * c.layers)>()));

/// nanoGPT's state_dict name of Model<c>'s parameter named `name` by Sequential ("<layer>.<rest>").
inline std::string nanogpt_name(const Config& c, std::string_view name) {
  const std::size_t dot = name.find('.');
  int layer = -1;
  if (dot != std::string_view::npos) std::from_chars(name.data(), name.data() + dot, layer);
  CUPIPE_REQUIRE(layer >= 0 && layer <= 2 * c.layers + 2, "gpt::nanogpt_name: '", name,
                 "' is not a parameter of a GPT with ", c.layers, " blocks");
  const std::string_view rest = name.substr(dot + 1);
  if (layer == 0) return "transformer." + std::string(rest);                 // wte.weight, wpe.weight
  if (layer == 2 * c.layers + 1) return "transformer." + std::string(rest);  // ln_f.*
  if (layer == 2 * c.layers + 2) return std::string(rest);                   // lm_head.weight
  return "transformer.h." + std::to_string((layer - 1) / 2) + "." + std::string(rest);
}

}  // namespace cupipe::gpt
