#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""The figures of one gpu_check.sh run as rows a tool can compare across leases.

    python3 scripts/gpu_results.py OUT_DIR [--write FILE]

Reads what gpu_check.sh left in OUT_DIR (machine.txt, steps.tsv, the GPT steps' JSON lines, torch.jsonl,
kernels.json, sdpa.json, pipeline.json, the test logs) and prints, or writes to FILE, a JSON list of
{"name", "value", "unit", "commit", "device", "date"}. gpu_check.sh writes OUT_DIR/<date>-<device>.json
with it; a session commits that file as bench/results/<date>-<device>.json. Names:

    gpt2_124m/<impl>/<precision>/b<batch>/tokens_per_s    impl: cupipe, cupipe_<attention> (a path asked
    gpt2_124m/cupipe.../<precision>/b<batch>/mfu                for by name), torch_eager, torch_compile
    attention/<path>/<fwd|bwd>/tflops                     path: cudnn, mma, tiled, reference (the simple
                                                          kernels), torch_sdpa (flash), torch_sdpa_<backend>;
                                                          bf16, or <path>_fp32
    pipeline/ratio/<model>/p<P>/m<M>                      1F1B against the unpipelined model, same run
    pipeline/action_cost_us/p<P>                          the runtime's mean time inside an action
    tests/gpu/passed, tests/gpu/failed, tests/gpu/skipped test cases (Catch2) or tests (ctest)
Only figures that were measured are written; a step that did not run gives no row.
"""
import argparse
import json
import os
import re
import sys


def machine(out):
    info = {"date": "", "device": "", "commit": ""}
    path = os.path.join(out, "machine.txt")
    if not os.path.exists(path):
        return info
    for line in open(path):
        key, _, value = line.partition(":")
        value = value.strip()
        if key == "date":
            info["date"] = value.split(" ")[0]
        elif key == "gpu" and not info["device"]:
            info["device"] = value.split(",")[0].strip()
        elif key == "checked":
            info["commit"] = value
    return info


def json_lines(path):
    if not os.path.exists(path):
        return []
    rows = []
    for line in open(path):
        line = line.strip()
        if line.startswith("{"):
            try:
                rows.append(json.loads(line))
            except ValueError:
                pass
    return rows


def load(path):
    try:
        return json.load(open(path)) if os.path.exists(path) else None
    except ValueError:
        return None


def gpt_rows(out, add):
    for name in sorted(os.listdir(out)):
        if not (name.startswith("gpt_") and name.endswith(".log")):
            continue
        for r in json_lines(os.path.join(out, name)):
            if "tokens_per_second" not in r or "precision" not in r or "batch" not in r:
                continue
            asked = r.get("attention", "auto")
            impl = "cupipe" if asked in ("auto", "automatic") else "cupipe_" + asked
            base = f"gpt2_124m/{impl}/{r['precision']}/b{r['batch']}"
            add(base + "/tokens_per_s", r["tokens_per_second"], "tokens/s")
            if "mfu" in r:
                add(base + "/mfu", r["mfu"], "fraction")
    for r in json_lines(os.path.join(out, "torch.jsonl")):
        impl = "torch_compile" if r.get("compile") else "torch_eager"
        base = f"gpt2_124m/{impl}/{r.get('precision')}/b{r.get('batch')}"
        add(base + "/tokens_per_s", r["tokens_per_second"], "tokens/s")
        if "mfu" in r:
            add(base + "/mfu", r["mfu"], "fraction")


def harness_states(doc, benchmark):
    """The states of one benchmark in a harness JSON document (bench/harness/harness.hpp)."""
    if not isinstance(doc, dict):
        return []
    for b in doc.get("benchmarks", []):
        if b.get("name") == benchmark:
            return [s for s in b.get("states", []) if "skipped" not in s]
    return []


def kernel_rows(out, add):
    for s in harness_states(load(os.path.join(out, "kernels.json")), "attention"):
        axes, tflops = s.get("axes", {}), s.get("tflops")
        if tflops is None:
            continue
        path = {"simple": "reference"}.get(axes.get("kernel"), axes.get("kernel"))
        if axes.get("precision", "fp32") != "bf16":
            path += "_fp32"
        direction = "fwd" if axes.get("pass") == "forward" else "bwd"
        add(f"attention/{path}/{direction}/tflops", tflops, "TFLOP/s")
    sdpa = load(os.path.join(out, "sdpa.json"))
    for r in (sdpa or {}).get("rows", []) if isinstance(sdpa, dict) else []:
        path = "torch_sdpa" if r.get("backend") == "flash" else "torch_sdpa_" + str(r.get("backend"))
        direction = "fwd" if r.get("pass") == "forward" else "bwd"
        add(f"attention/{path}/{direction}/tflops", r["tflops"], "TFLOP/s")


def pipeline_rows(out, add):
    doc = load(os.path.join(out, "pipeline.json"))
    for s in harness_states(doc, "1f1b"):
        axes, summaries = s.get("axes", {}), s.get("summaries", {})
        if "ratio_to_unpipelined" in summaries:
            add(f"pipeline/ratio/{axes.get('model')}/p{axes.get('stages')}/m{axes.get('microbatches')}",
                summaries["ratio_to_unpipelined"], "ratio")
    for s in harness_states(doc, "action_cost"):
        axes, summaries = s.get("axes", {}), s.get("summaries", {})
        if "mean_action_us" in summaries:
            add(f"pipeline/action_cost_us/p{axes.get('stages')}", summaries["mean_action_us"], "us")


def test_rows(out, add):
    passed = failed = skipped = 0
    seen = False
    for name in ("test.log", "test_pipeline.log"):
        path = os.path.join(out, name)
        if not os.path.exists(path):
            continue
        text = open(path, errors="replace").read()
        ctest = re.search(r"(\d+)% tests passed, (\d+) tests failed out of (\d+)", text)
        if ctest:  # ctest counts tests; a skipped one counts as passed in that line
            seen = True
            total, bad = int(ctest.group(3)), int(ctest.group(2))
            skip = len(re.findall(r"\*\*\*Skipped|Skipped\s*$", text, re.M))
            passed += total - bad - skip
            failed += bad
            skipped += skip
            continue
        every = re.search(r"All tests passed \(\d+ assertions? in (\d+) test cases?\)", text)
        some = re.search(r"test cases:\s*(\d+)\s*\|\s*(\d+) passed\s*\|\s*(\d+) failed", text)
        if every:
            seen = True
            passed += int(every.group(1))
        elif some:
            seen = True
            passed += int(some.group(2))
            failed += int(some.group(3))
        elif re.search(r"^skipped:", text, re.M):  # a GPU test program without a device exits 77
            seen = True
            skipped += 1
    if seen:
        add("tests/gpu/passed", passed, "count")
        add("tests/gpu/failed", failed, "count")
        add("tests/gpu/skipped", skipped, "count")


def rows_of(out):
    info = machine(out)
    rows = []

    def add(name, value, unit):
        rows.append({"name": name, "value": value, "unit": unit, "commit": info["commit"], "device": info["device"],
                     "date": info["date"]})

    gpt_rows(out, add)
    kernel_rows(out, add)
    pipeline_rows(out, add)
    test_rows(out, add)
    return info, rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", help="the folder gpu_check.sh wrote (--out)")
    parser.add_argument("--write", help="write the rows here instead of printing them")
    parser.add_argument("--write-dir", help="write the rows into DIR/<date>-<device>.json, and print that path")
    args = parser.parse_args()
    if not os.path.isdir(args.out):
        sys.exit(f"gpu_results: {args.out} is not a folder")
    info, rows = rows_of(args.out)
    text = json.dumps(rows, indent=1)
    if args.write_dir:
        slug = re.sub(r"[^a-z0-9]+", "-", info["device"].lower()).strip("-") or "unknown-device"
        path = os.path.join(args.write_dir, f"{info['date'] or 'undated'}-{slug}.json")
        with open(path, "w") as f:
            f.write(text + "\n")
        print(path)
    elif args.write:
        with open(args.write, "w") as f:
            f.write(text + "\n")
    else:
        print(text)


if __name__ == "__main__":
    main()
