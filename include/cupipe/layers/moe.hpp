// SPDX-License-Identifier: Apache-2.0
// MixtureOfExperts<C, Hidden, SeqLen, Routing>: a feed-forward layer of E experts, each GPT-2's MLP
// (c_fc: Linear<C, Hidden> then GELU, c_proj: Linear<Hidden, C>), of which a top-k softmax router
// picks k per token (moe/routing.hpp: gates, capacity, the balancing loss and the z-loss):
//   y_t = sum over t's kept choices j of gate_tj * expert_{e_tj}(x_t)
// Tokens are sorted by expert into contiguous groups (moe::dispatch), so each expert runs two GEMMs
// over its group (the backend's gemm: OpenBLAS on the host); a dropped choice contributes nothing.
// The rows move to their groups and back through the backend's token-movement ops (moe_permute,
// moe_unpermute and their backwards: backend/host/ops_moe.hpp, and on CUDA backend/cuda/ops_moe.cuh).
// The auxiliary losses' gradients enter in backward_input, scaled by the step's loss normalizer,
// which the runner sets on the context (Host::aux_loss_normalizer; 0: the microbatch's rows, as
// Network's default), and backward_input adds what the layer did to Host::moe_tally when one is set.
//
// Parameters (PyTorch shapes, the experts stacked): router.weight (E, C), experts.c_fc.weight (E H, C),
// experts.c_fc.bias (E H), experts.c_proj.weight (E C, H), experts.c_proj.bias (E C).
// Runs in fp32 or fp64 storage (bf16 storage is refused with the reason). On a device backend
// (backend::Cuda) the GEMMs, GELU and token movement run on the device and the routing on the host,
// the router's tables downloaded and uploaded around it (backend::HostMirror): one synchronisation
// per layer and pass, as the per-expert GEMMs' row counts are the host's anyway. A device kernel for
// the routing and a grouped GEMM are the next steps (docs/gpu_notes.md).
//
// Expert parallelism (EP > 1): the layer is one rank's part of an expert-parallel group of EP ranks
// (moe/expert_group.hpp, the backend context's expert_group), holding E / EP experts (rank t experts
// [t E / EP, (t + 1) E / EP); their tensors are TensorSplit::expert_rows) and the whole router. Each
// rank routes its own rows; the slots travel to their experts' ranks and the experts' outputs back
// (moe/exchange.hpp: counts first, then two all-to-alls), and the same in the backward with the
// outputs' gradients. An expert's rank keeps what its backward_weight needs (the slots' inputs, GELU
// inputs and gradients) in its own saved area, sized for the most slots it can receive: with a
// capacity factor ceil(E capacity / SeqLen) per row of its own (GShard's and Switch's reason for a
// capacity), dropless EP k (every slot of the group). Routing is per sequence, so the group computes
// exactly what the whole layer computes over the same rows. The all-to-alls run beside compute where
// there is some to run: the slots a rank sent itself while the dispatch moves the others', the
// router's backward while the backward's combine comes home; the context's tally gets their time.
// On a device the rows are reordered there, and a group of host memory (MPI's) gets them through
// host copies (moe/backend_transfer.hpp); a device group (NCCL's) moves them where they are.
#pragma once

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <type_traits>
#include <vector>

#include "cupipe/backend/op_types.hpp"
#include "cupipe/backend/staging.hpp"
#include "cupipe/core/error.hpp"
#include "cupipe/core/rng.hpp"
#include "cupipe/cp/context_group.hpp"
#include "cupipe/layers/layer.hpp"
#include "cupipe/moe/backend_transfer.hpp"
#include "cupipe/moe/exchange.hpp"
#include "cupipe/moe/expert_group.hpp"
#include "cupipe/moe/routing.hpp"
#include "cupipe/moe/tally.hpp"

namespace cupipe {

template <index_t C, index_t Hidden, index_t SeqLen, moe::Routing R, int EP = 1>
struct MixtureOfExperts : LayerDefaults {
  static_assert(C > 0 && Hidden > 0 && SeqLen > 0, "MixtureOfExperts<C, Hidden, SeqLen, Routing> needs positive sizes");
  static_assert(R.valid(), "MixtureOfExperts: the routing needs 1 <= top_k <= experts and coefficients >= 0");
  static_assert(EP >= 1 && R.experts % EP == 0, "MixtureOfExperts: the expert-parallel degree EP must divide the experts");
  static constexpr index_t E = R.experts;
  static constexpr index_t K = R.top_k;
  static constexpr index_t El = E / EP;  ///< experts held here
  /// Slots an expert's rank keeps per row of its own: the most it can receive (see above).
  static constexpr index_t M = EP == 1 ? K : std::min<index_t>(EP * K, (E * R.capacity(SeqLen) + SeqLen - 1) / SeqLen);
  static constexpr TensorSplit split = EP > 1 ? TensorSplit::expert_rows : TensorSplit::none;
  static constexpr index_t in_features = C;
  static constexpr index_t out_features_for(index_t) { return C; }
  /// The capacity and the balance loss are per sequence: a microbatch holds whole ones.
  static constexpr index_t rows_per_sample = SeqLen;
  static constexpr bool weight_grads_need_backward_input = true;
  /// Values per row the dispatch sends over an expert-parallel group (the combine sends as many
  /// back): each token's top_k copies. What the planner prices at CostModel::expert_ranks > 1.
  static constexpr index_t all_to_all_values_per_row = K * C;

  static constexpr std::array<ParamSpec, 5> params(index_t) {
    return {{{"router.weight", E, C},
             {"experts.c_fc.weight", El * Hidden, C, split, EP},
             {"experts.c_fc.bias", El * Hidden, 0, split, EP},
             {"experts.c_proj.weight", El * C, Hidden, split, EP},
             {"experts.c_proj.bias", El * C, 0, split, EP}}};
  }
  /// Per row, each region rounded to stat_slots: probs (E), lse, experts (k), gates (k), slots (k),
  /// and per kept slot here the expert's GELU input (M Hidden) and per choice its output (k C); then
  /// what backward_input writes for backward_weight: the expert outputs' gradient (M C), the GELU
  /// inputs' (M Hidden), dlogits (E). With EP > 1 also the slots' inputs (M C) and the counts received.
  static constexpr index_t saved_per_row(index_t) {
    return 2 * r(E) + stat_slots + 2 * K * stat_slots + r(K) + 2 * r(M * Hidden) + r(K * C) + r(M * C) +
           (EP > 1 ? r(M * C) + r((E + SeqLen - 1) / SeqLen) : 0);
  }
  /// The router, and k experts' two GEMMs and GELU per token.
  static constexpr double forward_flops_per_sample(index_t) {
    return 2.0 * double(C) * double(E) + double(K) * (4.0 * double(C) * double(Hidden) + 8.0 * double(Hidden));
  }
  static std::string describe() {
    return "MixtureOfExperts<" + std::to_string(C) + ", " + std::to_string(Hidden) + ", " + std::to_string(SeqLen) +
           ", E " + std::to_string(E) + ", top-" + std::to_string(K) +
           (R.capacity_factor > 0 ? ", capacity " + moe::factor_text(R.capacity_factor) : std::string(", dropless")) +
           (EP > 1 ? ", EP " + std::to_string(EP) : std::string()) + ">";
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
    else forward_impl(be, p, x, y, saved);
  }

  /// dgates and the experts' output gradients from dy; through each expert to its GELU input's
  /// gradient (kept) and its share of dx; the router's logits' gradient (kept) with the balance and
  /// z-loss terms; dx = dlogits W_router + the experts' shares.
  template <class B, class T, class SavedView>
  static void backward_input(B& be, const T* p, ConstViewOn<B, T> x, SavedView saved, ConstViewOn<B, T> dy, ViewOn<B, T> dx) {
    if constexpr (!runs<B, T>) refuse<B>();
    else backward_input_impl(be, p, x, const_cast<T*>(saved.data()), dy, dx);
  }

  /// From what backward_input kept: d router += dlogits^T x; per expert dW1 += dh^T xs, db1 += sum dh,
  /// dW2 += do^T gelu(h), db2 += sum do.
  template <class B, class T = typename B::value_type, class SavedView>
  static void backward_weight(B& be, ConstViewOn<B, T> x, SavedView saved, ConstViewOn<B, T>, grad_t<B>* g) {
    if constexpr (!runs<B, T>) refuse<B>();
    else backward_weight_impl(be, x, const_cast<T*>(saved.data()), g);
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
  /// Whether the layer runs on B with storage T: storage in the compute type.
  template <class B, class T>
  static constexpr bool runs = std::is_same_v<T, grad_t<B>>;

  template <class B>
  [[noreturn]] static void refuse() {
    CUPIPE_THROW(describe(), ": runs in fp32 or fp64 storage (this backend is ", B::name, ", with other storage)");
  }

  /// Moves `count` values within the backend's memory (reorder and place_own's blocks).
  template <class B, class T>
  static auto copier(B& be) {
    return [&be](const T* from, T* to, index_t count) {
      copy(be, ConstViewOn<B, T>{from, Shape{count}}, ViewOn<B, T>{to, Shape{count}});
    };
  }

  template <class B, class T>
  static void forward_impl(B& be, const T* p, ConstViewOn<B, T> x, ViewOn<B, T> y, ViewOn<B, T> saved) {
    check_runs(be, x.rows());
    const index_t n = x.rows();
    const Saved<T> s(saved.data(), n);
    // The router: logits into the probabilities' place, then softmax, top-k and the dispatch there,
    // on the host (a device's tables go there and back: the GEMMs' row counts are the host's anyway).
    gemm(be, ops::Transpose::no, ops::Transpose::yes, T(1), x, ConstViewOn<B, T>{p, Shape{E, C}}, T(0),
         ViewOn<B, T>{s.probs, Shape{n, E}});
    std::vector<index_t> offsets(std::size_t(E + 1));
    {
      backend::HostMirror<B, T> probs(be, s.probs, n * E, true), lse(be, s.lse, n, false), gates(be, s.gates, n * K, false);
      backend::HostMirror<B, std::int32_t> experts(be, s.experts, n * K, false), slots(be, s.slot, n * K, false);
      moe::route(probs.data(), n, R, probs.data(), lse.data(), experts.data(), gates.data());
      moe::dispatch(experts.data(), n, SeqLen, R, slots.data(), offsets.data());
      probs.put();
      lse.put();
      gates.put();
      experts.put();
      slots.put();
    }
    // The kept slots' inputs, sorted by expert; each expert over its group: h = x W1^T + b1 (kept),
    // o = gelu(h) W2^T + b2 (kept, per choice) -- here, or on the experts' ranks and back.
    const index_t kept = offsets[std::size_t(E)];
    auto xs = be.template allocate<T>(std::max<index_t>(kept, 1) * C, MemoryTag::workspace);
    moe_permute(be, x, slots_of<B>(s, n), ViewOn<B, T>{xs.data(), Shape{kept, C}});
    if constexpr (EP == 1) {
      auto act = be.template allocate<T>(std::max<index_t>(kept, 1) * Hidden, MemoryTag::workspace);
      experts_forward(be, p, runs_of(offsets), xs.data(), s.h, act.data(), s.o);
    } else {
      moe::ExpertGroup& group = group_of(be);
      const moe::ExchangeCounts c = exchange(be, group, offsets, n);
      const index_t received = c.received();
      CUPIPE_REQUIRE(received <= n * M, describe(), ": rank ", group.rank(), " of ", group.name(), " received ", received,
                     " slots for its experts, more than the ", n * M, " its saved area holds for ", n, " rows");
      {
        backend::HostMirror<B, std::int32_t> counts(be, s.counts, E, false);
        std::copy(c.counts.begin(), c.counts.end(), counts.data());
        counts.put();
      }
      const int me = group.rank();
      const auto move = copier<B, T>(be);
      auto scratch = be.template allocate<T>(std::max<index_t>(received, 1) * C, MemoryTag::workspace);
      auto out = be.template allocate<T>(std::max<index_t>(received, 1) * C, MemoryTag::workspace);
      auto act = be.template allocate<T>(std::max<index_t>(received, 1) * Hidden, MemoryTag::workspace);
      // Dispatch: the other ranks' slots travel while this rank runs the slots it sent itself.
      auto dispatch = transfer<T>(be, group);
      dispatch.start(xs.data(), moe::value_counts(c, C, false), scratch.data(), moe::value_counts(c, C, true));
      moe::place_own(c, me, xs.data() + offsets[std::size_t(me * El)] * C, s.xs, C, move);
      experts_forward(be, p, moe::expert_rows(c, me, true), s.xs, s.h, act.data(), out.data());
      dispatch.finish();
      moe::reorder(c, scratch.data(), s.xs, C, false, move);
      experts_forward(be, p, moe::expert_rows(c, me, false), s.xs, s.h, act.data(), out.data());
      // Combine: the outputs back to their tokens' ranks, in slot order (nothing left to run meanwhile).
      moe::reorder(c, out.data(), scratch.data(), C, true, move);
      auto combine = transfer<T>(be, group);
      combine.start(scratch.data(), moe::value_counts(c, C, true), s.o, moe::value_counts(c, C, false));
      combine.finish();
    }
    // Combine: y_t = sum_j gate_tj o[slot_tj], in choice order.
    moe_unpermute(be, ConstViewOn<B, T>{s.o, Shape{kept, C}}, slots_of<B>(s, n), ConstViewOn<B, T>{s.gates, Shape{n, K}}, y);
  }

  template <class B, class T>
  static void backward_input_impl(B& be, const T* p, ConstViewOn<B, T> x, T* saved, ConstViewOn<B, T> dy, ViewOn<B, T> dx) {
    check_runs(be, x.rows());
    const index_t n = x.rows();
    const Saved<T> s(saved, n);
    backend::HostMirror<B, std::int32_t> experts(be, s.experts, n * K, true);
    const std::vector<index_t> offsets = kept_offsets(be, s, experts.data(), n);
    const index_t kept = offsets[std::size_t(E)];
    // dgate_tj = dy_t . o_slot;  do_slot = gate_tj dy_t (a dropped choice has no slot): kept here,
    // or sent to the experts' ranks.
    auto sent = be.template allocate<T>(EP == 1 ? 1 : std::max<index_t>(kept, 1) * C, MemoryTag::workspace);
    T* d_o = EP == 1 ? s.d_o : sent.data();
    auto dgates = be.template allocate<T>(std::max<index_t>(n * K, 1), MemoryTag::workspace);
    moe_unpermute_backward(be, dy, ConstViewOn<B, T>{s.o, Shape{kept, C}}, slots_of<B>(s, n),
                           ConstViewOn<B, T>{s.gates, Shape{n, K}}, ViewOn<B, T>{d_o, Shape{kept, C}},
                           ViewOn<B, T>{dgates.data(), Shape{n, K}});
    // Through each expert: da = do W2, dh = da gelu'(h) (kept); dxs = dh W1 (per slot here).
    auto dxs = be.template allocate<T>(std::max<index_t>(kept, 1) * C, MemoryTag::workspace);
    auto scratch = be.template allocate<T>(EP == 1 ? 1 : std::max<index_t>(n * M, 1) * C, MemoryTag::workspace);
    std::optional<moe::BackendTransfer<B, T>> combine;  // EP > 1: the dxs coming home while the router's backward runs
    if constexpr (EP == 1) {
      auto da = be.template allocate<T>(std::max<index_t>(kept, 1) * Hidden, MemoryTag::workspace);
      experts_backward_input(be, p, runs_of(offsets), s.d_o, s.h, da.data(), s.dh, dx.empty() ? nullptr : dxs.data());
    } else {  // the experts' ranks take part whether or not this rank wants dx
      moe::ExpertGroup& group = group_of(be);
      const moe::ExchangeCounts c = exchange(be, group, offsets, n);
      backend::HostMirror<B, std::int32_t> forward_counts(be, s.counts, E, true);
      CUPIPE_REQUIRE(std::equal(c.counts.begin(), c.counts.end(), forward_counts.data()), describe(), ": rank ",
                     group.rank(), " of ", group.name(), " was sent other counts in the backward than in this microbatch's forward");
      const index_t received = c.received();
      const int me = group.rank();
      const auto move = copier<B, T>(be);
      auto back = be.template allocate<T>(std::max<index_t>(received, 1) * C, MemoryTag::workspace);
      auto da = be.template allocate<T>(std::max<index_t>(received, 1) * Hidden, MemoryTag::workspace);
      auto dispatch = transfer<T>(be, group);
      dispatch.start(sent.data(), moe::value_counts(c, C, false), scratch.data(), moe::value_counts(c, C, true));
      moe::place_own(c, me, sent.data() + offsets[std::size_t(me * El)] * C, s.d_o, C, move);
      experts_backward_input(be, p, moe::expert_rows(c, me, true), s.d_o, s.h, da.data(), s.dh, back.data());
      dispatch.finish();
      moe::reorder(c, scratch.data(), s.d_o, C, false, move);
      experts_backward_input(be, p, moe::expert_rows(c, me, false), s.d_o, s.h, da.data(), s.dh, back.data());
      moe::reorder(c, back.data(), scratch.data(), C, true, move);
      combine.emplace(be, group, be.moe_tally);
      combine->start(scratch.data(), moe::value_counts(c, C, true), dxs.data(), moe::value_counts(c, C, false));
    }
    // The router on the host: the balance loss's gradient of the probabilities, then dlogits (kept).
    const index_t normalizer = be.aux_loss_normalizer > 0 ? be.aux_loss_normalizer : n;
    std::vector<T> dprobs(std::size_t(n * E), T(0));
    double balance = 0, z = 0;
    {
      backend::HostMirror<B, T> probs(be, s.probs, n * E, true), lse(be, s.lse, n, true), gates(be, s.gates, n * K, true),
          d_gates(be, dgates.data(), n * K, true), dlogits(be, s.dlogits, n * E, false);
      balance = moe::balance_loss(probs.data(), experts.data(), n, SeqLen, R, normalizer, dprobs.data());
      z = moe::router_backward(probs.data(), lse.data(), experts.data(), gates.data(), d_gates.data(), n, R, normalizer,
                               dprobs.data(), dlogits.data());
      dlogits.put();
    }
    if (be.moe_tally != nullptr) tally(*be.moe_tally, n, offsets, balance, z);
    if (!dx.empty())
      gemm(be, ops::Transpose::no, ops::Transpose::no, T(1), ConstViewOn<B, T>{s.dlogits, Shape{n, E}},
           ConstViewOn<B, T>{p, Shape{E, C}}, T(0), dx);
    if (combine) combine->finish();
    if (dx.empty()) return;
    moe_permute_backward(be, ConstViewOn<B, T>{dxs.data(), Shape{kept, C}}, slots_of<B>(s, n), dx);
  }

  template <class B, class T>
  static void backward_weight_impl(B& be, ConstViewOn<B, T> x, T* saved, T* g) {
    check_runs(be, x.rows());
    const index_t n = x.rows();
    const Saved<T> s(saved, n);
    gemm(be, ops::Transpose::yes, ops::Transpose::no, T(1), ConstViewOn<B, T>{s.dlogits, Shape{n, E}}, x, T(1),
         ViewOn<B, T>{g, Shape{E, C}});
    // The rows each local expert ran: this rank's kept slots, or what it received.
    std::vector<index_t> at(std::size_t(El + 1));
    if constexpr (EP == 1) {
      backend::HostMirror<B, std::int32_t> experts(be, s.experts, n * K, true);
      at = kept_offsets(be, s, experts.data(), n);
    } else {
      backend::HostMirror<B, std::int32_t> counts(be, s.counts, E, true);
      at = owner_offsets(moe::ExchangeCounts{EP, El, std::vector<index_t>(counts.data(), counts.data() + E), {}});
    }
    auto gathered = be.template allocate<T>(EP == 1 ? std::max<index_t>(at[std::size_t(El)], 1) * C : 1, MemoryTag::workspace);
    if constexpr (EP == 1) moe_permute(be, x, slots_of<B>(s, n), ViewOn<B, T>{gathered.data(), Shape{at[std::size_t(El)], C}});
    const T* xs = EP == 1 ? gathered.data() : s.xs;
    auto act = be.template allocate<T>(std::max<index_t>(at[std::size_t(El)], 1) * Hidden, MemoryTag::workspace);
    for (index_t e = 0; e < El; ++e) {
      const index_t first = at[std::size_t(e)], rows = at[std::size_t(e) + 1] - first;
      if (rows == 0) continue;
      const ConstViewOn<B, T> dh{s.dh + first * Hidden, Shape{rows, Hidden}};
      const ConstViewOn<B, T> d_o{s.d_o + first * C, Shape{rows, C}};
      const ViewOn<B, T> a{act.data() + first * Hidden, Shape{rows, Hidden}};
      gelu_forward(be, ConstViewOn<B, T>{s.h + first * Hidden, Shape{rows, Hidden}}, a);
      gemm(be, ops::Transpose::yes, ops::Transpose::no, T(1), dh, ConstViewOn<B, T>{xs + first * C, Shape{rows, C}}, T(1),
           ViewOn<B, T>{g + dw1_at(e), Shape{Hidden, C}});
      bias_backward(be, dh, ViewOn<B, T>{g + db1_at(e), Shape{Hidden}});
      gemm(be, ops::Transpose::yes, ops::Transpose::no, T(1), d_o, ConstViewOn<B, T>(a), T(1),
           ViewOn<B, T>{g + dw2_at(e), Shape{C, Hidden}});
      bias_backward(be, d_o, ViewOn<B, T>{g + db2_at(e), Shape{C}});
    }
  }

  /// Each run's local expert e over its rows [first, first + rows) of `xs` (expert-major): h = xs
  /// W1^T + b1, a = gelu(h) (`act`), o = a W2^T + b2.
  template <class B, class T>
  static void experts_forward(B& be, const T* p, const std::vector<moe::ExpertRows>& runs, const T* xs, T* h, T* act, T* o) {
    for (const auto& [e, first, rows] : runs) {
      const ViewOn<B, T> he{h + first * Hidden, Shape{rows, Hidden}};
      const ViewOn<B, T> oe{o + first * C, Shape{rows, C}};
      const ViewOn<B, T> a{act + first * Hidden, Shape{rows, Hidden}};
      gemm(be, ops::Transpose::no, ops::Transpose::yes, T(1), ConstViewOn<B, T>{xs + first * C, Shape{rows, C}}, w1<B>(p, e),
           T(0), he);
      bias_add(be, he, b1<B>(p, e));
      gelu_forward(be, ConstViewOn<B, T>(he), a);
      gemm(be, ops::Transpose::no, ops::Transpose::yes, T(1), ConstViewOn<B, T>(a), w2<B>(p, e), T(0), oe);
      bias_add(be, oe, b2<B>(p, e));
    }
  }

  /// Back through each run's local expert: da = do W2, dh = da gelu'(h) (`dh`), and with `dxs` dxs = dh W1.
  template <class B, class T>
  static void experts_backward_input(B& be, const T* p, const std::vector<moe::ExpertRows>& runs, const T* d_o, const T* h,
                                     T* da, T* dh, T* dxs) {
    for (const auto& [e, first, rows] : runs) {
      const ViewOn<B, T> dae{da + first * Hidden, Shape{rows, Hidden}};
      const ViewOn<B, T> dhe{dh + first * Hidden, Shape{rows, Hidden}};
      gemm(be, ops::Transpose::no, ops::Transpose::no, T(1), ConstViewOn<B, T>{d_o + first * C, Shape{rows, C}}, w2<B>(p, e),
           T(0), dae);
      gelu_backward(be, ConstViewOn<B, T>{h + first * Hidden, Shape{rows, Hidden}}, ConstViewOn<B, T>(dae), dhe);
      if (dxs != nullptr)
        gemm(be, ops::Transpose::no, ops::Transpose::no, T(1), ConstViewOn<B, T>(dhe), w1<B>(p, e), T(0),
             ViewOn<B, T>{dxs + first * C, Shape{rows, C}});
    }
  }

  /// Where each local expert's rows begin among what this rank received, expert-major (El + 1).
  static std::vector<index_t> owner_offsets(const moe::ExchangeCounts& c) {
    std::vector<index_t> at(std::size_t(El + 1), 0);
    for (index_t e = 0; e < El; ++e) at[std::size_t(e) + 1] = at[std::size_t(e)] + c.for_expert(e);
    return at;
  }

  /// Each expert's kept slots (`offsets`, E + 1, sorted by expert) as one run.
  static std::vector<moe::ExpertRows> runs_of(const std::vector<index_t>& offsets) {
    std::vector<moe::ExpertRows> runs;
    for (index_t e = 0; e < El; ++e)
      if (offsets[std::size_t(e) + 1] > offsets[std::size_t(e)])
        runs.push_back({e, offsets[std::size_t(e)], offsets[std::size_t(e) + 1] - offsets[std::size_t(e)]});
    return runs;
  }

  /// The counts' exchange of n rows whose kept slots begin at `offsets`, its time added to the
  /// context's tally (a blocking exchange: in flight and exposed alike).
  template <class B>
  static moe::ExchangeCounts exchange(B& be, moe::ExpertGroup& group, const std::vector<index_t>& offsets, index_t n) {
    double seconds = 0;
    moe::ExchangeCounts c = moe::exchange_counts(group, offsets.data(), E, K, C, n, describe(), &seconds);
    if (be.moe_tally != nullptr) {
      be.moe_tally->all_to_all_seconds += seconds;
      be.moe_tally->exposed_all_to_all_seconds += seconds;
    }
    return c;
  }
  /// An all-to-all of T values over `group`, in the backend's memory, timed into the context's tally.
  template <class T, class B>
  static moe::BackendTransfer<B, T> transfer(B& be, moe::ExpertGroup& group) {
    return {be, group, be.moe_tally};
  }

  template <class B>
  static moe::ExpertGroup& group_of(B& be) {
    moe::ExpertGroup* group = moe::expert_group_of(be);
    CUPIPE_REQUIRE(group != nullptr && group->size() == EP, describe(), ": holds 1 of ", EP, " parts of the experts, but ",
                   group ? "the backend context's expert-parallel group has " + std::to_string(group->size()) + " ranks"
                         : std::string("the backend context has no expert-parallel group (run it in a Pipeline whose "
                                       "communicator has one: comm::MpiCommunicator(..., expert_parallel)"),
                   ")");
    return *group;
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
    T* xs = nullptr;                 ///< EP > 1: the received slots' inputs, expert-major
    std::int32_t* counts = nullptr;  ///< EP > 1: slots received per source and local expert (E)
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
      h = take(r(M * Hidden));
      o = take(r(K * C));
      d_o = take(r(M * C));
      dh = take(r(M * Hidden));
      dlogits = take(r(E));
      if constexpr (EP > 1) {
        xs = take(r(M * C));
        counts = reinterpret_cast<std::int32_t*>(take(r((E + SeqLen - 1) / SeqLen)));
      }
    }
  };

  /// The saved slots of n rows (n, K): where each choice sits among the expert-sorted rows, -1 dropped.
  template <class B, class T>
  static ConstViewOn<B, std::int32_t> slots_of(const Saved<T>& s, index_t n) {
    return {s.slot, Shape{n, K}};
  }

  /// Where each expert's kept slots begin (E + 1) from n rows' choices (`experts`, in host memory) and
  /// the saved slots (read from the backend's memory here).
  template <class B, class T>
  static std::vector<index_t> kept_offsets(B& be, const Saved<T>& s, const std::int32_t* experts, index_t n) {
    backend::HostMirror<B, std::int32_t> slots(be, s.slot, n * K, true);
    std::vector<index_t> offsets(std::size_t(E + 1));
    moe::expert_offsets(experts, slots.data(), n, R, offsets.data());
    return offsets;
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

  // Local expert e's tensors (the router first, then El experts' stacked).
  static constexpr index_t dw1_at(index_t e) { return E * C + e * Hidden * C; }
  static constexpr index_t db1_at(index_t e) { return E * C + El * Hidden * C + e * Hidden; }
  static constexpr index_t dw2_at(index_t e) { return E * C + El * Hidden * C + El * Hidden + e * C * Hidden; }
  static constexpr index_t db2_at(index_t e) { return E * C + El * Hidden * C + El * Hidden + El * C * Hidden + e * C; }
  template <class B, class T>
  static ConstViewOn<B, T> w1(const T* p, index_t e) { return {p + dw1_at(e), Shape{Hidden, C}}; }
  template <class B, class T>
  static ConstViewOn<B, T> b1(const T* p, index_t e) { return {p + db1_at(e), Shape{Hidden}}; }
  template <class B, class T>
  static ConstViewOn<B, T> w2(const T* p, index_t e) { return {p + dw2_at(e), Shape{C, Hidden}}; }
  template <class B, class T>
  static ConstViewOn<B, T> b2(const T* p, index_t e) { return {p + db2_at(e), Shape{C}}; }
};

/// An expert-parallel part is a part of the whole layer (its initialisation and checkpoints, by name).
template <index_t C, index_t Hidden, index_t SeqLen, moe::Routing R, int EP>
struct whole_layer<MixtureOfExperts<C, Hidden, SeqLen, R, EP>> {
  using type = MixtureOfExperts<C, Hidden, SeqLen, R, 1>;
};

}  // namespace cupipe
