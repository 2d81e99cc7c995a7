# SPDX-License-Identifier: Apache-2.0
# PyTorch's own orders, for the peer figures in test_policies.cpp ("no more idle than PyTorch 2.15's ...").
# Not run by ctest (it needs torch). Builds ScheduleInterleaved1F1B's and ScheduleDualPipeV's
# pipeline_order per rank without a process group and writes each as a cupipe plan (JSON), which
#   schedule_explorer --plan FILE --cost-f 1 --cost-b 1 --cost-w W --json
# simulates with the same model as ours. Interleaved1F1B's order at m = 10, p = 4 does not verify
# under channels one message deep, so --simulate-only simulates here, with simulate.hpp's rules.
#   python bench/schedules/pytorch_peer_orders.py interleaved 4 10 out.json [--simulate-only W]
import json
import sys

import torch.distributed.pipelining.schedules as S
from torch.distributed.pipelining.schedules import _ComputationType as CT


def rank_orders(kind, p, m):
    orders = {}
    for rank in range(p):
        if kind == "interleaved":
            s = S.ScheduleInterleaved1F1B.__new__(S.ScheduleInterleaved1F1B)
            s.pp_group_size, s.n_local_stages, s._n_microbatches = p, 2, m
            s.number_of_rounds = max(1, m // p)
            s.microbatches_per_round = m // s.number_of_rounds
            if m % s.number_of_rounds:
                raise SystemExit(f"PyTorch rejects m = {m} at p = {p}")
        else:
            s = S.ScheduleDualPipeV.__new__(S.ScheduleDualPipeV)
            s.pp_group_size, s._n_microbatches = p, m
        orders[rank] = s._calculate_single_rank_operations(rank)
    return orders


def to_plan(kind, p, m):
    looped = kind == "interleaved"
    locate = (lambda k: (k % p, k // p)) if looped else (lambda k: (k, 0) if k < p else (2 * p - 1 - k, 1))
    actions = []

    def emit(worker, a, overlap=False):
        _, chunk = locate(a.stage_index)
        one = lambda letter: actions.append(dict(worker=worker, kind=letter, microbatch=a.microbatch_index, chunk=chunk))
        t = a.computation_type
        if t == CT.FORWARD: one("F&" if overlap else "F")
        elif t == CT.FULL_BACKWARD:
            one("B")
            if not looped: one("W")  # a whole backward in a plan whose backward is split
        elif t == CT.BACKWARD_INPUT: one("B")
        elif t == CT.BACKWARD_WEIGHT: one("W")
        else: raise ValueError(a)

    for worker, order in rank_orders(kind, p, m).items():
        for a in order:
            if a is None: continue
            if a.computation_type == CT.OVERLAP_F_B:
                emit(worker, a.sub_actions[0], overlap=True)
                emit(worker, a.sub_actions[1])
            else:
                emit(worker, a)
    return {"format": "cupipe plan", "version": 1, "stages": p, "microbatches": m, "chunks": 2, "batches": 1,
            "split_backward": not looped, "update": "flush", "channel_depth": 1,
            "placement": [list(locate(k)) for k in range(2 * p)], "actions": actions}


def simulate(plan, w):
    """simulate.hpp's model (no transfer cost): an action starts when its worker is free and its input
    is there; an overlapped F waits for its B's input too. Returns the idle of each stage."""
    p, split = plan["stages"], plan["split_backward"]
    at = {tuple(x): k for k, x in enumerate(plan["placement"])}
    last = len(plan["placement"]) - 1
    lists = [[a for a in plan["actions"] if a["worker"] == s] for s in range(p)]
    cost = {"F": 0.5, "F&": 0.5, "B": 0.5 if split else 0.5 + w / 2, "W": w / 2}
    end, free, busy, next_ = {}, [0.0] * p, [0.0] * p, [0] * p

    def ready(s, a):
        k, j = at[(s, a["chunk"])], a["microbatch"]
        if a["kind"] in ("F", "F&"): return end.get(("F", k - 1, j)) if k > 0 else 0.0
        if a["kind"] == "B": return end.get(("B", k + 1, j)) if k < last else end.get(("F", k, j))
        return end.get(("B", k, j))

    progress = True
    while progress:
        progress = False
        for s in range(p):
            while next_[s] < len(lists[s]):
                a = lists[s][next_[s]]
                t = ready(s, a)
                if t is not None and a["kind"] == "F&":
                    t2 = ready(s, lists[s][next_[s] + 1])
                    t = None if t2 is None else max(t, t2)
                if t is None: break
                start = max(free[s], t)
                free[s] = start + cost[a["kind"]]
                busy[s] += cost[a["kind"]]
                end[(a["kind"].rstrip("&"), at[(s, a["chunk"])], a["microbatch"])] = free[s]
                next_[s] += 1
                progress = True
    assert all(next_[s] == len(lists[s]) for s in range(p)), "the order has a dependency cycle"
    return [max(free) - b for b in busy]


if __name__ == "__main__":
    kind, p, m, out = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    plan = to_plan(kind, p, m)
    with open(out, "w") as f:
        json.dump(plan, f, indent=1)
    if "--simulate-only" in sys.argv:
        print("idle per stage (simulated):", simulate(plan, float(sys.argv[sys.argv.index("--simulate-only") + 1])))
