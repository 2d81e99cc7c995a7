// SPDX-License-Identifier: Apache-2.0
// The planner's activation memory: what each virtual stage receives, sends and keeps per row, and
// each worker's peak replayed in a plan's simulated time (activation_peaks) or bounded over every
// timing the plan allows (activation_bounds), from the runtime's allocation pattern: the in-process
// transport's, or across processes the communicator's (Landing).
#pragma once

#include <algorithm>
#include <array>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <limits>
#include <sstream>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "cupipe/core/error.hpp"
#include "cupipe/core/memory.hpp"
#include "cupipe/core/shape.hpp"
#include "cupipe/schedule/offload.hpp"
#include "cupipe/schedule/registry.hpp"
#include "cupipe/schedule/simulate.hpp"

#include "cupipe/planner/cost_model.hpp"

namespace cupipe::planner {

namespace detail {

/// Values per row of one virtual stage: what its forward receives (0 for the first: the staged
/// batch), sends, keeps (every layer's output and saved values) and the backward's per-layer output
/// gradients.
struct ChunkSizes {
  double in = 0, out = 0, record = 0, grad_record = 0;
};

inline std::vector<ChunkSizes> chunk_sizes(const CostModel& model, const std::vector<std::size_t>& cuts) {
  std::vector<ChunkSizes> sizes(cuts.size() - 1);
  for (std::size_t k = 0; k + 1 < cuts.size(); ++k) {
    const std::size_t first = cuts[k], last = cuts[k + 1];
    ChunkSizes& c = sizes[k];
    c.in = k == 0 ? 0.0 : model.layers[first].in;
    c.out = model.layers[last - 1].out;
    for (std::size_t l = first; l < last; ++l) {
      c.record += model.layers[l].out + model.layers[l].saved;
      if (l + 1 < last) c.grad_record += model.layers[l].out;
    }
  }
  return sizes;
}

/// The ChunkSizes of a compiled StageList's virtual stages, read from the stages (the values per row
/// StageExecutor allocates: the input message, none on the first; the output; the record; the grad
/// record), where chunk_sizes derives them from a cost model.
template <class Stages>
std::vector<ChunkSizes> stage_chunk_sizes() {
  std::vector<ChunkSizes> sizes;
  [&]<std::size_t... K>(std::index_sequence<K...>) {
    ((sizes.push_back({K == 0 ? 0.0 : double(Stages::template stage<int(K)>::in_features),
                       double(Stages::template stage<int(K)>::out_features),
                       double(Stages::template stage<int(K)>::record_elements(1)),
                       double(Stages::template stage<int(K)>::grad_record_elements(1))})),
     ...);
  }(std::make_index_sequence<Stages::size>());
  return sizes;
}

/// When a message to another worker takes memory on its receiver: as it is sent (LocalTransport,
/// the workers of one process: the sender allocates it in the receiver's memory), or as the action
/// that takes it starts (CommTransport, a worker per process: the receiver allocates it then, and the
/// message waits in the communicator's buffers, outside the backend's memory, until then).
enum class Landing { at_send, at_receive };

/// What one action of worker `w` does to the activation values (times rows) StageExecutor and the
/// in-process transport allocate (see activation_peaks): allocated at its start, freed at its end,
/// and the message it sends, placed on worker `to` (-1: none).
struct ActionValues {
  double allocate = 0, free = 0, message = 0;
  int to = -1;
};

inline ActionValues action_values(const schedule::Plan& plan, const std::vector<ChunkSizes>& sizes,
                                  const std::vector<double>& rows, int w, const schedule::Action& a) {
  const int last = plan.config.virtual_stages() - 1;
  const int k = plan.virtual_stage(w, a);
  const ChunkSizes& c = sizes[std::size_t(k)];
  const double r = rows[std::size_t(a.microbatch)];
  ActionValues v;
  switch (a.kind) {
    case schedule::ActionKind::F:
      v.allocate = r * c.record;
      if (k < last) v = {v.allocate, 0, r * c.out, plan.placement.worker_of(k + 1)};
      break;
    case schedule::ActionKind::B:
      v.allocate = r * (c.grad_record + c.in + (k == last ? c.out : 0.0));
      v.free = r * c.in;  // dx
      if (k > 0) {
        v.message = r * sizes[std::size_t(k - 1)].out;
        v.to = plan.placement.worker_of(k - 1);
      }
      break;
    case schedule::ActionKind::W: break;
  }
  // What the microbatch holds on this stage from its F to its finish: input message, record, dy
  // and grad record.
  if (a.kind == schedule::ActionKind::W || (a.kind == schedule::ActionKind::B && !plan.split_backward))
    v.free += r * (c.in + c.record + c.out + c.grad_record);
  return v;
}

/// What an offload plan (schedule::plan_offload) adds to action i of worker w (values times rows):
/// the record its B brings back, allocated at its start, and the records that leave for host memory
/// after it, freed at its end (StageExecutor::bring_back, send_out). Zero without a plan.
struct OffloadValues {
  double back = 0, out = 0;
};

inline OffloadValues offload_values(const schedule::Plan& plan, const schedule::OffloadPlan* offload,
                                    const std::vector<ChunkSizes>& sizes, const std::vector<double>& rows, int w, std::size_t i) {
  OffloadValues v;
  if (offload == nullptr || offload->empty()) return v;
  const schedule::Action& a = plan.actions[std::size_t(w)][i];
  if (offload->back_before[std::size_t(w)][i])
    v.back = rows[std::size_t(a.microbatch)] * sizes[std::size_t(plan.virtual_stage(w, a))].record;
  for (const schedule::OffloadMove& move : offload->out_after[std::size_t(w)][i])
    v.out += rows[std::size_t(move.microbatch)] * sizes[std::size_t(move.virtual_stage)].record;
  return v;
}

/// Each worker's least and most activation peak (values times rows) over every timing the plan
/// allows: what activation_peaks replays at the simulated times, bounded without any times at all.
/// A worker's own allocations and frees happen in its program order; only where its neighbours'
/// messages land among them depends on timing. A message can land no earlier than just after the
/// last action of the receiver that happens before its send (vector clocks over the plan's program
/// order and its messages: that action's send is on the chain, its frees need not be), and no later
/// than just before the first receiver action that its send happens before (at the latest the one
/// that takes it). An earlier landing only adds to the receiver's values at every later point, so
/// landing every message at its earliest gives the most (`high`) and at its latest the least
/// (`low`); a measured peak outside [low, high] means the replay's accounting, not the timing, is
/// wrong. A message to the sender's own worker (one worker, several chunks) lands as the send ends.
/// With Landing::at_receive (a worker per process) a message to another worker lands as the action
/// that takes it starts, whatever the timing: its earliest and latest are the same. The model is one
/// step without PipelineOptions::recompute (which frees a forward's record and allocates it again in
/// the backward); overlapped steps (post-validation) are outside it. Mailbox capacity only removes
/// timings, so it is left out.
struct ActivationBounds {
  std::vector<double> low, high;  ///< per worker
};

/// The plan's actions as the nodes of one graph: node n is action i of worker w, numbered worker
/// by worker (first[w] + i), with the nodes whose messages each takes at its start.
struct ActionGraph {
  std::vector<std::size_t> first;                    ///< per worker, then the node count
  std::vector<std::array<std::ptrdiff_t, 2>> takes;  ///< per node; -1: none
};

inline ActionGraph action_graph(const schedule::Plan& plan) {
  const int last = plan.config.virtual_stages() - 1;
  const std::size_t W = std::size_t(plan.config.stages);
  ActionGraph graph;
  std::vector<std::size_t>& first = graph.first;
  first.assign(W + 1, 0);
  for (std::size_t w = 0; w < W; ++w) first[w + 1] = first[w] + plan.actions[w].size();
  const std::size_t nodes = first[W];
  int microbatches = 0;
  for (const auto& actions : plan.actions)
    for (const schedule::Action& a : actions) microbatches = std::max(microbatches, a.microbatch + 1);
  // Which node runs F and B of (virtual stage, microbatch); -1 where the plan has none.
  const std::size_t per_kind = std::size_t(last + 1) * std::size_t(microbatches);
  std::vector<std::ptrdiff_t> node_of(2 * per_kind, -1);
  const auto slot = [&](schedule::ActionKind kind, int k, int j) {
    return (kind == schedule::ActionKind::F ? 0 : per_kind) + std::size_t(k) * std::size_t(microbatches) + std::size_t(j);
  };
  for (std::size_t w = 0; w < W; ++w)
    for (std::size_t i = 0; i < plan.actions[w].size(); ++i) {
      const schedule::Action& a = plan.actions[w][i];
      if (a.kind != schedule::ActionKind::W) node_of[slot(a.kind, plan.virtual_stage(int(w), a), a.microbatch)] = std::ptrdiff_t(first[w] + i);
    }
  // The node whose message `n` takes at its start (-1: none): F of k takes F of k-1's output, B of k
  // takes B of k+1's input gradient. An overlapped F takes its partner B's gradient as well
  // (StageExecutor::take_partner_input), so the pair's second input counts at the F.
  const auto sender = [&](std::size_t w, std::size_t i) -> std::ptrdiff_t {
    const schedule::Action& a = plan.actions[w][i];
    const int k = plan.virtual_stage(int(w), a);
    if (a.kind == schedule::ActionKind::F && k > 0) return node_of[slot(a.kind, k - 1, a.microbatch)];
    if (a.kind == schedule::ActionKind::B && k < last) return node_of[slot(a.kind, k + 1, a.microbatch)];
    return -1;
  };
  std::vector<std::array<std::ptrdiff_t, 2>>& takes = graph.takes;
  takes.assign(nodes, {-1, -1});
  for (std::size_t w = 0; w < W; ++w)
    for (std::size_t i = 0; i < plan.actions[w].size(); ++i) {
      takes[first[w] + i][0] = sender(w, i);
      const auto& list = plan.actions[w];
      if (list[i].overlap && list[i].kind == schedule::ActionKind::F && i + 1 < list.size() &&
          list[i + 1].kind == schedule::ActionKind::B)
        takes[first[w] + i][1] = sender(w, i + 1);
    }
  return graph;
}

/// Per node, the node that takes its message at its start (the first in its worker's program order:
/// an overlapped F takes its partner B's input gradient); -1: none.
inline std::vector<std::ptrdiff_t> takers(const ActionGraph& graph) {
  std::vector<std::ptrdiff_t> taker(graph.takes.size(), -1);
  for (std::size_t n = graph.takes.size(); n-- > 0;)
    for (const std::ptrdiff_t sender : graph.takes[n])
      if (sender >= 0) taker[std::size_t(sender)] = std::ptrdiff_t(n);
  return taker;
}

/// The index, among worker `receiver`'s actions, of the action that takes the message of worker
/// w's action i.
inline std::size_t taken_at(const ActionGraph& graph, const std::vector<std::ptrdiff_t>& taker, std::size_t w, std::size_t i,
                            std::size_t receiver) {
  const std::ptrdiff_t n = taker[graph.first[w] + i];
  CUPIPE_REQUIRE(n >= 0 && std::size_t(n) >= graph.first[receiver] && std::size_t(n) < graph.first[receiver + 1],
                 "planner: no action of worker ", receiver, " takes the message of worker ", w, "'s action ", i);
  return std::size_t(n) - graph.first[receiver];
}

/// Each worker's peak activation values (times rows) when `plan` runs with `sim`'s timing: the
/// allocations of StageExecutor and the in-process transport replayed in simulated time.
///   F of virtual stage k: at its start the record (rows x record); at its end the output message
///     on the worker of k+1 (rows x out), unless k is the last.
///   B: at its start dy (the last stage's loss gradient, rows x out; others received it as a
///     message), the grad record and dx (rows x in, k > 0); at its end dx is sent (a message on the
///     worker of k-1) and freed; without a split backward the microbatch finishes: its input message,
///     record, dy and grad record are freed.
///   W: at its end the microbatch finishes as above.
/// At equal times messages come first (a message that lands as the receiver finishes an action may
/// land before its frees: the estimate takes the larger peak), then frees, then allocations at an
/// action's start.
/// `rows[j]` is microbatch j's rows. With `offload`, records also leave after their actions and come
/// back before their B (offload_values). Landing::at_receive: a message to another worker lands as
/// the action that takes it starts, with that action's allocations.
inline std::vector<double> activation_peaks(const schedule::Plan& plan, const schedule::SimResult& sim,
                                            const std::vector<ChunkSizes>& sizes, const std::vector<double>& rows,
                                            const schedule::OffloadPlan* offload = nullptr, Landing landing = Landing::at_send) {
  struct Event {
    double time;
    int order;  // 0 message, 1 free, 2 allocation at a start
    int worker;
    double values;
  };
  std::vector<Event> events;
  // Who takes each message, only where a message lands as it is taken (the search prices every
  // layout through here).
  const bool at_receive = landing == Landing::at_receive;
  const ActionGraph graph = at_receive ? action_graph(plan) : ActionGraph{};
  const std::vector<std::ptrdiff_t> taker = at_receive ? takers(graph) : std::vector<std::ptrdiff_t>{};
  for (int w = 0; w < plan.config.stages; ++w) {
    const auto& actions = plan.actions[std::size_t(w)];
    for (std::size_t i = 0; i < actions.size(); ++i) {
      const ActionValues v = action_values(plan, sizes, rows, w, actions[i]);
      const OffloadValues moved = offload_values(plan, offload, sizes, rows, w, i);
      const schedule::ActionTime t = sim.times[std::size_t(w)][i];
      events.push_back({t.start, 2, w, v.allocate + moved.back});
      if (v.to >= 0 && v.to != w && at_receive) {
        // Received as the taker starts, with its allocations (after the frees of the action before).
        const std::size_t j = taken_at(graph, taker, std::size_t(w), i, std::size_t(v.to));
        events.push_back({sim.times[std::size_t(v.to)][j].start, 2, v.to, v.message});
      } else if (v.to >= 0) {
        events.push_back({t.end, 0, v.to, v.message});
      }
      if (v.free + moved.out > 0) events.push_back({t.end, 1, w, -(v.free + moved.out)});
    }
  }
  std::sort(events.begin(), events.end(), [](const Event& a, const Event& b) {
    return a.time != b.time ? a.time < b.time : a.order < b.order;
  });
  std::vector<double> now(std::size_t(plan.config.stages), 0), peak(std::size_t(plan.config.stages), 0);
  for (const Event& e : events) {
    double& v = now[std::size_t(e.worker)];
    v += e.values;
    peak[std::size_t(e.worker)] = std::max(peak[std::size_t(e.worker)], v);
  }
  return peak;
}

/// Vector clocks over `graph`: clock[n * W + v] is the last action of worker v whose send happens
/// before node n ends (its own worker: n itself); -1 for none. Filled in an order the plan's
/// dependencies allow.
inline std::vector<int> happens_before_clocks(const schedule::Plan& plan, const ActionGraph& graph) {
  const std::size_t W = std::size_t(plan.config.stages);
  const std::vector<std::size_t>& first = graph.first;
  const std::size_t nodes = first[W];
  std::vector<int> clock(nodes * W, -1);
  std::vector<char> done(nodes, 0);
  std::vector<std::size_t> next(W, 0);
  for (std::size_t filled = 0; filled < nodes;) {
    const std::size_t before = filled;
    for (std::size_t w = 0; w < W; ++w)
      for (; next[w] < plan.actions[w].size(); ++next[w]) {
        const std::size_t n = first[w] + next[w];
        const auto& in = graph.takes[n];
        if ((in[0] >= 0 && !done[std::size_t(in[0])]) || (in[1] >= 0 && !done[std::size_t(in[1])])) break;
        int* c = &clock[n * W];
        if (next[w] > 0) std::copy_n(&clock[(n - 1) * W], W, c);
        for (const std::ptrdiff_t s : in)
          if (s >= 0)
            for (std::size_t v = 0; v < W; ++v) c[v] = std::max(c[v], clock[std::size_t(s) * W + v]);
        c[w] = int(next[w]);
        done[n] = 1;
        ++filled;
      }
    CUPIPE_REQUIRE(filled > before, "planner: the plan's messages wait on each other (no action can start)");
  }
  return clock;
}

/// Per worker and action: values allocated at the start, freed at the end, and messages landing
/// just before the start (latest) or between the start's allocations and the end's frees (earliest;
/// before the first action: index 0's "before").
struct ActionSlot {
  double allocate = 0, free = 0, early_before = 0, early_after = 0, late_before = 0;
  double own = 0;  // messages to this worker from its own action, landing as it ends
};

/// Every action's own values (with `offload`'s moves) and every message placed at its earliest and
/// latest landing on its receiver, per worker (`clock`: happens_before_clocks).
inline std::vector<std::vector<ActionSlot>> place_messages(const schedule::Plan& plan, const std::vector<ChunkSizes>& sizes,
                                                           const std::vector<double>& rows, const ActionGraph& graph,
                                                           const std::vector<int>& clock,
                                                           const schedule::OffloadPlan* offload = nullptr,
                                                           Landing landing = Landing::at_send) {
  const std::size_t W = std::size_t(plan.config.stages);
  const std::vector<std::size_t>& first = graph.first;
  const std::vector<std::ptrdiff_t> taker = landing == Landing::at_receive ? takers(graph) : std::vector<std::ptrdiff_t>{};
  std::vector<std::vector<ActionSlot>> slots(W);
  for (std::size_t w = 0; w < W; ++w) slots[w].resize(plan.actions[w].size());
  for (std::size_t w = 0; w < W; ++w) {
    const auto& actions = plan.actions[w];
    for (std::size_t i = 0; i < actions.size(); ++i) {
      const ActionValues v = action_values(plan, sizes, rows, int(w), actions[i]);
      const OffloadValues moved = offload_values(plan, offload, sizes, rows, int(w), i);
      ActionSlot& s = slots[w][i];
      s.allocate = v.allocate + moved.back;
      s.free = v.free + moved.out;
      // The message this action sends, placed on its receiver.
      if (v.to < 0) continue;
      const double values = v.message;
      const std::size_t receiver = std::size_t(v.to);
      if (receiver == w) {
        s.own += values;
        continue;
      }
      if (landing == Landing::at_receive) {  // at the taker's start, earliest and latest
        const std::size_t j = taken_at(graph, taker, w, i, receiver);
        slots[receiver][j].late_before += values;
        slots[receiver][j].early_before += values;
        continue;
      }
      // Latest: before the receiver's first action this send happens before (clocks only grow
      // along a worker's actions).
      std::size_t j = 0, count = plan.actions[receiver].size();
      while (count > 0) {
        const std::size_t half = count / 2;
        if (clock[(first[receiver] + j + half) * W + w] < int(i)) {
          j += half + 1;
          count -= half + 1;
        } else {
          count = half;
        }
      }
      CUPIPE_REQUIRE(j < plan.actions[receiver].size(), "planner: no action of worker ", receiver,
                     " takes the message of worker ", w, "'s action ", i);
      slots[receiver][j].late_before += values;
      // Earliest: after the receiver's last action that happens before this send.
      const int after = clock[(first[w] + i) * W + receiver];
      if (after < 0) slots[receiver][0].early_before += values;
      else slots[receiver][std::size_t(after)].early_after += values;
    }
  }
  return slots;
}

/// Each worker's values replayed through its slots in program order, every message at its earliest
/// landing (the most) and at its latest (the least).
inline ActivationBounds replay_bounds(const std::vector<std::vector<ActionSlot>>& slots) {
  const std::size_t W = slots.size();
  ActivationBounds out{std::vector<double>(W, 0), std::vector<double>(W, 0)};
  for (std::size_t w = 0; w < W; ++w) {
    double low = 0, high = 0;
    for (const ActionSlot& s : slots[w]) {
      high += s.early_before + s.allocate;
      out.high[w] = std::max(out.high[w], high);
      high += s.early_after + s.own;
      out.high[w] = std::max(out.high[w], high);
      high -= s.free;
      low += s.late_before + s.allocate;
      out.low[w] = std::max(out.low[w], low);
      low += s.own;
      out.low[w] = std::max(out.low[w], low);
      low -= s.free;
    }
  }
  return out;
}

/// Each worker's least and most activation peak (see ActivationBounds): the plan's actions as a
/// graph, their vector clocks, every message placed at its earliest and latest landing, the replay.
/// With `offload`, its moves are the worker's own, in program order (offload_values).
inline ActivationBounds activation_bounds(const schedule::Plan& plan, const std::vector<ChunkSizes>& sizes,
                                          const std::vector<double>& rows, const schedule::OffloadPlan* offload = nullptr,
                                          Landing landing = Landing::at_send) {
  const ActionGraph graph = action_graph(plan);
  const std::vector<int> clock = happens_before_clocks(plan, graph);
  return replay_bounds(place_messages(plan, sizes, rows, graph, clock, offload, landing));
}

}  // namespace detail

}  // namespace cupipe::planner
