#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Merges the ranks' flight records and says why the job hangs.

Each rank's pipeline writes cupipe-flight-rank-R.json when one of its waits times out or on SIGUSR1
(include/cupipe/pipeline/flight_recorder.hpp; send SIGUSR1 to mpirun and it reaches every rank).
This reads them all, follows who waits for whom (a worker waits for a message from a peer worker,
on its own rank or another), and names either a cycle of waits or the end of each chain: the rank
that never sent, because it is stuck in an action, has finished, waits for nothing, or left no
record (dead, or not signalled).

    python3 scripts/flight.py FILE_OR_DIR...    the report (a directory: its cupipe-flight-rank-*.json)
    python3 scripts/flight.py --self-test       the analysis against made-up records
"""
import glob
import json
import os
import sys


def load(paths):
    """{rank: record}; of two records of one rank (two pipelines in a process), the later dump."""
    records = {}
    for path in paths:
        files = sorted(glob.glob(os.path.join(path, "cupipe-flight-rank-*.json"))) if os.path.isdir(path) else [path]
        for name in files:
            with open(name) as f:
                record = json.load(f)
            record["file"] = name
            rank = record["rank"]
            if rank not in records or record["wall_time"] > records[rank]["wall_time"]:
                records[rank] = record
    return records


def flow_text(wait):
    return "the %s of microbatch %d" % (wait["flow"], wait["microbatch"])


def node_name(rank, worker, records):
    record = records.get(rank)
    if record is not None and not record.get("across_processes", True):
        return "worker %d" % worker
    return "rank %d" % rank


def state_of(record, worker):
    """What a worker that waits for nobody is doing, in words."""
    entry = next((w for w in record["workers"] if w["worker"] == worker), None)
    if entry is None:
        return "it has no worker %d" % worker
    current = entry["current"]
    if current is not None:
        return "it stopped in its action %s (running for %.2f s, not waiting for any message)" % (
            current["action"], current["started_ago"])
    last = entry["recent"][-1]["action"] if entry["recent"] else "none"
    if record.get("in_step"):
        return "it is between actions (its last: %s), not waiting for any message" % last
    return "it is not in a step (its last action: %s): it finished or left the step" % last


def waits(records):
    """{(rank, worker): (peer rank, peer worker, wait)} of every worker that waits for a message."""
    out = {}
    for rank, record in records.items():
        for w in record["workers"]:
            if w.get("waiting"):
                out[(rank, w["worker"])] = (w["waiting"]["peer_rank"], w["waiting"]["peer_worker"], w["waiting"])
    return out


def analyse(records, world=None):
    """The verdict lines: cycles of waits, then the ranks that never sent, then collectives."""
    if world is None:
        world = max([r.get("world", 1) for r in records.values()] + [0])
    edges = waits(records)
    lines, roots, cycles = [], {}, set()
    for start in sorted(edges):
        path, node = [], start
        while node in edges and node not in path:
            path.append(node)
            node = edges[node][:2]
        if node in path:  # a cycle: name it once, from its smallest node
            cycle = path[path.index(node):]
            key = tuple(sorted(cycle))
            if key not in cycles:
                cycles.add(key)
                first = cycle.index(min(cycle))
                cycle = cycle[first:] + cycle[:first]
                steps = ["%s waits for %s from %s" % (node_name(n[0], n[1], records), flow_text(edges[n][2]),
                                                     node_name(edges[n][0], edges[n][1], records)) for n in cycle]
                lines.append("cycle of waits: " + "; ".join(steps) + " (each waits for the next: a deadlock)")
            continue
        chains = roots.setdefault(node, {})
        if path[-1] not in chains or len(path) > len(chains[path[-1]]):
            chains[path[-1]] = path  # the longest chain of waits that ends here
    for (rank, worker), chains in sorted(roots.items()):
        who = node_name(rank, worker, records)
        missed = ", ".join("%s to %s" % (flow_text(edges[w][2]), node_name(w[0], w[1], records)) for w in sorted(chains))
        record = records.get(rank)
        if record is None:
            why = "%s left no flight record: it died, hangs without a dump, or was not signalled " \
                  "(send SIGUSR1 to mpirun)" % who
        else:
            why = state_of(record, worker)
        lines.append("%s never sent %s: %s" % (who, missed, why))
        for path in sorted(chains.values(), key=len, reverse=True):
            if len(path) > 1:
                lines.append("  waiting on it: " + " -> ".join(node_name(n[0], n[1], records) for n in path) + " -> " + who)
    lines += collectives(records, world)
    if not lines:
        lines.append("no rank waits for another in these records")
    return lines


def collectives(records, world):
    """Ranks that timed out in a collective, and the ranks that never joined it."""
    stuck = {r: rec for r, rec in records.items()
             if rec.get("trigger") == "timeout" and "collective timeout" in rec.get("reason", "")}
    if not stuck:
        return []
    out = ["%s timed out in a collective: %s" % (", ".join("rank %d" % r for r in sorted(stuck)),
                                                 stuck[min(stuck)]["reason"])]
    for rank in range(world):
        if rank in stuck:
            continue
        if rank not in records:
            out.append("rank %d never joined it: it left no flight record (dead, or send SIGUSR1 to mpirun)" % rank)
            continue
        record = records[rank]
        states = "; ".join("worker %d: %s" % (w["worker"], state_of(record, w["worker"]))
                           for w in record["workers"] if not w.get("waiting"))
        out.append("rank %d never joined it: %s" % (rank, states or "its workers wait for messages"))
    return out


def summary(records, world):
    out = []
    for rank in range(world):
        record = records.get(rank)
        if record is None:
            out.append("rank %d: no record" % rank)
            continue
        out.append("rank %d (stage %d, %s): %s" % (rank, record.get("stage", 0), record["trigger"], record["reason"]))
        for w in record["workers"]:
            doing = "in %s" % w["current"]["action"] if w["current"] else "no action running"
            if w.get("waiting"):
                doing += ", waiting for %s from rank %d (tag %d)" % (flow_text(w["waiting"]), w["waiting"]["peer_rank"],
                                                                   w["waiting"]["tag"])
            recent = " ".join(e["action"] for e in w["recent"][-8:])
            out.append("  worker %d: %s; last actions: %s" % (w["worker"], doing, recent))
    return out


def main(argv):
    if argv == ["--self-test"]:
        return self_test()
    if not argv or argv[0].startswith("-"):
        print(__doc__.strip())
        return 2
    records = load(argv)
    if not records:
        print("flight: no records in " + " ".join(argv))
        return 1
    world = max(r.get("world", 1) for r in records.values())
    for line in summary(records, world):
        print(line)
    for line in analyse(records, world):
        print("flight: " + line)
    return 0


# --- self-test ------------------------------------------------------------------------------------

def made_up(rank, world, trigger="signal", reason="SIGUSR1", workers=None, in_step=True):
    return {"rank": rank, "world": world, "stage": rank, "across_processes": True, "trigger": trigger,
            "reason": reason, "wall_time": 1.0, "in_step": in_step, "workers": workers or []}


def worker(w, current=None, waiting=None, recent=()):
    entry = lambda a: {"action": a, "started_ago": 2.5}  # noqa: E731
    return {"worker": w, "current": entry(current) if current else None,
            "waiting": waiting, "recent": [entry(a) for a in recent]}


def wait_for(peer, flow="gradient", microbatch=0):
    return {"peer_rank": peer, "peer_worker": peer, "flow": flow, "microbatch": microbatch, "tag": 0}


def self_test():
    failures = []

    def expect(name, lines, *wanted):
        text = "\n".join(lines)
        for w in wanted:
            if w not in text:
                failures.append("%s: %r not in:\n%s" % (name, w, text))

    # A chain 0 -> 1 -> 2 that ends at a rank stuck inside a forward (the MPI test's case).
    chain = {0: made_up(0, 3, "timeout", "x", [worker(0, "B0", wait_for(1), ["F0", "F1", "F2", "B0"])]),
             1: made_up(1, 3, "timeout", "x", [worker(1, "B0", wait_for(2), ["F0", "F1", "B0"])]),
             2: made_up(2, 3, workers=[worker(2, "F0", None, ["F0"])])}
    expect("stuck", analyse(chain), "rank 2 never sent the gradient of microbatch 0 to rank 1: it stopped in its "
           "action F0 (running for 2.50 s")
    # The same with rank 2's file missing.
    expect("missing", analyse({0: chain[0], 1: chain[1]}), "rank 2 never sent the gradient of microbatch 0 to "
           "rank 1: rank 2 left no flight record")
    # A rank that finished its step.
    done = dict(chain)
    done[2] = made_up(2, 3, in_step=False, workers=[worker(2, None, None, ["F0", "B0"])])
    expect("finished", analyse(done), "rank 2 never sent the gradient of microbatch 0 to rank 1: it is not in a "
           "step (its last action: B0)")
    # Two ranks waiting for each other: a cycle, named once.
    cycle = {0: made_up(0, 2, workers=[worker(0, "F1", wait_for(1, "activation", 1))]),
             1: made_up(1, 2, workers=[worker(1, "B0", wait_for(0, "gradient", 0))])}
    lines = analyse(cycle)
    expect("cycle", lines, "cycle of waits: rank 0 waits for the activation of microbatch 1 from rank 1; rank 1 "
           "waits for the gradient of microbatch 0 from rank 0")
    if sum("cycle" in line for line in lines) != 1 or any("never sent" in line for line in lines):
        failures.append("cycle: named more than once, or as a silent rank:\n" + "\n".join(lines))
    # In one process the nodes are workers.
    local = {0: dict(made_up(0, 1, workers=[worker(0, "F1"), worker(1, "F0", wait_for(0, "activation", 0))]),
                     across_processes=False)}
    expect("in process", analyse(local), "worker 0 never sent the activation of microbatch 0 to worker 1: it "
           "stopped in its action F1")
    # A collective that one rank never joined.
    reason = "rank 0: a sum over all 3 ranks did not finish within 3 s (collective timeout): another rank stalled"
    coll = {0: made_up(0, 3, "timeout", reason, [worker(0)], in_step=False),
            1: made_up(1, 3, "timeout", reason, [worker(1)], in_step=False)}
    expect("collective", analyse(coll), "rank 0, rank 1 timed out in a collective", "rank 2 never joined it: it "
           "left no flight record")
    # Records round-trip through files and a directory.
    import tempfile
    with tempfile.TemporaryDirectory() as d:
        for rank, record in chain.items():
            with open(os.path.join(d, "cupipe-flight-rank-%d.json" % rank), "w") as f:
                json.dump(record, f)
        expect("load", analyse(load([d])), "rank 2 never sent")
    for f in failures:
        print("FAIL " + f)
    print("flight self-test: %s" % ("FAIL" if failures else "PASS"))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
