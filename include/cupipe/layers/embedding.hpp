// SPDX-License-Identifier: Apache-2.0
// Embedding<Vocab, Dim>: token ids (n,) -> rows of the table (n, Dim), as torch.nn.Embedding.
// It reads int32 ids, so it can only be a model's first layer.
#pragma once

#include <array>
#include <cstdint>
#include <string>

#include "cupipe/core/documents.hpp"
#include "cupipe/core/error.hpp"
#include "cupipe/core/rng.hpp"
#include "cupipe/cp/context_group.hpp"
#include "cupipe/layers/layer.hpp"
#include "cupipe/layers/tensor_group_sum.hpp"

namespace cupipe {

template <index_t Vocab, index_t Dim>
struct Embedding {
  static_assert(Vocab > 0 && Dim > 0, "Embedding<Vocab, Dim> needs positive sizes");
  static constexpr index_t vocabulary = Vocab;
  static constexpr index_t in_features = 1;  // one token id per row
  static constexpr index_t out_features_for(index_t) { return Dim; }
  static constexpr bool takes_token_ids = true;
  static constexpr bool is_loss = false;
  static constexpr std::array<ParamSpec, 1> params(index_t) { return {{{"weight", Vocab, Dim}}}; }
  static constexpr index_t saved_per_row(index_t) { return 0; }
  static constexpr double forward_flops_per_sample(index_t) { return double(Dim); }
  static std::string describe() { return "Embedding<" + std::to_string(Vocab) + ", " + std::to_string(Dim) + ">"; }

  /// torch.nn.Embedding initialises from N(0, 1).
  template <class T>
  static void init(std::span<T> p, index_t, Rng& rng) {
    for (T& w : p) w = T(rng.normal());
  }

  // ids (n, 1) -> y (n, Dim)
  template <class B, class T>
  static void forward(B& be, const T* p, ConstViewOn<B, std::int32_t> ids, ViewOn<B, T> y, ViewOn<B, T>) {
    embedding_forward(be, ids, table<B>(p), y);
  }
  // The ids have no gradient.
  template <class B, class T>
  static void backward_input(B&, const T*, ConstViewOn<B, std::int32_t>, ConstViewOn<B, T>, ConstViewOn<B, T>, ViewOn<B, T>) {}
  template <class B, class T = typename B::value_type>
  static void backward_weight(B& be, ConstViewOn<B, std::int32_t> ids, ConstViewOn<B, T>, ConstViewOn<B, T> dy, grad_t<B>* g) {
    embedding_backward(be, ids, dy, ViewOn<B, grad_t<B>>{g, Shape{Vocab, Dim}});
  }

 private:
  template <class B, class T>
  static ConstViewOn<B, T> table(const T* p) { return {p, Shape{Vocab, Dim}}; }
};

namespace detail {
/// TokenPositionEmbedding's code for a token table split by vocabulary over Parts tensor-parallel
/// ranks (Megatron's VocabParallelEmbedding): rank t holds wte rows [t V/P, (t+1) V/P) and looks up
/// the ids that fall there (zero rows for the others), one sum over the group assembles the rows,
/// then the replicated wpe is added (once, after the sum). The backward needs no sum: dy is whole on
/// every rank, and each rank adds into its own rows. One part: the plain TokenPositionEmbedding.
template <index_t Vocab, index_t SeqLen, index_t Dim, int Parts>
struct VocabSplitTokenPositionEmbedding {
  static_assert(Vocab > 0 && SeqLen > 0 && Dim > 0 && Parts > 0,
                "TokenPositionEmbedding<Vocab, SeqLen, Dim> needs positive sizes");
  static_assert(Vocab % Parts == 0, "VocabParallelTokenPositionEmbedding: Parts must divide the vocabulary");
  static constexpr index_t vocabulary = Vocab;  ///< token ids range over all of it on every rank
  static constexpr index_t part_vocab = Vocab / Parts;
  static constexpr index_t in_features = 1;
  static constexpr index_t out_features_for(index_t) { return Dim; }
  static constexpr bool takes_token_ids = true;
  static constexpr bool is_loss = false;
  static constexpr index_t rows_per_sample = SeqLen;
  static constexpr std::array<ParamSpec, 2> params(index_t) {
    return {{{"wte.weight", part_vocab, Dim, split_over<Parts>(TensorSplit::rows), Parts}, {"wpe.weight", SeqLen, Dim}}};
  }
  static constexpr index_t saved_per_row(index_t) { return 0; }
  static constexpr double forward_flops_per_sample(index_t) { return double(Dim); }
  static std::string describe() {
    const std::string sizes = std::to_string(Vocab) + ", " + std::to_string(SeqLen) + ", " + std::to_string(Dim);
    if constexpr (Parts == 1) return "TokenPositionEmbedding<" + sizes + ">";
    else return "VocabParallelTokenPositionEmbedding<" + sizes + ", " + std::to_string(Parts) + ">";
  }

  /// GPT-2's initialisation: both tables from N(0, 0.02).
  template <class T>
  static void init(std::span<T> p, index_t, Rng& rng) {
    for (T& w : p) w = T(0.02 * rng.normal());
  }

  template <class B, class T>
  static void forward(B& be, const T* p, ConstViewOn<B, std::int32_t> ids, ViewOn<B, T> y, ViewOn<B, T>) {
    embedding_forward(be, ids, ConstViewOn<B, T>{p, Shape{part_vocab, Dim}}, y, part(be));
    tensor_group_sum<Parts>(be, y, "VocabParallelTokenPositionEmbedding");
    by_position_run(be, ids.numel(), [&](index_t first, index_t position, index_t length) {
      axpy(be, T(1), ConstViewOn<B, T>{p + (part_vocab + position) * Dim, Shape{length, Dim}},
           ViewOn<B, T>{y.data() + first * Dim, Shape{length, Dim}});
    });
  }
  template <class B, class T>
  static void backward_input(B&, const T*, ConstViewOn<B, std::int32_t>, ConstViewOn<B, T>, ConstViewOn<B, T>, ViewOn<B, T>) {}
  /// dwte[id] += dy (this part's ids);  dwpe[position] += dy, over every sequence.
  template <class B, class T = typename B::value_type>
  static void backward_weight(B& be, ConstViewOn<B, std::int32_t> ids, ConstViewOn<B, T>, ConstViewOn<B, T> dy, grad_t<B>* g) {
    embedding_backward(be, ids, dy, ViewOn<B, grad_t<B>>{g, Shape{part_vocab, Dim}}, part(be));
    by_position_run(be, ids.numel(), [&](index_t first, index_t position, index_t length) {
      axpy(be, T(1), ConstViewOn<B, T>{dy.data() + first * Dim, Shape{length, Dim}},
           ViewOn<B, grad_t<B>>{g + (part_vocab + position) * Dim, Shape{length, Dim}});
    });
  }

 private:
  /// f(first, position, length) over runs of rows at consecutive positions: each sequence of
  /// SeqLen from 0, or with document borders (be.documents, packed sequences) each document from 0,
  /// or with a context-parallel ring (be.context_group) this rank's two chunks of each sequence at
  /// their places in it (cp::sequence_runs).
  template <class B, class F>
  static void by_position_run(B& be, index_t rows, F&& f) {
    const int cp = cp::ring_size(be);
    if (rows % (SeqLen / cp) != 0 || SeqLen % cp != 0)
      CUPIPE_THROW(describe(), ": ", rows, " token ids are not whole sequences of ", SeqLen, " tokens",
                   cp > 1 ? " split over a context-parallel ring of " + std::to_string(cp) : std::string());
    if (cp > 1) {
      CUPIPE_REQUIRE(be.documents.empty(), describe(), ": packed sequences (document borders) with context parallelism "
                     "are not supported");
      if constexpr (requires { be.context_group; }) cp::sequence_runs(rows, SeqLen, be.context_group->rank(), cp, f);
      return;
    }
    check_documents(be.documents, rows, SeqLen, describe());
    for (index_t s = 0; s < rows; s += SeqLen)
      be.documents.each_document(s, SeqLen, [&](index_t first, index_t length) { f(first, index_t(0), length); });
  }
  template <class B>
  static ops::VocabPart part(B& be) {
    return {index_t(tensor_group_rank<Parts>(be, "VocabParallelTokenPositionEmbedding")) * part_vocab, Vocab};
  }
};
}  // namespace detail

/// TokenPositionEmbedding<Vocab, SeqLen, Dim>: GPT-2's input, y = wte[id] + wpe[position], where the
/// rows are whole sequences of SeqLen tokens and a row's position is its index in its sequence, or
/// in its document where the backend context has document borders (packed sequences).
/// Parameters as nanoGPT names them: wte.weight (Vocab, Dim), wpe.weight (SeqLen, Dim).
template <index_t Vocab, index_t SeqLen, index_t Dim>
struct TokenPositionEmbedding : detail::VocabSplitTokenPositionEmbedding<Vocab, SeqLen, Dim, 1> {};

}  // namespace cupipe
