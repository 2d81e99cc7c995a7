// SPDX-License-Identifier: Apache-2.0
// MixtureOfExperts<C, Hidden, SeqLen, Routing>: a feed-forward layer of E experts, each GPT-2's MLP
// (c_fc: Linear<C, Hidden> then GELU, c_proj: Linear<Hidden, C>), of which a top-k softmax router
// picks k per token (moe/routing.hpp: gates, capacity, the balancing loss and the z-loss):
//   y_t = sum over t's kept choices j of gate_tj * expert_{e_tj}(x_t)
// Tokens are sorted by expert into contiguous groups (moe::dispatch), so each expert runs two GEMMs
// over its group (the backend's gemm: OpenBLAS on the host); a dropped choice contributes nothing.
// The auxiliary losses' gradients enter in backward_input, scaled by the step's loss normalizer,
// which the runner sets on the context (Host::aux_loss_normalizer; 0: the microbatch's rows, as
// Network's default), and backward_input adds what the layer did to Host::moe_tally when one is set.
//
// Parameters (PyTorch shapes, the experts stacked): router.weight (E, C), experts.c_fc.weight (E H, C),
// experts.c_fc.bias (E H), experts.c_proj.weight (E C, H), experts.c_proj.bias (E C).
// Runs on the host backend in fp32 or fp64 storage; a device backend or bf16 storage is refused
// with the reason (the CUDA permute and grouped-GEMM path is issue #58's next step).
#pragma once

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <span>
#include <string>
#include <type_traits>
#include <vector>

#include "cupipe/backend/op_types.hpp"
#include "cupipe/core/error.hpp"
#include "cupipe/core/rng.hpp"
#include "cupipe/cp/context_group.hpp"
#include "cupipe/layers/layer.hpp"
#include "cupipe/moe/routing.hpp"
#include "cupipe/moe/tally.hpp"

namespace cupipe {

template <index_t C, index_t Hidden, index_t SeqLen, moe::Routing R>
struct MixtureOfExperts : LayerDefaults {
  static_assert(C > 0 && Hidden > 0 && SeqLen > 0, "MixtureOfExperts<C, Hidden, SeqLen, Routing> needs positive sizes");
  static_assert(R.valid(), "MixtureOfExperts: the routing needs 1 <= top_k <= experts and coefficients >= 0");
  static constexpr index_t E = R.experts;
  static constexpr index_t K = R.top_k;
  static constexpr index_t in_features = C;
  static constexpr index_t out_features_for(index_t) { return C; }
  /// The capacity and the balance loss are per sequence: a microbatch holds whole ones.
  static constexpr index_t rows_per_sample = SeqLen;
  static constexpr bool weight_grads_need_backward_input = true;

  static constexpr std::array<ParamSpec, 5> params(index_t) {
    return {{{"router.weight", E, C},
             {"experts.c_fc.weight", E * Hidden, C},
             {"experts.c_fc.bias", E * Hidden, 0},
             {"experts.c_proj.weight", E * C, Hidden},
             {"experts.c_proj.bias", E * C, 0}}};
  }
  /// Per row, each region rounded to stat_slots: probs (E), lse, experts (k), gates (k), slots (k),
  /// and per choice the expert's GELU input (Hidden) and output (C); then what backward_input writes
  /// for backward_weight: the expert outputs' gradient (k C), the GELU inputs' (k Hidden), dlogits (E).
  static constexpr index_t saved_per_row(index_t) {
    return 2 * r(E) + stat_slots + 2 * K * stat_slots + r(K) + 2 * r(K * Hidden) + 2 * r(K * C);
  }
  /// The router, and k experts' two GEMMs and GELU per token.
  static constexpr double forward_flops_per_sample(index_t) {
    return 2.0 * double(C) * double(E) + double(K) * (4.0 * double(C) * double(Hidden) + 8.0 * double(Hidden));
  }
  static std::string describe() {
    return "MixtureOfExperts<" + std::to_string(C) + ", " + std::to_string(Hidden) + ", " + std::to_string(SeqLen) +
           ", E " + std::to_string(E) + ", top-" + std::to_string(K) +
           (R.capacity_factor > 0 ? ", capacity " + moe::factor_text(R.capacity_factor) : std::string(", dropless")) + ">";
  }

  /// Each tensor from U(-1/sqrt(fan_in), 1/sqrt(fan_in)), as torch.nn.Linear's weights and biases.
  template <class T>
  static void init(std::span<T> p, index_t, Rng& rng) {
    std::size_t at = 0;
    for (const ParamSpec& spec : params(C)) {
      const double fan_in = spec.name.starts_with("experts.c_proj") ? double(Hidden) : double(C);
      const double bound = 1.0 / std::sqrt(fan_in);
      for (index_t i = 0; i < spec.numel(); ++i) p[at++] = T(rng.uniform(-bound, bound));
    }
  }

  template <class B, class T>
  static void forward(B& be, const T* p, ConstViewOn<B, T> x, ViewOn<B, T> y, ViewOn<B, T> saved) {
    if constexpr (!runs<B, T>) refuse<B>();
    else forward_host(be, p, x, y, saved);
  }

  /// dgates and the experts' output gradients from dy; through each expert to its GELU input's
  /// gradient (kept) and its share of dx; the router's logits' gradient (kept) with the balance and
  /// z-loss terms; dx = dlogits W_router + the experts' shares.
  template <class B, class T, class SavedView>
  static void backward_input(B& be, const T* p, ConstViewOn<B, T> x, SavedView saved, ConstViewOn<B, T> dy, ViewOn<B, T> dx) {
    if constexpr (!runs<B, T>) refuse<B>();
    else backward_input_host(be, p, x, const_cast<T*>(saved.data()), dy, dx);
  }

  /// From what backward_input kept: d router += dlogits^T x; per expert dW1 += dh^T xs, db1 += sum dh,
  /// dW2 += do^T gelu(h), db2 += sum do.
  template <class B, class T = typename B::value_type, class SavedView>
  static void backward_weight(B& be, ConstViewOn<B, T> x, SavedView saved, ConstViewOn<B, T>, grad_t<B>* g) {
    if constexpr (!runs<B, T>) refuse<B>();
    else backward_weight_host(be, x, const_cast<T*>(saved.data()), g);
  }

  /// What the auxiliary losses of a forward's saved area of n rows add to the training loss:
  /// balance_coef times the balance loss plus z_coef times the z-loss, each over `normalizer` (the
  /// value whose gradient backward_input adds).
  template <class T>
  static double aux_loss(const T* saved, index_t n, index_t normalizer) {
    const Saved<T> s(const_cast<T*>(saved), n);
    double z = 0;
    for (index_t t = 0; t < n; ++t) z += double(s.lse[t]) * double(s.lse[t]);
    return R.balance_coef * moe::balance_loss<T>(s.probs, s.experts, n, SeqLen, R, normalizer, nullptr) +
           R.z_coef * z / double(normalizer);
  }

 private:
  /// Whether the layer runs on B with storage T: host memory, storage in the compute type.
  template <class B, class T>
  static constexpr bool runs = host_accessible<typename B::space> && std::is_same_v<T, grad_t<B>>;

  template <class B>
  [[noreturn]] static void refuse() {
    CUPIPE_THROW(describe(), ": runs on the host backend in fp32 or fp64 storage (this backend is ", B::name,
                 ", with other storage or memory); the CUDA path is not written yet");
  }

  template <class B, class T>
  static void forward_host(B& be, const T* p, ConstViewOn<B, T> x, ViewOn<B, T> y, ViewOn<B, T> saved) {
    check_runs(be, x.rows());
    const index_t n = x.rows();
    const Saved<T> s(saved.data(), n);
    // The router: logits into the probabilities' place, then softmax and top-k there.
    gemm(be, ops::Transpose::no, ops::Transpose::yes, T(1), x, ConstViewOn<B, T>{p, Shape{E, C}}, T(0),
         ViewOn<B, T>{s.probs, Shape{n, E}});
    moe::route(s.probs, n, R, s.probs, s.lse, s.experts, s.gates);
    std::vector<index_t> offsets(std::size_t(E + 1));
    moe::dispatch(s.experts, n, SeqLen, R, s.slot, offsets.data());
    // Each expert over its group: h = x W1^T + b1 (kept), o = gelu(h) W2^T + b2 (kept).
    each_group(be, s, x, offsets, [&](index_t e, index_t first, index_t rows, ConstViewOn<B, T> xs, ViewOn<B, T> a) {
      const ViewOn<B, T> h{s.h + first * Hidden, Shape{rows, Hidden}};
      const ViewOn<B, T> o{s.o + first * C, Shape{rows, C}};
      gemm(be, ops::Transpose::no, ops::Transpose::yes, T(1), xs, w1<B>(p, e), T(0), h);
      bias_add(be, h, b1<B>(p, e));
      gelu_forward(be, ConstViewOn<B, T>(h), a);
      gemm(be, ops::Transpose::no, ops::Transpose::yes, T(1), ConstViewOn<B, T>(a), w2<B>(p, e), T(0), o);
      bias_add(be, o, b2<B>(p, e));
    });
    // Combine: y_t = sum_j gate_tj o[slot_tj], in choice order.
    for (index_t t = 0; t < n; ++t) {
      T* yt = y.data() + t * C;
      std::fill_n(yt, C, T(0));
      for (index_t j = 0; j < K; ++j) {
        const std::int32_t at = s.slot[t * K + j];
        if (at < 0) continue;
        const T g = s.gates[t * K + j];
        const T* ot = s.o + index_t(at) * C;
        for (index_t c = 0; c < C; ++c) yt[c] += g * ot[c];
      }
    }
  }

  template <class B, class T>
  static void backward_input_host(B& be, const T* p, ConstViewOn<B, T> x, T* saved, ConstViewOn<B, T> dy, ViewOn<B, T> dx) {
    check_runs(be, x.rows());
    const index_t n = x.rows();
    const Saved<T> s(saved, n);
    std::vector<index_t> offsets(std::size_t(E + 1));
    moe::expert_offsets(s.experts, s.slot, n, R, offsets.data());
    const index_t kept = offsets[std::size_t(E)];
    // dgate_tj = dy_t . o_slot;  do_slot = gate_tj dy_t (a dropped choice has no slot).
    std::vector<T> dgates(std::size_t(n * K), T(0));
    for (index_t t = 0; t < n; ++t)
      for (index_t j = 0; j < K; ++j) {
        const std::int32_t at = s.slot[t * K + j];
        if (at < 0) continue;
        const T* dyt = dy.data() + t * C;
        const T* ot = s.o + index_t(at) * C;
        T* d_ot = s.d_o + index_t(at) * C;
        const T g = s.gates[t * K + j];
        T acc = 0;
        for (index_t c = 0; c < C; ++c) {
          acc += dyt[c] * ot[c];
          d_ot[c] = g * dyt[c];
        }
        dgates[std::size_t(t * K + j)] = acc;
      }
    // Through each expert: da = do W2, dh = da gelu'(h) (kept); dxs = dh W1.
    auto da = be.template allocate<T>(std::max<index_t>(kept, 1) * Hidden, MemoryTag::workspace);
    auto dxs = be.template allocate<T>(std::max<index_t>(kept, 1) * C, MemoryTag::workspace);
    for (index_t e = 0; e < E; ++e) {
      const index_t first = offsets[std::size_t(e)], rows = offsets[std::size_t(e) + 1] - first;
      if (rows == 0) continue;
      const ViewOn<B, T> dae{da.data() + first * Hidden, Shape{rows, Hidden}};
      const ViewOn<B, T> dh{s.dh + first * Hidden, Shape{rows, Hidden}};
      gemm(be, ops::Transpose::no, ops::Transpose::no, T(1), ConstViewOn<B, T>{s.d_o + first * C, Shape{rows, C}}, w2<B>(p, e),
           T(0), dae);
      gelu_backward(be, ConstViewOn<B, T>{s.h + first * Hidden, Shape{rows, Hidden}}, ConstViewOn<B, T>(dae), dh);
      if (!dx.empty())
        gemm(be, ops::Transpose::no, ops::Transpose::no, T(1), ConstViewOn<B, T>(dh), w1<B>(p, e), T(0),
             ViewOn<B, T>{dxs.data() + first * C, Shape{rows, C}});
    }
    // The router: the balance loss's gradient of the probabilities, then dlogits (kept).
    const index_t normalizer = be.aux_loss_normalizer > 0 ? be.aux_loss_normalizer : n;
    std::vector<T> dprobs(std::size_t(n * E), T(0));
    const double balance = moe::balance_loss(s.probs, s.experts, n, SeqLen, R, normalizer, dprobs.data());
    const double z = moe::router_backward(s.probs, s.lse, s.experts, s.gates, dgates.data(), n, R, normalizer, dprobs.data(),
                                          s.dlogits);
    if (be.moe_tally != nullptr) tally(*be.moe_tally, n, offsets, balance, z);
    if (dx.empty()) return;
    gemm(be, ops::Transpose::no, ops::Transpose::no, T(1), ConstViewOn<B, T>{s.dlogits, Shape{n, E}},
         ConstViewOn<B, T>{p, Shape{E, C}}, T(0), dx);
    for (index_t t = 0; t < n; ++t)
      for (index_t j = 0; j < K; ++j) {
        const std::int32_t at = s.slot[t * K + j];
        if (at < 0) continue;
        const T* d = dxs.data() + index_t(at) * C;
        T* dxt = dx.data() + t * C;
        for (index_t c = 0; c < C; ++c) dxt[c] += d[c];
      }
  }

  template <class B, class T>
  static void backward_weight_host(B& be, ConstViewOn<B, T> x, T* saved, T* g) {
    check_runs(be, x.rows());
    const index_t n = x.rows();
    const Saved<T> s(saved, n);
    gemm(be, ops::Transpose::yes, ops::Transpose::no, T(1), ConstViewOn<B, T>{s.dlogits, Shape{n, E}}, x, T(1),
         ViewOn<B, T>{g, Shape{E, C}});
    std::vector<index_t> offsets(std::size_t(E + 1));
    moe::expert_offsets(s.experts, s.slot, n, R, offsets.data());
    each_group(be, s, x, offsets, [&](index_t e, index_t first, index_t rows, ConstViewOn<B, T> xs, ViewOn<B, T> a) {
      const ConstViewOn<B, T> dh{s.dh + first * Hidden, Shape{rows, Hidden}};
      const ConstViewOn<B, T> d_o{s.d_o + first * C, Shape{rows, C}};
      gelu_forward(be, ConstViewOn<B, T>{s.h + first * Hidden, Shape{rows, Hidden}}, a);
      gemm(be, ops::Transpose::yes, ops::Transpose::no, T(1), dh, xs, T(1), ViewOn<B, T>{g + dw1_at(e), Shape{Hidden, C}});
      bias_backward(be, dh, ViewOn<B, T>{g + db1_at(e), Shape{Hidden}});
      gemm(be, ops::Transpose::yes, ops::Transpose::no, T(1), d_o, ConstViewOn<B, T>(a), T(1),
           ViewOn<B, T>{g + dw2_at(e), Shape{C, Hidden}});
      bias_backward(be, d_o, ViewOn<B, T>{g + db2_at(e), Shape{C}});
    });
  }

  static constexpr index_t r(index_t v) { return round_up_to_stat_slots(v); }

  /// The saved area of n rows, region by region (each a multiple of stat_slots elements per row, so
  /// every region starts aligned for an int32 or a compute-type value).
  template <class T>
  struct Saved {
    T* probs;
    T* lse;
    std::int32_t* experts;
    T* gates;
    std::int32_t* slot;
    T* h;
    T* o;
    T* d_o;
    T* dh;
    T* dlogits;
    Saved(T* base, index_t n) {
      T* at = base;
      const auto take = [&](index_t per_row) {
        T* here = at;
        at += n * per_row;
        return here;
      };
      probs = take(r(E));
      lse = take(stat_slots);
      experts = reinterpret_cast<std::int32_t*>(take(K * stat_slots));
      gates = take(r(K));
      slot = reinterpret_cast<std::int32_t*>(take(K * stat_slots));
      h = take(r(K * Hidden));
      o = take(r(K * C));
      d_o = take(r(K * C));
      dh = take(r(K * Hidden));
      dlogits = take(r(E));
    }
  };

  /// f(e, first, rows, xs, act) for each expert e with kept slots: its rows [first, first + rows) of
  /// the slots sorted by expert, their inputs gathered from x, and a workspace for their GELU output.
  template <class B, class T, class F>
  static void each_group(B& be, const Saved<T>& s, ConstViewOn<B, T> x, const std::vector<index_t>& offsets, F&& f) {
    const index_t kept = offsets[std::size_t(E)];
    auto xs = be.template allocate<T>(std::max<index_t>(kept, 1) * C, MemoryTag::workspace);
    auto act = be.template allocate<T>(std::max<index_t>(kept, 1) * Hidden, MemoryTag::workspace);
    gather(s, x.rows(), x.data(), xs.data());
    for (index_t e = 0; e < E; ++e) {
      const index_t first = offsets[std::size_t(e)], rows = offsets[std::size_t(e) + 1] - first;
      if (rows > 0)
        f(e, first, rows, ConstViewOn<B, T>{xs.data() + first * C, Shape{rows, C}},
          ViewOn<B, T>{act.data() + first * Hidden, Shape{rows, Hidden}});
    }
  }

  /// The kept slots' input rows, in slot order: xs[slot_tj] = x_t.
  template <class T>
  static void gather(const Saved<T>& s, index_t n, const T* x, T* xs) {
    for (index_t t = 0; t < n; ++t)
      for (index_t j = 0; j < K; ++j) {
        const std::int32_t at = s.slot[t * K + j];
        if (at < 0) continue;
        std::copy_n(x + t * C, C, xs + index_t(at) * C);
      }
  }

  static void tally(moe::Tally& out, index_t n, const std::vector<index_t>& offsets, double balance, double z) {
    out.balance_loss += balance;
    out.z_loss += z;
    out.aux_loss += R.balance_coef * balance + R.z_coef * z;
    out.routed += std::int64_t(n * K);
    out.dropped += std::int64_t(n * K - offsets[std::size_t(E)]);
    if (out.load.size() < std::size_t(E)) out.load.resize(std::size_t(E), 0);
    for (index_t e = 0; e < E; ++e) out.load[std::size_t(e)] += std::int64_t(offsets[std::size_t(e) + 1] - offsets[std::size_t(e)]);
    out.layers += 1;
  }

  /// Refuses what the layer cannot run on the host, with the reason.
  template <class B>
  static void check_runs(B& be, index_t n) {
    CUPIPE_REQUIRE(cp::ring_size(be) == 1, describe(), ": context parallelism splits each sequence over a ring, but the "
                   "capacity and the balance loss are per whole sequence; run MoE without --cp");
    CUPIPE_REQUIRE(n % SeqLen == 0, describe(), ": ", n, " rows are not whole sequences of ", SeqLen);
  }

  static constexpr index_t dw1_at(index_t e) { return E * C + e * Hidden * C; }
  static constexpr index_t db1_at(index_t e) { return E * C + E * Hidden * C + e * Hidden; }
  static constexpr index_t dw2_at(index_t e) { return E * C + E * Hidden * C + E * Hidden + e * C * Hidden; }
  static constexpr index_t db2_at(index_t e) { return E * C + E * Hidden * C + E * Hidden + E * C * Hidden + e * C; }
  template <class B, class T>
  static ConstViewOn<B, T> w1(const T* p, index_t e) { return {p + dw1_at(e), Shape{Hidden, C}}; }
  template <class B, class T>
  static ConstViewOn<B, T> b1(const T* p, index_t e) { return {p + db1_at(e), Shape{Hidden}}; }
  template <class B, class T>
  static ConstViewOn<B, T> w2(const T* p, index_t e) { return {p + dw2_at(e), Shape{C, Hidden}}; }
  template <class B, class T>
  static ConstViewOn<B, T> b2(const T* p, index_t e) { return {p + db2_at(e), Shape{C}}; }
};

}  // namespace cupipe
