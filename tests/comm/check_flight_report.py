#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Stalls a rank under mpirun and checks that the flight records name it and the action it stopped in.

    check_flight_report.py --dir DIR --merge scripts/flight.py --stalled-rank R --stalled-action A
                           --waiting-ranks R1,R2 [--timeout S] -- mpirun ... mpi_fault_check ... --report DIR

Runs the job in the background. The ranks that wait for the stalled one time out and dump
(DIR/cupipe-flight-rank-R.json); then SIGUSR1 goes to mpirun, which forwards it to every rank, so
the stalled rank dumps too (from its watcher thread, while its worker sleeps in the action). Then the
job is ended (SIGTERM to mpirun), the records are merged, and this checks that the merge says the
stalled rank never sent and names its action, that its record shows that action running and no wait,
and that each waiting rank's record waits for a message from the rank it waits on.
"""
import argparse
import glob
import json
import os
import re
import signal
import subprocess
import sys
import time


def wait_for(paths, seconds, job):
    deadline = time.time() + seconds
    while time.time() < deadline:
        if all(os.path.exists(p) for p in paths):
            return True
        if job.poll() is not None:
            return all(os.path.exists(p) for p in paths)
        time.sleep(0.05)
    return False


def fail(message, output=""):
    print(output)
    print("FAIL: " + message)
    return 1


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--dir", required=True)
    parser.add_argument("--merge", required=True)
    parser.add_argument("--stalled-rank", type=int, required=True)
    parser.add_argument("--stalled-action", required=True)
    parser.add_argument("--waiting-ranks", required=True)
    parser.add_argument("--timeout", type=float, default=60)
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    waiting = [int(r) for r in args.waiting_ranks.split(",")]
    os.makedirs(args.dir, exist_ok=True)
    for old in glob.glob(os.path.join(args.dir, "*")):
        os.remove(old)
    record = lambda r: os.path.join(args.dir, "cupipe-flight-rank-%d.json" % r)  # noqa: E731

    start = time.time()
    job = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    timed_out = wait_for([record(r) for r in waiting], args.timeout, job)
    signalled = time.time() - start
    if timed_out:
        time.sleep(0.2)  # the waiting ranks' dumps are complete (written to a temporary, then renamed)
        job.send_signal(signal.SIGUSR1)
        wait_for([record(args.stalled_rank)], 20, job)
    if job.poll() is None:
        job.send_signal(signal.SIGTERM)
    try:
        output, _ = job.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        job.kill()
        output, _ = job.communicate()
    print("$ " + " ".join(command))
    print(output)
    print("waiting ranks dumped after %.1f s; job ended after %.1f s" % (signalled, time.time() - start))
    if not timed_out:
        return fail("ranks %s wrote no flight record after their timeout" % args.waiting_ranks)
    if not os.path.exists(record(args.stalled_rank)):
        return fail("the stalled rank %d wrote no flight record on SIGUSR1 (forwarded by mpirun)" % args.stalled_rank)

    merged = subprocess.run([sys.executable, args.merge, args.dir], capture_output=True, text=True)
    print("$ flight.py " + args.dir)
    print(merged.stdout + merged.stderr)
    if merged.returncode != 0:
        return fail("flight.py failed")
    verdict = r"flight: rank %d never sent .*: it stopped in its action %s \(" % (args.stalled_rank,
                                                                               re.escape(args.stalled_action))
    if not re.search(verdict, merged.stdout):
        return fail("the merge does not name rank %d and its action %s" % (args.stalled_rank, args.stalled_action))

    with open(record(args.stalled_rank)) as f:
        stalled = json.load(f)
    worker = stalled["workers"][0]
    if stalled["trigger"] != "signal" or not worker["current"] or worker["current"]["action"] != args.stalled_action \
            or worker["waiting"] is not None:
        return fail("rank %d's record does not show %s running without a wait: %s" %
                    (args.stalled_rank, args.stalled_action, json.dumps(worker)))
    for r in waiting:
        with open(record(r)) as f:
            rec = json.load(f)
        wait = rec["workers"][0]["waiting"]
        if rec["trigger"] not in ("timeout", "wait failed") or not wait or wait["peer_rank"] != r + 1:
            return fail("rank %d's record does not wait for rank %d: %s" % (r, r + 1, json.dumps(rec["workers"][0])))
    print("PASS: the flight records name rank %d, stopped in %s" % (args.stalled_rank, args.stalled_action))
    return 0


if __name__ == "__main__":
    sys.exit(main())
