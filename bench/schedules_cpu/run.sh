#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Every schedule on the same job, one after another in one go, on the CPU (host backend): the
# Fashion-MNIST MLP with the same stages, microbatches, batch and data. Prints a markdown table of
# seconds per epoch, samples/s (and its ratio to 1F1B) and the measured bubble, from each run's JSON.
#   bash bench/schedules_cpu/run.sh [trainer] [stages] [microbatches] [train samples]
set -euo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
trainer="${1:-$root/build/host/examples/mlp_fashion_mnist/mlp_fashion_mnist}"
stages="${2:-2}"
microbatches="${3:-8}"
samples="${4:-20000}"
[ -x "$trainer" ] || { echo "no trainer at $trainer; build it first (bash scripts/run.sh builds it)" >&2; exit 1; }
out="$(mktemp -d)"
for schedule in gpipe 1f1b interleaved pipedream 2bw zb-h1 zb-h2; do
  "$trainer" --schedule "$schedule" --stages "$stages" --microbatches "$microbatches" --epochs 1 \
    --train-limit "$samples" --test-limit 2000 --progress none | tail -n 1 >"$out/$schedule.json"
done
python3 - "$out" "$stages" "$microbatches" "$samples" <<'PY'
import json, os, sys
out, stages, microbatches, samples = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4]
rows = {s: json.load(open(os.path.join(out, s + ".json"))) for s in
        ["gpipe", "1f1b", "interleaved", "pipedream", "2bw", "zb-h1", "zb-h2"]}
base = rows["1f1b"]["samples_per_second"]
print(f"p = {stages} stages, m = {microbatches} microbatches, batch 128, {samples} training samples, 1 epoch each\n")
print("| schedule | seconds per epoch | samples/s | vs 1F1B | measured bubble | test accuracy |")
print("| --- | ---: | ---: | ---: | ---: | ---: |")
for name, r in rows.items():
    print(f"| {name} | {r['seconds']:.2f} | {r['samples_per_second']:.0f} | {r['samples_per_second'] / base:.2f} | "
          f"{r['bubble_fraction_measured']:.3f} | {r['test_accuracy']:.4f} |")
PY
