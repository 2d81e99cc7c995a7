// SPDX-License-Identifier: Apache-2.0
// Schedule policies: tag types with static constexpr knobs, and the constexpr generators that turn
// a policy and a Config into a Plan. The same code runs in static_assert and at run time.
#pragma once

#include <algorithm>
#include <array>
#include <string>
#include <string_view>
#include <vector>

#include "cupipe/core/error.hpp"
#include "cupipe/schedule/action.hpp"

namespace cupipe::schedule {

/// Run-time name of a policy, for the explorer and trainers that pick a schedule from a flag.
enum class PolicyId : std::uint8_t { gpipe, one_f_one_b, interleaved, pipedream, pipedream_2bw, zb_h1, zb_h2 };

/// GPipe (Huang et al., NeurIPS 2019): all forwards, then all backwards, then a flush.
struct GPipe {
  static constexpr std::string_view name = "gpipe";
  static constexpr PolicyId id = PolicyId::gpipe;
  static constexpr bool split_backward = false;
  static constexpr UpdateRule update = UpdateRule::flush;
  static constexpr int chunks = 1;
  static constexpr int default_batches = 1;
};

/// 1F1B with a flush, i.e. PipeDream-Flush (Narayanan et al., ICML 2021) as used by Megatron-LM:
/// stage s runs min(p-s-1, m) warm-up forwards, alternates one forward and one backward, then
/// drains the remaining backwards. Holds at most min(p-s, m) microbatches' activations.
struct OneFOneB : GPipe {
  static constexpr std::string_view name = "1f1b";
  static constexpr PolicyId id = PolicyId::one_f_one_b;
};

/// Megatron-LM's interleaved 1F1B (Narayanan et al., "Efficient Large-Scale Language Model Training
/// on GPU Clusters Using Megatron-LM", SC'21). Stage s holds chunks s, s+p, ..., s+(V-1)p and walks
/// microbatches depth-first in groups of p: all V chunks of microbatches 0..p-1, then the next group.
///
/// Supported microbatch counts: m a multiple of p (groups of p, as in Megatron-LM), or any m < 2p,
/// which runs as one depth-first group of all m microbatches (m < p included, with more bubble).
/// Other m are rejected: a leftover group of another size than the rest deadlocks once sends block
/// (verify finds it). Warm-up on stage s is min(2(p-s-1) + (V-1)g, V*m) forwards for group size g,
/// as in Megatron-LM. V must be at least 2.
template <int V>
struct Interleaved : GPipe {
  static_assert(V >= 2, "Interleaved<V> needs at least 2 chunks per stage; with 1 chunk use OneFOneB");
  static constexpr std::string_view name = "interleaved";
  static constexpr PolicyId id = PolicyId::interleaved;
  static constexpr int chunks = V;
};

/// PipeDream (Narayanan et al., "PipeDream: Generalized Pipeline Parallelism for DNN Training",
/// SOSP'19): 1F1B without any flush, across batches. Every stage updates its weights after each
/// of its backwards; weight stashing with vertical sync keeps each microbatch on one version.
struct PipeDream {
  static constexpr std::string_view name = "pipedream";
  static constexpr PolicyId id = PolicyId::pipedream;
  static constexpr bool split_backward = false;
  static constexpr UpdateRule update = UpdateRule::per_microbatch;
  static constexpr int chunks = 1;
  static constexpr int default_batches = 2;
};

/// PipeDream-2BW (Narayanan et al., "Memory-Efficient Pipeline-Parallel DNN Training", ICML 2021):
/// 1F1B without a flush across batches, with double-buffered weights. Batch t runs on version
/// max(t-1, 0); a stage creates version t+1 right after its last backward of batch t.
struct PipeDream2BW : PipeDream {
  static constexpr std::string_view name = "2bw";
  static constexpr PolicyId id = PolicyId::pipedream_2bw;
  static constexpr UpdateRule update = UpdateRule::double_buffered;
};

/// ZB-H1 from Qi et al., "Zero Bubble Pipeline Parallelism" (ICLR 2024): the backward splits into
/// B (input gradient, on the critical path) and W (weight gradient, deferred to fill bubbles).
/// Stage s keeps at most min(p-s, m) microbatches between F and W, 1F1B's activation memory; the
/// bubble with F=B=W is a third of 1F1B's. Orders come from a unit-cost list scheduler with
/// priority B > F > W under that limit.
struct ZeroBubbleH1 {
  static constexpr std::string_view name = "zb-h1";
  static constexpr PolicyId id = PolicyId::zb_h1;
  static constexpr bool split_backward = true;
  static constexpr UpdateRule update = UpdateRule::flush;
  static constexpr int chunks = 1;
  static constexpr int default_batches = 1;
};

/// ZB-H2 from Qi et al. (ICLR 2024): as ZB-H1 but stage s may hold min(2(p-s)-1, m) microbatches
/// (up to 2p-1 on stage 0), so warm-up forwards fill the wait for the first B and deferred W's fill
/// the drain. Without the paper's optimizer post-validation, the stage-to-stage ramp ((p-1)*F on
/// the last stage) remains, so the bubble is near zero, not zero.
struct ZeroBubbleH2 : ZeroBubbleH1 {
  static constexpr std::string_view name = "zb-h2";
  static constexpr PolicyId id = PolicyId::zb_h2;
};

// Every reason a policy rejects a configuration, with the sentence a user sees. One list feeds the
// run-time errors and the compile-time static_asserts of StaticSchedule.
#define CUPIPE_SCHEDULE_REJECTIONS(X)                                                                        \
  X(stages_below_one, "a pipeline needs at least 1 stage")                                                  \
  X(microbatches_below_one, "a pipeline needs at least 1 microbatch")                                       \
  X(batches_below_one, "a schedule needs at least 1 batch")                                                 \
  X(one_chunk_policy, "this policy runs one chunk per stage, so chunks must be 1 (Interleaved<V> runs several)") \
  X(interleaved_needs_two_chunks, "Interleaved<V> needs at least 2 chunks per stage; with 1 chunk use OneFOneB") \
  X(chunks_differ_from_policy, "the configuration's chunks must equal the V of Interleaved<V>")             \
  X(interleaved_microbatches,                                                                               \
    "Interleaved<V> needs microbatches to be a multiple of stages, or fewer than 2 x stages (one "            \
    "depth-first group): a leftover group of another size deadlocks once sends block")                     \
  X(flush_policy_one_batch,                                                                                 \
    "a flush policy schedules one batch per plan, so batches must be 1 (only PipeDream and PipeDream2BW "     \
    "run several batches without a flush)")                                                                 \
  X(two_bw_needs_microbatches,                                                                              \
    "PipeDream2BW needs microbatches >= stages - 1 when batches > 1: batch t enters stage 0 on weight "      \
    "version t-1, which exists only once batch t-2 has drained from that stage")

enum class Rejection : std::uint8_t {
  none,
#define CUPIPE_SCHEDULE_X(name, text) name,
  CUPIPE_SCHEDULE_REJECTIONS(CUPIPE_SCHEDULE_X)
#undef CUPIPE_SCHEDULE_X
};

constexpr std::string_view explain(Rejection why) {
  switch (why) {
    case Rejection::none: return "";
#define CUPIPE_SCHEDULE_X(name, text) \
  case Rejection::name: return text;
      CUPIPE_SCHEDULE_REJECTIONS(CUPIPE_SCHEDULE_X)
#undef CUPIPE_SCHEDULE_X
  }
  return "unknown rejection";
}

struct PolicyInfo {
  PolicyId id;
  std::string_view name;
  bool split_backward;
  UpdateRule update;
  int default_chunks;
  int default_batches;
};

template <class Policy>
constexpr PolicyInfo info_of() {
  return {Policy::id, Policy::name, Policy::split_backward, Policy::update, Policy::chunks, Policy::default_batches};
}

/// Every policy, in the order the explorer lists them. Interleaved is listed with V = 2.
inline constexpr std::array<PolicyInfo, 7> all_policies{
    info_of<GPipe>(),     info_of<OneFOneB>(),     info_of<Interleaved<2>>(),    info_of<PipeDream>(),
    info_of<PipeDream2BW>(), info_of<ZeroBubbleH1>(), info_of<ZeroBubbleH2>()};

constexpr const PolicyInfo& info(PolicyId id) {
  for (const PolicyInfo& policy : all_policies)
    if (policy.id == id) return policy;
  return all_policies.front();  // unreachable for valid ids
}

/// Why a policy rejects a configuration, or Rejection::none.
constexpr Rejection rejection(PolicyId id, const Config& c) {
  if (c.stages < 1) return Rejection::stages_below_one;
  if (c.microbatches < 1) return Rejection::microbatches_below_one;
  if (c.batches < 1) return Rejection::batches_below_one;
  const PolicyInfo& policy = info(id);
  if (id == PolicyId::interleaved) {
    if (c.chunks < 2) return Rejection::interleaved_needs_two_chunks;
    if (c.microbatches % c.stages != 0 && c.microbatches >= 2 * c.stages) return Rejection::interleaved_microbatches;
  } else if (c.chunks != 1) {
    return Rejection::one_chunk_policy;
  }
  if (policy.update == UpdateRule::flush && c.batches != 1) return Rejection::flush_policy_one_batch;
  if (id == PolicyId::pipedream_2bw && c.batches > 1 && c.microbatches < c.stages - 1)
    return Rejection::two_bw_needs_microbatches;
  return Rejection::none;
}

template <class Policy>
constexpr Rejection rejection(const Config& c) {
  if (Policy::id == PolicyId::interleaved && c.chunks != Policy::chunks) return Rejection::chunks_differ_from_policy;
  return rejection(Policy::id, c);
}

namespace detail {

[[noreturn]] inline void throw_rejection(PolicyId id, const Config& c, Rejection why) {
  CUPIPE_THROW(explain(why), " (policy ", info(id).name, ", stages ", c.stages, ", microbatches ", c.microbatches,
               ", chunks ", c.chunks, ", batches ", c.batches, ")");
}

constexpr Plan empty_plan(PolicyId id, const Config& c) {
  return Plan{c, std::vector<std::vector<Action>>(static_cast<std::size_t>(c.stages)), info(id).split_backward,
              info(id).update};
}

constexpr Plan gpipe_plan(const Config& c) {
  Plan plan = empty_plan(PolicyId::gpipe, c);
  for (auto& list : plan.actions) {
    for (int j = 0; j < c.microbatches; ++j) list.push_back({ActionKind::F, j, 0});
    for (int j = 0; j < c.microbatches; ++j) list.push_back({ActionKind::B, j, 0});
  }
  return plan;
}

/// F and B of microbatches 0..n-1 in 1F1B order: `warmup` forwards, alternation, then the drain.
constexpr std::vector<Action> one_f_one_b_order(int n, int warmup) {
  std::vector<Action> list;
  for (int j = 0; j < warmup; ++j) list.push_back({ActionKind::F, j, 0});
  for (int j = 0; j + warmup < n; ++j) {
    list.push_back({ActionKind::F, j + warmup, 0});
    list.push_back({ActionKind::B, j, 0});
  }
  for (int j = n - warmup; j < n; ++j) list.push_back({ActionKind::B, j, 0});
  return list;
}

/// 1F1B over all of the config's microbatches; PipeDream and 2BW run it across batches unflushed.
constexpr Plan one_f_one_b_plan(PolicyId id, const Config& c) {
  Plan plan = empty_plan(id, c);
  const int n = c.total_microbatches();
  for (int s = 0; s < c.stages; ++s)
    plan.actions[static_cast<std::size_t>(s)] = one_f_one_b_order(n, std::min(c.stages - s - 1, n));
  return plan;
}

/// Sizes of the depth-first microbatch groups: groups of p, or one group of all m when m < 2p.
constexpr std::vector<int> interleaved_groups(const Config& c) {
  if (c.microbatches < 2 * c.stages) return {c.microbatches};
  return std::vector<int>(static_cast<std::size_t>(c.microbatches / c.stages), c.stages);
}

/// Megatron-LM's order: each group of microbatches runs through chunk 0, 1, ... (forwards) or chunk
/// V-1, V-2, ... (backwards) before the next group starts.
constexpr std::vector<Action> interleaved_order(const Config& c, ActionKind kind) {
  std::vector<Action> order;
  int first = 0;
  for (const int size : interleaved_groups(c)) {
    for (int i = 0; i < c.chunks; ++i) {
      const int chunk = kind == ActionKind::F ? i : c.chunks - 1 - i;
      for (int j = first; j < first + size; ++j) order.push_back({kind, j, chunk});
    }
    first += size;
  }
  return order;
}

constexpr Plan interleaved_plan(const Config& c) {
  Plan plan = empty_plan(PolicyId::interleaved, c);
  const std::vector<Action> forwards = interleaved_order(c, ActionKind::F);
  const std::vector<Action> backwards = interleaved_order(c, ActionKind::B);
  const int total = c.microbatches * c.chunks;
  const int group = interleaved_groups(c).front();
  for (int s = 0; s < c.stages; ++s) {
    auto& list = plan.actions[static_cast<std::size_t>(s)];
    const int warmup = std::min(2 * (c.stages - s - 1) + (c.chunks - 1) * group, total);
    for (int k = 0; k < warmup; ++k) list.push_back(forwards[static_cast<std::size_t>(k)]);
    for (int k = 0; k + warmup < total; ++k) {
      list.push_back(forwards[static_cast<std::size_t>(k + warmup)]);
      list.push_back(backwards[static_cast<std::size_t>(k)]);
    }
    for (int k = total - warmup; k < total; ++k) list.push_back(backwards[static_cast<std::size_t>(k)]);
  }
  return plan;
}

/// Zero-bubble orders. F and B follow a 1F1B order with `warmup(s)` leading forwards; a list
/// scheduler on unit costs (F = B = W = 1, no transfer time) then places the W's: a free stage runs
/// its next F or B when the input has arrived (and, for F, when it holds fewer than `cap`
/// microbatches between F and W), otherwise its oldest pending W.
constexpr Plan zero_bubble_plan(PolicyId id, const Config& c) {
  Plan plan = empty_plan(id, c);
  const int p = c.stages;
  const int m = c.microbatches;
  const bool h1 = id == PolicyId::zb_h1;
  const int cap = std::min(h1 ? p : 2 * p - 1, m);
  constexpr int never = 1 << 30;
  std::vector<int> forward_end(static_cast<std::size_t>(p * m), never);
  std::vector<int> backward_end(static_cast<std::size_t>(p * m), never);
  auto at = [m](int s, int j) { return static_cast<std::size_t>(s * m + j); };
  std::vector<std::vector<Action>> order(static_cast<std::size_t>(p));
  for (int s = 0; s < p; ++s)
    order[static_cast<std::size_t>(s)] = one_f_one_b_order(m, std::min(h1 ? p - s - 1 : 2 * (p - s - 1), m));
  std::vector<int> next(static_cast<std::size_t>(p), 0), forwards(static_cast<std::size_t>(p), 0),
      backwards(static_cast<std::size_t>(p), 0), weights(static_cast<std::size_t>(p), 0);
  int finished = 0;
  const int horizon = 4 * (m + p) + 8;  // far beyond any unit-cost makespan; a guard, never hit
  for (int t = 0; finished < p && t < horizon; ++t) {
    for (int s = 0; s < p; ++s) {
      const auto us = static_cast<std::size_t>(s);
      auto& list = plan.actions[us];
      if (weights[us] == m) continue;
      if (static_cast<int>(list.size()) > t) continue;  // busy: one entry per time step, idle ones padded
      bool ready = false;
      if (next[us] < 2 * m) {
        const Action& a = order[us][static_cast<std::size_t>(next[us])];
        if (a.kind == ActionKind::F)
          ready = forwards[us] - weights[us] < cap && (s == 0 || forward_end[at(s - 1, a.microbatch)] <= t);
        else
          ready = s == p - 1 ? forward_end[at(s, a.microbatch)] <= t : backward_end[at(s + 1, a.microbatch)] <= t;
        if (ready) {
          list.push_back(a);
          (a.kind == ActionKind::F ? forward_end : backward_end)[at(s, a.microbatch)] = t + 1;
          ++(a.kind == ActionKind::F ? forwards : backwards)[us];
          ++next[us];
        }
      }
      if (ready) continue;
      if (weights[us] < backwards[us]) {
        list.push_back({ActionKind::W, weights[us], 0});
        if (++weights[us] == m) ++finished;
      } else {
        list.push_back({ActionKind::W, -1, -1});
      }
    }
  }
  for (auto& list : plan.actions) std::erase_if(list, [](const Action& a) { return a.microbatch < 0; });
  return plan;
}

}  // namespace detail

/// The plan of a run-time chosen policy. Throws cupipe::error with the reason when the policy
/// rejects the configuration (a compile error in constant evaluation).
constexpr Plan generate(PolicyId id, const Config& c) {
  if (const Rejection why = rejection(id, c); why != Rejection::none) detail::throw_rejection(id, c, why);
  switch (id) {
    case PolicyId::gpipe: return detail::gpipe_plan(c);
    case PolicyId::interleaved: return detail::interleaved_plan(c);
    case PolicyId::zb_h1:
    case PolicyId::zb_h2: return detail::zero_bubble_plan(id, c);
    case PolicyId::one_f_one_b:
    case PolicyId::pipedream:
    case PolicyId::pipedream_2bw: return detail::one_f_one_b_plan(id, c);
  }
  return detail::empty_plan(id, c);
}

/// The plan of a policy tag type: `generate<OneFOneB>({.stages = 4, .microbatches = 8})`.
template <class Policy>
constexpr Plan generate(const Config& c) {
  if (const Rejection why = rejection<Policy>(c); why != Rejection::none) detail::throw_rejection(Policy::id, c, why);
  return generate(Policy::id, c);
}

/// Parses "gpipe", "1f1b", "interleaved", "pipedream", "2bw", "zb-h1" or "zb-h2".
inline PolicyId parse_policy(std::string_view name) {
  for (const PolicyInfo& policy : all_policies)
    if (policy.name == name) return policy.id;
  std::string valid;
  for (const PolicyInfo& policy : all_policies) valid += (valid.empty() ? "" : ", ") + std::string(policy.name);
  CUPIPE_THROW("unknown schedule '", name, "'; expected one of: ", valid);
}

constexpr std::string_view policy_name(PolicyId id) { return info(id).name; }

/// A configuration checked at compile time: an invalid one fails with the policy's sentence.
///   using S = StaticSchedule<Interleaved<2>, 4, 8>;  static_assert(verify(S::plan()));
template <class Policy, int Stages, int Microbatches, int Chunks = Policy::chunks,
          int Batches = Policy::default_batches>
struct StaticSchedule {
  static constexpr Config config{Stages, Microbatches, Chunks, Batches};
  static constexpr Rejection why = rejection<Policy>(config);
#define CUPIPE_SCHEDULE_X(name, text) static_assert(why != Rejection::name, text);
  CUPIPE_SCHEDULE_REJECTIONS(CUPIPE_SCHEDULE_X)
#undef CUPIPE_SCHEDULE_X
  static constexpr Plan plan() { return generate<Policy>(config); }
};

}  // namespace cupipe::schedule
