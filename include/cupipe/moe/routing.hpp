// SPDX-License-Identifier: Apache-2.0
// The router of a mixture-of-experts layer and the dispatch of its tokens, in host memory: the
// arithmetic layers/moe.hpp runs on the host backend, and the oracle of any device kernel.
//
// For each token t (a row) the router's logits z_t (E) give probabilities p_t = softmax(z_t); the k
// largest pick its experts (ties to the lower index), and its gates are those probabilities,
// renormalised over the k when k > 1 (GShard's and Mixtral's top-2; Switch's top-1 keeps the raw
// probability, so that the router learns from the main loss).
//
// Capacity and the balancing loss are per sequence (GShard's groups, one sequence each; DeepSeek-V3's
// sequence-wise balance loss), so that neither depends on how a batch is cut into microbatches or
// spread over ranks: the pipelined model, any schedule, and expert parallelism see exactly the same
// routing as the unpipelined one.
// - Capacity: with a capacity factor cf > 0 an expert takes at most ceil(cf T k / E) slots of a
//   sequence of T tokens; the first choices of every token of the sequence are placed first, in
//   token order, then the second choices (GShard's priority), and what overflows is dropped (its
//   expert output is zero; the residual carries the token). cf = 0 is dropless.
// - Balance: L_bal(s) = E sum_e f_se P_se, with f_se the share of the sequence's k T choices that
//   picked e (before drops) and P_se the mean probability of e over its tokens; the step's loss adds
//   balance_coef times its mean over the step's sequences.
// - Router z-loss (ST-MoE): z_coef times the mean over the step's tokens of logsumexp(z_t)^2.
// "The step's" means over the loss normalizer N (the step's tokens, every microbatch and replica),
// so the per-microbatch terms add up to the step's mean as the cross-entropy's do.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <limits>
#include <string>
#include <vector>

#include "cupipe/core/error.hpp"
#include "cupipe/core/shape.hpp"

namespace cupipe::moe {

/// How a mixture-of-experts layer routes its tokens (a structural type: the layer's template argument).
struct Routing {
  index_t experts = 8;          ///< E
  index_t top_k = 2;            ///< k: experts per token (1 or 2 ... E)
  double capacity_factor = 0;   ///< cf: 0 dropless; else at most ceil(cf T k / E) slots per expert and sequence
  double balance_coef = 0.01;   ///< the load-balancing loss's coefficient (Switch: 0.01)
  double z_coef = 0.001;        ///< the router z-loss's coefficient (ST-MoE: 0.001)

  constexpr bool valid() const {
    return experts >= 1 && top_k >= 1 && top_k <= experts && capacity_factor >= 0 && balance_coef >= 0 && z_coef >= 0;
  }
  /// Slots one expert takes from a sequence of `seq_len` tokens: all of them when dropless.
  constexpr index_t capacity(index_t seq_len) const {
    if (capacity_factor <= 0) return seq_len * top_k;
    const double c = capacity_factor * double(seq_len) * double(top_k) / double(experts);
    index_t whole = index_t(c);
    if (double(whole) < c) ++whole;
    return std::max<index_t>(whole, 1);
  }
};

/// A factor as a short text ("1.25"), for descriptions.
inline std::string factor_text(double v) {
  char text[32];
  std::snprintf(text, sizeof text, "%g", v);
  return text;
}

/// The router's forward over `n` rows: probabilities `probs` (n, E) from `logits` (n, E), their
/// log-sum-exps `lse` (n), each row's experts (n, k; the most probable first) and gates (n, k).
template <class T>
void route(const T* logits, index_t n, const Routing& r, T* probs, T* lse, std::int32_t* experts, T* gates) {
  const index_t E = r.experts, k = r.top_k;
  for (index_t t = 0; t < n; ++t) {
    const T* z = logits + t * E;
    T* p = probs + t * E;
    T top = z[0];
    for (index_t e = 1; e < E; ++e) top = std::max(top, z[e]);
    T sum = 0;
    for (index_t e = 0; e < E; ++e) sum += (p[e] = std::exp(z[e] - top));
    for (index_t e = 0; e < E; ++e) p[e] /= sum;
    lse[t] = top + std::log(sum);
    std::int32_t* ex = experts + t * k;
    T* g = gates + t * k;
    T picked = 0;
    for (index_t j = 0; j < k; ++j) {
      index_t best = -1;
      for (index_t e = 0; e < E; ++e) {
        bool taken = false;
        for (index_t i = 0; i < j; ++i) taken = taken || ex[i] == std::int32_t(e);
        if (!taken && (best < 0 || p[e] > p[best])) best = e;
      }
      ex[j] = std::int32_t(best);
      g[j] = p[best];
      picked += p[best];
    }
    if (k > 1)
      for (index_t j = 0; j < k; ++j) g[j] /= picked;
  }
}

/// Where each expert's rows begin (`offsets`, E + 1) among the kept slots sorted by expert: from
/// each choice's expert and whether it is kept (slot >= 0; `dispatch` and the backward both count so).
inline void expert_offsets(const std::int32_t* experts, const std::int32_t* slot, index_t n, const Routing& r, index_t* offsets) {
  std::fill(offsets, offsets + r.experts + 1, 0);
  for (index_t i = 0; i < n * r.top_k; ++i)
    if (slot[i] >= 0) ++offsets[experts[i] + 1];
  for (index_t e = 0; e < r.experts; ++e) offsets[e + 1] += offsets[e];
}

/// Where each of `n` rows' k choices (`experts`, n x k) goes: `slot` (n x k) its row in the buffer
/// of the kept slots sorted by expert (and within an expert by row, then choice), -1 where the
/// expert's capacity in the row's sequence (of `seq_len` rows) dropped it; `offsets` (E + 1) where
/// each expert's rows begin in that buffer. Returns the slots dropped.
inline std::int64_t dispatch(const std::int32_t* experts, index_t n, index_t seq_len, const Routing& r, std::int32_t* slot,
                             index_t* offsets) {
  const index_t E = r.experts, k = r.top_k, cap = r.capacity(seq_len);
  CUPIPE_REQUIRE(seq_len > 0 && n % seq_len == 0, "moe::dispatch: ", n, " rows are not whole sequences of ", seq_len);
  std::vector<index_t> taken(std::size_t(E), 0);
  std::int64_t dropped = 0;
  // Which slots the capacity keeps: per sequence, first choices in token order, then second ones.
  for (index_t s0 = 0; s0 < n; s0 += seq_len) {
    std::fill(taken.begin(), taken.end(), 0);
    for (index_t j = 0; j < k; ++j)
      for (index_t t = s0; t < s0 + seq_len; ++t) {
        const std::int32_t e = experts[t * k + j];
        CUPIPE_REQUIRE(e >= 0 && e < E, "moe::dispatch: row ", t, " chose expert ", e, " of ", E);
        const bool keep = taken[std::size_t(e)] < cap;
        taken[std::size_t(e)] += keep ? 1 : 0;
        dropped += keep ? 0 : 1;
        slot[t * k + j] = keep ? 0 : -1;
      }
  }
  // The kept slots' rows, grouped by expert.
  expert_offsets(experts, slot, n, r, offsets);
  std::vector<index_t> next(offsets, offsets + E);
  for (index_t i = 0; i < n * k; ++i)
    if (slot[i] >= 0) slot[i] = std::int32_t(next[std::size_t(experts[i])]++);
  return dropped;
}

/// The sum over the sequences of n rows of L_bal(s) = E sum_e f_se P_se, times seq_len / `normalizer`
/// (so a step's microbatches add up to its mean over sequences). With `dprobs` (n, E), adds the
/// gradient of balance_coef times that value with respect to the probabilities.
template <class T>
double balance_loss(const T* probs, const std::int32_t* experts, index_t n, index_t seq_len, const Routing& r,
                    index_t normalizer, T* dprobs) {
  const index_t E = r.experts, k = r.top_k;
  std::vector<double> f(static_cast<std::size_t>(E)), P(static_cast<std::size_t>(E));
  double total = 0;
  for (index_t s0 = 0; s0 < n; s0 += seq_len) {
    std::fill(f.begin(), f.end(), 0.0);
    std::fill(P.begin(), P.end(), 0.0);
    for (index_t t = s0; t < s0 + seq_len; ++t) {
      for (index_t j = 0; j < k; ++j) f[std::size_t(experts[t * k + j])] += 1.0;
      for (index_t e = 0; e < E; ++e) P[std::size_t(e)] += double(probs[t * E + e]);
    }
    double l = 0;
    for (index_t e = 0; e < E; ++e) {
      f[std::size_t(e)] /= double(seq_len * k);
      l += f[std::size_t(e)] * P[std::size_t(e)] / double(seq_len);
    }
    total += double(E) * l;
    if (dprobs != nullptr)  // d/dp_te of coef (T / N) E sum_e f_se (1/T) sum_t p_te
      for (index_t t = s0; t < s0 + seq_len; ++t)
        for (index_t e = 0; e < E; ++e) dprobs[t * E + e] += T(r.balance_coef * double(E) * f[std::size_t(e)] / double(normalizer));
  }
  return total * double(seq_len) / double(normalizer);
}

/// The router's backward over n rows: `dlogits` (n, E) from the gates' gradient `dgates` (n, k)
/// through their renormalisation and the softmax, with `dprobs` (n, E) already holding any other
/// gradient of the probabilities (the balance loss's; it is used as scratch), plus the z-loss's
/// z_coef 2 lse p / normalizer. Returns the z-loss's value, sum lse^2 / normalizer.
template <class T>
double router_backward(const T* probs, const T* lse, const std::int32_t* experts, const T* gates, const T* dgates, index_t n,
                       const Routing& r, index_t normalizer, T* dprobs, T* dlogits) {
  const index_t E = r.experts, k = r.top_k;
  double z = 0;
  for (index_t t = 0; t < n; ++t) {
    const T* p = probs + t * E;
    T* dp = dprobs + t * E;
    const std::int32_t* ex = experts + t * k;
    const T* dg = dgates + t * k;
    if (k == 1) {
      dp[ex[0]] += dg[0];
    } else {  // g_j = p_j / S over the picked: dp_j = (dg_j - sum_i dg_i g_i) / S
      T picked = 0, dot = 0;
      for (index_t j = 0; j < k; ++j) {
        picked += p[ex[j]];
        dot += dg[j] * gates[t * k + j];
      }
      for (index_t j = 0; j < k; ++j) dp[ex[j]] += (dg[j] - dot) / picked;
    }
    T dot = 0;
    for (index_t e = 0; e < E; ++e) dot += p[e] * dp[e];
    const T zg = T(2.0 * r.z_coef * double(lse[t]) / double(normalizer));
    for (index_t e = 0; e < E; ++e) dlogits[t * E + e] = p[e] * (dp[e] - dot) + zg * p[e];
    z += double(lse[t]) * double(lse[t]);
  }
  return z / double(normalizer);
}

}  // namespace cupipe::moe
