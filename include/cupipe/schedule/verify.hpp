// SPDX-License-Identifier: Apache-2.0
// verify: proves, in constant evaluation or at run time, that a plan does every action exactly once,
// in an order that respects the data dependencies, without deadlock when sends block.
#pragma once

#include <algorithm>
#include <array>
#include <string_view>
#include <vector>

#include "cupipe/schedule/action.hpp"
#include "cupipe/schedule/policy.hpp"
#include "cupipe/schedule/weights.hpp"

namespace cupipe::schedule {

/// A literal type, so `static_assert(verify<OneFOneB>(3, 8));` works. The message names the stage,
/// the action(s) and the reason on failure.
struct VerifyResult {
  bool ok = true;
  std::array<char, 320> text{};
  int length = 0;

  constexpr explicit operator bool() const { return ok; }
  constexpr std::string_view message() const { return {text.data(), static_cast<std::size_t>(length)}; }
};

namespace detail {

/// Builds a failed VerifyResult: `fail() << "worker " << s << ": " << name(a) << " ..."`.
struct Failure {
  VerifyResult result{false, {}, 0};

  constexpr Failure& operator<<(std::string_view s) {
    for (char ch : s)
      if (result.length + 1 < static_cast<int>(result.text.size())) result.text[static_cast<std::size_t>(result.length++)] = ch;
    return *this;
  }
  constexpr Failure& operator<<(int value) {
    if (value < 0) {
      *this << "-";
      value = -value;
    }
    std::array<char, 12> digits{};
    int count = 0;
    do {
      digits[static_cast<std::size_t>(count++)] = static_cast<char>('0' + value % 10);
      value /= 10;
    } while (value > 0);
    while (count > 0) *this << std::string_view(&digits[static_cast<std::size_t>(--count)], 1);
    return *this;
  }
  constexpr operator VerifyResult() const { return result; }  // NOLINT: lets `return fail() << ...;`
};

/// "F3", or "F3 (chunk 1)" when stages hold several chunks.
struct Named {
  Action action;
  int chunks;
};
constexpr Failure& operator<<(Failure& out, const Named& n) {
  const char letter = kind_letter(n.action.kind);
  out << std::string_view(&letter, 1) << n.action.microbatch;
  if (n.chunks > 1) out << " (chunk " << n.action.chunk << ")";
  return out;
}

/// The other end of an action's cross-action data: the producer of its input, or the consumer of its
/// output; `exists` is false for the first F, the last stage's B input, and W.
struct Dependency {
  bool exists = false;
  int stage = -1;  // where the peer runs
  Action peer{ActionKind::F, -1, -1};  // the producer of an input, or the consumer of an output
};

/// The worker and local action of virtual stage k's `kind` for `microbatch`.
constexpr Dependency at_virtual_stage(const Plan& plan, int k, ActionKind kind, int microbatch) {
  return {true, plan.placement.worker_of(k), {kind, microbatch, plan.placement.chunk_of(k)}};
}

constexpr Dependency input_of(const Plan& plan, int stage, const Action& a) {
  const int k = plan.virtual_stage(stage, a);
  const int last = plan.config.virtual_stages() - 1;
  if (a.kind == ActionKind::F && k > 0) return at_virtual_stage(plan, k - 1, ActionKind::F, a.microbatch);
  if (a.kind == ActionKind::B && k < last) return at_virtual_stage(plan, k + 1, ActionKind::B, a.microbatch);
  return {};
}

/// Where an action's output goes: F feeds virtual stage k+1, B feeds k-1.
constexpr Dependency output_of(const Plan& plan, int stage, const Action& a) {
  const int k = plan.virtual_stage(stage, a);
  if (a.kind == ActionKind::F && k < plan.config.virtual_stages() - 1)
    return at_virtual_stage(plan, k + 1, ActionKind::F, a.microbatch);
  if (a.kind == ActionKind::B && k > 0) return at_virtual_stage(plan, k - 1, ActionKind::B, a.microbatch);
  return {};
}

constexpr int slot_of(const Plan& plan, int stage, const Action& a) {
  return action_slot(plan.config, a.kind, plan.virtual_stage(stage, a), a.microbatch);
}

/// Why workers stopped short of the end of their lists (`pc[w]`: the next action; `sending[w]`: it
/// ran and waits to hand its output over): the first stuck worker, a blocked sender first. Empty
/// (verified) when every worker finished.
constexpr VerifyResult explain_stuck(const Plan& plan, const std::vector<int>& pc, const std::vector<char>& sending) {
  const Config& c = plan.config;
  const int p = c.stages;
  for (int pass = 0; pass < 2; ++pass) {
    for (int s = 0; s < p; ++s) {
      const auto us = static_cast<std::size_t>(s);
      const auto& list = plan.actions[us];
      if (pc[us] >= static_cast<int>(list.size())) continue;
      const Action& a = list[static_cast<std::size_t>(pc[us])];
      if (sending[us] && pass == 0) {
        const Dependency out = output_of(plan, s, a);
        const auto r = static_cast<std::size_t>(out.stage);
        Failure fail;
        fail << "deadlock with blocking (rendezvous) sends: worker " << s << " blocks sending the output of "
             << Named{a, c.chunks} << " to worker " << out.stage << ", which ";
        if (pc[r] >= static_cast<int>(plan.actions[r].size())) return fail << "has finished";
        return fail << "is blocked at " << Named{plan.actions[r][static_cast<std::size_t>(pc[r])], c.chunks}
                    << (sending[r] ? " (sending its output)" : " (waiting for its input)");
      }
      if (!sending[us] && pass == 1) {
        const Dependency in = input_of(plan, s, a);
        const auto r = static_cast<std::size_t>(in.stage);
        Failure fail;
        fail << "dependency violated: worker " << s << " cannot run " << Named{a, c.chunks} << " because it needs "
             << Named{in.peer, c.chunks} << " of worker " << in.stage;
        if (in.stage == s) return fail << ", which comes later on the same worker";
        return fail << ", which is stuck behind "
                    << Named{plan.actions[r][static_cast<std::size_t>(pc[r])], c.chunks} << " (a dependency cycle)";
      }
    }
  }
  return VerifyResult{};
}

/// Runs every worker's list as a program. With `rendezvous`, a send completes only once its
/// receiver has posted the matching receive; a worker keeps one receive posted per incoming channel
/// (sender worker, forward or backward), for the next message it will consume from that channel
/// (the next plan.channel_depth messages for a plan that declares a deeper channel), as
/// Megatron-LM's combined send/recv calls do with one neighbour per direction and as cupipe's NCCL
/// transport does with one communicator per directed channel. Without it, sends are buffered and
/// only true dependency cycles block.
constexpr VerifyResult run_workers(const Plan& plan, bool rendezvous) {
  const Config& c = plan.config;
  const int p = c.stages;
  std::vector<char> done(static_cast<std::size_t>(action_slots(c)), 0);
  std::vector<char> delivered(static_cast<std::size_t>(action_slots(c)), 0);  // indexed by producer slot
  std::vector<int> pc(static_cast<std::size_t>(p), 0);
  std::vector<char> sending(static_cast<std::size_t>(p), 0);
  // Per incoming channel (receiver, kind, sender), the producer slots of its messages in the order
  // the receiver consumes them, and how many it has consumed.
  const auto channel = [p](int receiver, ActionKind kind, int sender) {
    return static_cast<std::size_t>((receiver * 2 + (kind == ActionKind::F ? 0 : 1)) * p + sender);
  };
  std::vector<std::vector<int>> inputs(static_cast<std::size_t>(2 * p * p));
  std::vector<int> consumed(static_cast<std::size_t>(2 * p * p), 0);
  for (int s = 0; s < p; ++s) {
    for (const Action& a : plan.actions[static_cast<std::size_t>(s)]) {
      const Dependency in = input_of(plan, s, a);
      if (!in.exists || in.stage == s) continue;
      inputs[channel(s, a.kind, in.stage)].push_back(slot_of(plan, in.stage, in.peer));
    }
  }
  // The receiver has receives posted for the next channel_depth messages of the channel.
  auto posted = [&](int receiver, ActionKind kind, int sender, int message) {
    const std::size_t ch = channel(receiver, kind, sender);
    const auto& queue = inputs[ch];
    const int end = std::min(consumed[ch] + std::max(plan.channel_depth, 1), static_cast<int>(queue.size()));
    for (int i = consumed[ch]; i < end; ++i)
      if (queue[static_cast<std::size_t>(i)] == message) return true;
    return false;
  };
  for (bool progress = true; progress;) {
    progress = false;
    for (int s = 0; s < p; ++s) {
      const auto us = static_cast<std::size_t>(s);
      const auto& list = plan.actions[us];
      while (pc[us] < static_cast<int>(list.size())) {
        const Action& a = list[static_cast<std::size_t>(pc[us])];
        if (!sending[us]) {
          const auto arrived = [&](const Action& x) {
            const Dependency in = input_of(plan, s, x);
            if (!in.exists) return true;
            const auto producer = static_cast<std::size_t>(slot_of(plan, in.stage, in.peer));
            return in.stage == s ? done[producer] != 0 : delivered[producer] != 0;
          };
          if (!arrived(a)) break;
          // An overlapped F starts with its B, once the B's input is there too.
          if (a.overlap && !arrived(list[static_cast<std::size_t>(pc[us]) + 1])) break;
          if (const Dependency in = input_of(plan, s, a); in.exists && in.stage != s) ++consumed[channel(s, a.kind, in.stage)];
          done[static_cast<std::size_t>(slot_of(plan, s, a))] = 1;
          const Dependency out = output_of(plan, s, a);
          sending[us] = out.exists && out.stage != s;
          if (!sending[us]) ++pc[us];
          progress = true;
          continue;
        }
        const Dependency out = output_of(plan, s, a);
        const int message = slot_of(plan, s, a);
        if (rendezvous && !posted(out.stage, a.kind, s, message)) break;
        delivered[static_cast<std::size_t>(message)] = 1;
        sending[us] = 0;
        ++pc[us];
        progress = true;
      }
    }
  }
  return explain_stuck(plan, pc, sending);
}

}  // namespace detail

/// Checks an arbitrary plan: each (stage, chunk, microbatch) F and B (and W when split) appears
/// exactly once; F precedes B precedes W; data dependencies across (virtual) stages can be met;
/// no deadlock when sends block until the receive is posted; async weight versions exist in time.
constexpr VerifyResult verify(const Plan& plan) {
  using detail::Failure;
  using detail::Named;
  const Config& c = plan.config;
  if (c.stages < 1 || c.microbatches < 1 || c.chunks < 1 || c.batches < 1)
    return Failure{} << "the configuration needs stages, microbatches, chunks and batches of at least 1";
  if (static_cast<int>(plan.actions.size()) != c.stages)
    return Failure{} << "the plan has action lists for " << static_cast<int>(plan.actions.size()) << " stages, expected "
                     << c.stages;
  if (const Placement& pl = plan.placement; pl.workers != c.stages || pl.chunks != c.chunks ||
                                              static_cast<int>(pl.worker.size()) != c.virtual_stages())
    return Failure{} << "the plan's placement covers " << pl.workers << " workers x " << pl.chunks
                     << " chunks, but the configuration has " << c.stages << " stages x " << c.chunks << " chunks";
  const int n = c.total_microbatches();
  std::vector<int> position(static_cast<std::size_t>(detail::action_slots(c)), -1);
  for (int s = 0; s < c.stages; ++s) {
    const auto& list = plan.actions[static_cast<std::size_t>(s)];
    for (int i = 0; i < static_cast<int>(list.size()); ++i) {
      const Action& a = list[static_cast<std::size_t>(i)];
      if (a.microbatch < 0 || a.microbatch >= n || a.chunk < 0 || a.chunk >= c.chunks)
        return Failure{} << "worker " << s << ": action " << i << " names microbatch " << a.microbatch << " chunk "
                         << a.chunk << ", outside " << n << " microbatches and " << c.chunks << " chunks";
      if (a.kind == ActionKind::W && !plan.split_backward)
        return Failure{} << "worker " << s << ": " << Named{a, c.chunks} << " in a plan whose backward is not split";
      if (a.overlap && (a.kind != ActionKind::F || i + 1 == static_cast<int>(list.size()) ||
                        list[static_cast<std::size_t>(i) + 1].kind != ActionKind::B))
        return Failure{} << "worker " << s << ": " << Named{a, c.chunks}
                         << " is marked to overlap with the next action, but only an F followed by a B can overlap";
      int& at = position[static_cast<std::size_t>(detail::slot_of(plan, s, a))];
      if (at >= 0)
        return Failure{} << "worker " << s << ": " << Named{a, c.chunks} << " appears twice (positions " << at << " and "
                         << i << ")";
      at = i;
    }
  }
  const int kinds = plan.split_backward ? 3 : 2;
  for (int s = 0; s < c.stages; ++s) {
    for (int chunk = 0; chunk < c.chunks; ++chunk) {
      for (int j = 0; j < n; ++j) {
        int previous = -1;
        for (int k = 0; k < kinds; ++k) {
          const Action a{static_cast<ActionKind>(k), j, chunk};
          const int at = position[static_cast<std::size_t>(detail::slot_of(plan, s, a))];
          if (at < 0) return Failure{} << "worker " << s << ": " << Named{a, c.chunks} << " is missing";
          if (at < previous)
            return Failure{} << "worker " << s << ": " << Named{a, c.chunks} << " comes before "
                             << Named{Action{static_cast<ActionKind>(k - 1), j, chunk}, c.chunks}
                             << ", but F must precede B and B must precede W";
          previous = at;
        }
      }
    }
  }
  if (VerifyResult flow = detail::run_workers(plan, false); !flow) return flow;
  if (VerifyResult sends = detail::run_workers(plan, true); !sends) return sends;
  if (const WeightVersionAnalysis w = analyze_weight_versions(plan); !w.feasible)
    return Failure{} << "worker " << w.stage << ": " << Named{w.action, c.chunks} << " needs weight version " << w.needed
                     << ", but the stage has applied only " << w.applied << " updates by then";
  return VerifyResult{};
}

/// Generates and verifies a policy's plan; a configuration the policy rejects fails with its reason.
template <SchedulePolicy Policy>
constexpr VerifyResult verify(int stages, int microbatches, int chunks = Policy::chunks,
                              int batches = Policy::default_batches) {
  const Config config{stages, microbatches, chunks, batches};
  if (const std::string_view why = check<Policy>(config); !why.empty()) return detail::Failure{} << why;
  return verify(generate<Policy>(config));
}

}  // namespace cupipe::schedule
