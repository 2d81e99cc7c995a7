# SPDX-License-Identifier: Apache-2.0
"""Runs mlp_cpu_job (cupipe) and mlp_pytorch.py (PyTorch) on the same job, alternating, at each thread
count, and prints samples/s (median of the repeats, and the range) and the ratio cupipe / PyTorch as a
markdown table. Without a Python that imports torch it runs cupipe alone and says so.

    python3 bench/cpu_vs_pytorch/compare.py --cupipe build/host/bench/cpu_vs_pytorch/mlp_cpu_job \
        --python /path/to/venv/bin/python [--threads 1,2] [--repeats 3] [--samples 10000] [--epochs 2]
"""
import argparse
import json
import os
import statistics
import subprocess
import sys


def run(command, threads, extra_env=None):
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads),
               OPENBLAS_NUM_THREADS=str(threads), **(extra_env or {}))
    out = subprocess.run(command, env=env, capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(f"compare.py: {' '.join(command)} failed:\n{out.stderr}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main():
    here = os.path.dirname(os.path.abspath(__file__))
    p = argparse.ArgumentParser()
    p.add_argument("--cupipe", required=True, help="the mlp_cpu_job binary")
    p.add_argument("--python", default=sys.executable, help="a Python that imports torch and numpy")
    p.add_argument("--threads", default="1,2")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--samples", type=int, default=10000)
    p.add_argument("--epochs", type=int, default=2)
    a = p.parse_args()
    has_torch = subprocess.run([a.python, "-c", "import torch, numpy"], capture_output=True).returncode == 0
    if not has_torch:
        print(f"compare.py: {a.python} cannot import torch and numpy; measuring cupipe alone", file=sys.stderr)
    common = ["--samples", str(a.samples), "--epochs", str(a.epochs)]
    print("| threads | cupipe samples/s (median, range) | PyTorch samples/s (median, range) | ratio |")
    print("| --- | --- | --- | --- |")
    version = ""
    for threads in [int(t) for t in a.threads.split(",")]:
        mine, theirs = [], []
        for _ in range(a.repeats):  # alternating, so drift in the machine's speed hits both alike
            mine.append(run([a.cupipe, "--threads", str(threads)] + common, threads)["samples_per_second"])
            if has_torch:
                r = run([a.python, os.path.join(here, "mlp_pytorch.py"), "--threads", str(threads)] + common, threads)
                theirs.append(r["samples_per_second"])
                version = r["impl"]
        def cell(values):
            return f"{statistics.median(values):,.0f} ({min(values):,.0f}-{max(values):,.0f})" if values else "-"
        ratio = f"{statistics.median(mine) / statistics.median(theirs):.2f}x" if theirs else "-"
        print(f"| {threads} | {cell(mine)} | {cell(theirs)} | {ratio} |", flush=True)
    if version:
        print(f"\n(PyTorch: {version})")


if __name__ == "__main__":
    main()
