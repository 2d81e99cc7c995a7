# SPDX-License-Identifier: Apache-2.0
"""Times gpt_train's tiny GPT step (one stage, one microbatch, float32, one core) in cupipe and in
PyTorch (gpt_pytorch.py), alternating, and prints the median step time of each (ms, and the range over
the repeats) and the ratio PyTorch / cupipe (above 1: cupipe is faster) as a markdown table. cupipe
runs twice a round: with its float loops in the widest vector instruction set the CPU runs (the
default) and with CUPIPE_HOST_ISA=baseline (SSE2, what a generic x86-64 build has without the
run-time choice); the two compute the same bits. One
thread on both sides: gpt_train gives each stage worker one BLAS thread (its workers are its
parallelism), so that is the like-for-like comparison. cupipe's figure is the trainer's own median step (`step_seconds_measured`), over --steps steps
of the fortunes; PyTorch's the median of as many steps on random tokens (the data does not change the
work). Without a Python that imports torch it times cupipe alone and says so.

    python3 bench/cpu_vs_pytorch/compare_gpt.py --gpt-train build/host/examples/gpt_train/gpt_train \
        --python /path/to/venv/bin/python [--repeats 3] [--batch 8,32] [--steps 60]
"""
import argparse
import os
import statistics
import subprocess
import sys

from compare import run  # the same environment and JSON reading as the MLP comparison


def main():
    here = os.path.dirname(os.path.abspath(__file__))
    p = argparse.ArgumentParser()
    p.add_argument("--gpt-train", required=True, help="the gpt_train binary")
    p.add_argument("--python", default=sys.executable, help="a Python that imports torch")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--batch", default="8,32", help="sequences a step, comma-separated")
    p.add_argument("--steps", type=int, default=60)
    a = p.parse_args()
    has_torch = subprocess.run([a.python, "-c", "import torch"], capture_output=True).returncode == 0
    if not has_torch:
        print(f"compare_gpt.py: {a.python} cannot import torch; timing cupipe alone", file=sys.stderr)
    print("| batch | cupipe ms a step (median, range) | cupipe, baseline ISA | PyTorch ms a step (median, range) | PyTorch / cupipe |")
    print("| --- | --- | --- | --- | --- |")
    version = ""
    threads = 1
    for batch in [int(b) for b in a.batch.split(",")]:
        mine, baseline, theirs = [], [], []
        for _ in range(a.repeats):  # alternating, so drift in the machine's speed hits all alike
            command = [a.gpt_train, "--stages", "1", "--microbatches", "1", "--batch", str(batch), "--steps", str(a.steps),
                       "--eval-every", "0", "--eval-batches", "1", "--sample", "0", "--progress", "none"]
            mine.append(1e3 * run(command, threads)["step_seconds_measured"])
            baseline.append(1e3 * run(command, threads, {"CUPIPE_HOST_ISA": "baseline"})["step_seconds_measured"])
            if has_torch:
                r = run([a.python, os.path.join(here, "gpt_pytorch.py"), "--threads", str(threads), "--batch", str(batch),
                         "--steps", str(a.steps)], threads)
                theirs.append(1e3 * r["step_seconds"])
                version = r["impl"]

        def cell(values):
            return f"{statistics.median(values):.1f} ({min(values):.1f}-{max(values):.1f})" if values else "-"
        ratio = f"{statistics.median(theirs) / statistics.median(mine):.2f}x" if theirs else "-"
        print(f"| {batch} | {cell(mine)} | {cell(baseline)} | {cell(theirs)} | {ratio} |", flush=True)
    if version:
        print(f"\n({version})")


if __name__ == "__main__":
    main()
