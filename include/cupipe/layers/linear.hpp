// SPDX-License-Identifier: Apache-2.0
// Linear<In, Out>: y = x W^T + b, with W (Out, In) and b (Out), as torch.nn.Linear; Linear<In, Out,
// false> (LinearNoBias) has no b, as torch.nn.Linear(In, Out, bias=False).
// LinearGELU<In, Out>: gelu(x W^T + b), tanh form: Linear then GELU in one layer, so a backend can
// run the bias and the GELU in its GEMM's epilogue (CUDA: cuBLASLt's GELU_AUX_BIAS) and keep the GELU
// input for the backward in the same pass. It keeps what Linear followed by GELU keeps (the GELU
// input and the output), and on the host its arithmetic is theirs, op for op.
// Linear is the one-part case of detail::OutputSplitLinear, which ColumnParallelLinear
// (layers/tensor_parallel.hpp) splits over tensor-parallel ranks: one code path for all four.
#pragma once

#include <cmath>
#include <string>
#include <type_traits>

#include "cupipe/backend/op_types.hpp"
#include "cupipe/core/rng.hpp"
#include "cupipe/layers/layer.hpp"
#include "cupipe/layers/tensor_group_sum.hpp"

namespace cupipe {
namespace detail {

/// Whether backend B adds a Linear's bias inside its GEMM (an op gemm_bias(be, ta, tb, alpha, x, w,
/// bias, y), found by argument-dependent lookup as every op is).
template <class B, class T>
concept fuses_bias = requires(B& be, ConstViewOn<B, T> a, ViewOn<B, T> y) {
  gemm_bias(be, ops::Transpose::no, ops::Transpose::yes, T(1), a, a, a, y);
};

/// Whether backend B adds a Linear's bias and applies GELU inside its GEMM (an op gemm_bias_gelu(be,
/// ta, tb, alpha, x, w, bias, pre, y) that also writes GELU's input to `pre`).
template <class B, class T>
concept fuses_bias_gelu = requires(B& be, ConstViewOn<B, T> a, ViewOn<B, T> y) {
  gemm_bias_gelu(be, ops::Transpose::no, ops::Transpose::yes, T(1), a, a, a, y, y);
};

/// Whether backend B takes a Linear's bias gradient in its weight-gradient GEMM (an op
/// gemm_bias_grad(be, alpha, dy, x, beta, dw, dbias): dw = alpha dy^T x + beta dw, dbias += column
/// sums of dy).
template <class B, class T>
concept fuses_bias_grad = requires(B& be, ConstViewOn<B, T> a, ViewOn<B, grad_t<B>> g) {
  gemm_bias_grad(be, T(1), a, a, T(1), g, g);
};

/// Whether backend B applies a GELU's gradient inside a GEMM (an op gemm_dgelu(be, ta, tb, alpha, a,
/// b, pre, d): d = (alpha op(a) op(b)) * gelu'(pre)), so a Linear after a LinearGELU can write the
/// GELU input's gradient directly (LayerSeq's backward pairs them).
template <class B, class T>
concept fuses_dgelu = requires(B& be, ConstViewOn<B, T> a, ViewOn<B, T> d) {
  gemm_dgelu(be, ops::Transpose::no, ops::Transpose::no, T(1), a, a, a, d);
};

/// Rows [t Out/Parts, (t+1) Out/Parts) of Linear<In, Out>'s W and b on tensor-parallel rank t: the
/// input is whole, the output this rank's slice of features, and the input gradient a partial sum,
/// summed over the group (nothing to sum with one part). With `Gelu`, GELU follows on the slice (a
/// GELU acts per feature, so the split is the same): the saved area holds GELU's input (rows x
/// Out / Parts, written by the forward) and then its gradient (as many, written by backward_input,
/// read by backward_weight), so a backward can run again on the same record; Linear then GELU
/// keeps the same values, the second as a grad-record entry.
template <index_t In, index_t Out, int Parts, bool Bias, bool Gelu = false>
struct OutputSplitLinear {
  static_assert(In > 0 && Out > 0 && Parts > 0, "Linear<In, Out> needs positive sizes");
  static_assert(Out % Parts == 0, "ColumnParallelLinear<In, Out, Parts>: Parts must divide Out");
  static constexpr index_t part_out = Out / Parts;
  static constexpr int output_parts = Parts;  ///< each rank's output is its slice of the Out features
  static constexpr index_t in_features = In;
  static constexpr index_t out_features_for(index_t) { return part_out; }
  static constexpr bool takes_token_ids = false;
  static constexpr bool is_loss = false;
  static constexpr std::array<ParamSpec, Bias ? 2 : 1> params(index_t) {
    constexpr TensorSplit split = split_over<Parts>(TensorSplit::rows);
    if constexpr (Bias) return {{{"weight", part_out, In, split, Parts}, {"bias", part_out, 0, split, Parts}}};
    else return {{{"weight", part_out, In, split, Parts}}};
  }
  static constexpr index_t saved_per_row(index_t) { return Gelu ? 2 * part_out : 0; }
  static constexpr bool weight_grads_need_backward_input = Gelu;
  static constexpr double forward_flops_per_sample(index_t) { return 2.0 * In * part_out + (Gelu ? 8.0 * part_out : 0.0); }

  /// PyTorch's reset_parameters: kaiming_uniform_(a = sqrt(5)) gives W ~ U(-1/sqrt(In), 1/sqrt(In));
  /// the bias is drawn from the same range, after the weights. (A split layer is initialised as a
  /// part of the whole Linear's draws instead: LayerSeq::init, whole_layer.)
  template <class T>
  static void init(std::span<T> p, index_t, Rng& rng) {
    const double bound = 1.0 / std::sqrt(double(In));
    for (T& w : p) w = T(rng.uniform(-bound, bound));
  }

  // x (n, In) -> y (n, Out / Parts). A backend with gemm_bias (CUDA: cuBLASLt's bias epilogue) adds
  // the bias inside the GEMM, in one launch and without a second pass over y.
  // With GELU: pre (the saved area) = x W^T + b, y = gelu(pre); a backend with gemm_bias_gelu
  // (CUDA: cuBLASLt's GELU_AUX_BIAS epilogue) writes both in the GEMM's pass.
  template <class B, class T>
  static void forward(B& be, const T* p, ConstViewOn<B, T> x, ViewOn<B, T> y, ViewOn<B, T> saved) {
    if constexpr (Gelu) {
      const ViewOn<B, T> pre{saved.data(), Shape{x.rows(), part_out}};
      if constexpr (Bias && fuses_bias_gelu<B, T>) {
        gemm_bias_gelu(be, ops::Transpose::no, ops::Transpose::yes, T(1), x, weight<B>(p), bias<B>(p), pre, y);
      } else {
        linear(be, p, x, pre);
        gelu_forward(be, ConstViewOn<B, T>(pre), y);
      }
    } else {
      (void)saved;
      linear(be, p, x, y);
    }
  }
  // dx (n, In) = dy (n, Out / Parts) W (Out / Parts, In), summed over the group. With GELU, dy is
  // first carried through GELU, into the second half of the saved area.
  // (`saved` is a view of the layer's saved area: writable with GELU, any view without, so a layer
  // that wraps Linear may pass its own const one.)
  template <class B, class T, class Saved>
  static void backward_input(B& be, const T* p, ConstViewOn<B, T>, Saved saved, ConstViewOn<B, T> dy, ViewOn<B, T> dx) {
    static_assert(!Gelu || !std::is_const_v<std::remove_pointer_t<decltype(saved.data())>>,
                  "LinearGELU's backward_input writes GELU's input gradient into its saved area: pass a writable view");
    ConstViewOn<B, T> grad_out = dy;
    if constexpr (Gelu) {
      const ViewOn<B, T> dpre = gelu_input_grad<B>(saved.data(), dy.rows());
      gelu_backward(be, gelu_input<B>(saved.data(), dy.rows()), dy, dpre);
      grad_out = dpre;
    } else {
      (void)saved;
    }
    if (dx.empty()) return;
    gemm(be, ops::Transpose::no, ops::Transpose::no, T(1), grad_out, weight<B>(p), T(0), dx);
    tensor_group_sum<Parts>(be, dx, "ColumnParallelLinear");
  }

  // --- the pairing of a LinearGELU with the Linear after it (LayerSeq's backward) -----------------
  // With a backend that has gemm_dgelu, the Linear's input-gradient GEMM applies the GELU's gradient
  // in its epilogue and writes the LinearGELU's GELU-input gradient (the second half of its saved
  // area) directly; the LinearGELU's backward_input then only multiplies by its weights. The
  // arithmetic is the unpaired passes' (one GEMM, then GELU's gradient of its result) up to the
  // rounding of a fused epilogue (bf16 rounds once instead of twice; on the host, bit for bit),
  // and the gradient of the LinearGELU's output, which nothing else reads, is never written.

  /// GELU's input (pre) and its gradient (dpre) inside a saved area of `rows` rows.
  template <class B, class T>
  static ConstViewOn<B, T> gelu_input(T* saved, index_t rows) requires(Gelu) { return {saved, Shape{rows, part_out}}; }
  template <class B, class T>
  static ViewOn<B, T> gelu_input_grad(T* saved, index_t rows) requires(Gelu) { return {saved + rows * part_out, Shape{rows, part_out}}; }

  /// dpre = (dy W) * gelu'(pre): this Linear's input gradient through the previous layer's GELU.
  template <class B, class T>
  static void backward_input_through_gelu(B& be, const T* p, ConstViewOn<B, T> dy, ConstViewOn<B, T> pre, ViewOn<B, T> dpre)
    requires(!Gelu && Parts == 1)  // one part: no group sum to wait for before the GELU
  {
    gemm_dgelu(be, ops::Transpose::no, ops::Transpose::no, T(1), dy, weight<B>(p), pre, dpre);
  }

  /// dx = dpre W, with dpre already in the saved area (written by the next layer).
  template <class B, class T>
  static void backward_input_from_gelu_grad(B& be, const T* p, T* saved, ViewOn<B, T> dx) requires(Gelu && Parts == 1) {
    if (dx.empty()) return;
    gemm(be, ops::Transpose::no, ops::Transpose::no, T(1), ConstViewOn<B, T>(gelu_input_grad<B>(saved, dx.rows())),
         weight<B>(p), T(0), dx);
  }
  // dW += g^T x;  db += sum over rows of g (with a bias); g is dy, or with GELU the gradient of
  // GELU's input that backward_input left in the saved area. A backend with gemm_bias_grad (CUDA:
  // cuBLASLt's BGRADB epilogue) takes db in the GEMM's pass.
  template <class B, class T = typename B::value_type>
  static void backward_weight(B& be, ConstViewOn<B, T> x, ConstViewOn<B, T> saved, ConstViewOn<B, T> dy, grad_t<B>* g) {
    const index_t rows = dy.rows();
    const ConstViewOn<B, T> grad_out = Gelu ? ConstViewOn<B, T>{saved.data() + rows * part_out, Shape{rows, part_out}} : dy;
    const ViewOn<B, grad_t<B>> dw{g, Shape{part_out, In}};
    if constexpr (Bias && fuses_bias_grad<B, T>) {
      gemm_bias_grad(be, T(1), grad_out, x, T(1), dw, ViewOn<B, grad_t<B>>{g + part_out * In, Shape{part_out}});
    } else {
      gemm(be, ops::Transpose::yes, ops::Transpose::no, T(1), grad_out, x, T(1), dw);
      if constexpr (Bias) bias_backward(be, grad_out, ViewOn<B, grad_t<B>>{g + part_out * In, Shape{part_out}});
    }
  }

 private:
  // y = x W^T + b, the bias in the GEMM where the backend fuses it.
  template <class B, class T>
  static void linear(B& be, const T* p, ConstViewOn<B, T> x, ViewOn<B, T> y) {
    if constexpr (Bias && fuses_bias<B, T>) {
      gemm_bias(be, ops::Transpose::no, ops::Transpose::yes, T(1), x, weight<B>(p), bias<B>(p), y);
    } else {
      gemm(be, ops::Transpose::no, ops::Transpose::yes, T(1), x, weight<B>(p), T(0), y);
      if constexpr (Bias) bias_add(be, y, bias<B>(p));
    }
  }
  template <class B, class T>
  static ConstViewOn<B, T> weight(const T* p) { return {p, Shape{part_out, In}}; }
  template <class B, class T>
  static ConstViewOn<B, T> bias(const T* p) { return {p + part_out * In, Shape{part_out}}; }
};

}  // namespace detail

template <index_t In, index_t Out, bool Bias = true>
struct Linear : detail::OutputSplitLinear<In, Out, 1, Bias> {
  static std::string describe() {
    return (Bias ? "Linear<" : "LinearNoBias<") + std::to_string(In) + ", " + std::to_string(Out) + ">";
  }
};

/// LinearGELU<In, Out>: gelu(x W^T + b), as torch.nn.Linear(In, Out) then nn.GELU(approximate="tanh")
/// (GPT-2's mlp.c_fc and its activation); W and b are the Linear's (its parameter names).
template <index_t In, index_t Out>
struct LinearGELU : detail::OutputSplitLinear<In, Out, 1, true, true> {
  static std::string describe() { return "LinearGELU<" + std::to_string(In) + ", " + std::to_string(Out) + ">"; }
};

/// LinearNoBias<In, Out>: y = x W^T, as torch.nn.Linear(In, Out, bias=False) (GPT-2's lm_head).
template <index_t In, index_t Out>
using LinearNoBias = Linear<In, Out, false>;

namespace detail {
template <class L>
inline constexpr bool is_linear_gelu = false;
template <index_t In, index_t Out>
inline constexpr bool is_linear_gelu<LinearGELU<In, Out>> = true;
template <class L>
inline constexpr bool is_linear = false;
template <index_t In, index_t Out, bool Bias>
inline constexpr bool is_linear<Linear<In, Out, Bias>> = true;
}  // namespace detail

/// A LinearGELU and the Linear after it (GPT-2's mlp.c_fc and mlp.c_proj), on a backend with
/// gemm_dgelu: the Linear's input-gradient GEMM applies the GELU's gradient in its epilogue and
/// writes the LinearGELU's GELU-input gradient; the LinearGELU's backward then only multiplies by its
/// weights. The unpaired passes' arithmetic (one GEMM, then GELU's gradient of its result), up to
/// the rounding of a fused epilogue.
template <class Prev, class Next, class B, class T>
  requires(detail::is_linear_gelu<passes_of_t<Prev>> && detail::is_linear<passes_of_t<Next>> && detail::fuses_dgelu<B, T>)
struct backward_pair<Prev, Next, B, T> {
  using P = passes_of_t<Prev>;
  using N = passes_of_t<Next>;
  static constexpr bool fused = true;

  static void next_backward_input(B& be, const T* next_params, ConstViewOn<B, T> dy, T* prev_saved, index_t rows) {
    N::backward_input_through_gelu(be, next_params, dy, P::template gelu_input<B>(prev_saved, rows),
                                   P::template gelu_input_grad<B>(prev_saved, rows));
  }
  static void prev_backward_input(B& be, const T* prev_params, T* prev_saved, ViewOn<B, T> dx) {
    P::backward_input_from_gelu_grad(be, prev_params, prev_saved, dx);
  }
};

}  // namespace cupipe
