# SPDX-License-Identifier: Apache-2.0
"""scripts/gpu_results.py on a gpu_check.sh output folder made here, in each program's own format:
every figure becomes the row it names, with its unit and the run's commit, device and date; a skipped
benchmark state and a step that did not run give no row; the file is named <date>-<device>.json.

    python3 gpu_results_check.py SCRIPTS_DIR WORK_DIR
"""
import json
import os
import shutil
import subprocess
import sys

scripts, work = sys.argv[1], sys.argv[2]
sys.dont_write_bytecode = True  # no __pycache__ in the checkout
sys.path.insert(0, scripts)
import gpu_results  # noqa: E402

shutil.rmtree(work, ignore_errors=True)
os.makedirs(work)


def write(name, text):
    with open(os.path.join(work, name), "w") as f:
        f.write(text)


write("machine.txt", "date: 2026-12-03 01:02:03 UTC\nchecked: abc1234\ngpu: NVIDIA H200, 570.86, 143771 MiB, 1980 MHz, 700 W\n")
# bench_gpt_step prints its figures, then one JSON line (bench/gpt_step/main.cu).
write("gpt_bf16.log", 'step 20.0 ms\n{"tokens_per_second":409600.0,"step_ms":20.0,"mfu":0.41,"precision":"bf16","batch":8,'
      '"attention":"auto","attention_taken":"cudnn"}\n')
write("gpt_bf16_mma.log", '{"tokens_per_second":300000.0,"mfu":0.3,"precision":"bf16","batch":8,"attention":"mma",'
      '"attention_taken":"mma"}\n')
write("gpt_fp32.log", "error: no GPU\n")  # a step that failed: no row
write("torch.jsonl", json.dumps({"compile": True, "precision": "bf16", "batch": 8, "tokens_per_second": 291211.0,
                                 "mfu": 0.3}) + "\n")
harness = {"benchmarks": [
    {"name": "attention", "states": [
        {"axes": {"precision": "bf16", "kernel": "cudnn", "pass": "forward", "context": 1024}, "tflops": 310.5},
        {"axes": {"precision": "bf16", "kernel": "simple", "pass": "backward", "context": 1024}, "tflops": 1.5},
        {"axes": {"precision": "fp32", "kernel": "tiled", "pass": "forward", "context": 1024}, "tflops": 20.0},
        {"axes": {"precision": "fp32", "kernel": "cudnn", "pass": "forward", "context": 1024}, "skipped": "bf16 only"}]}]}
write("kernels.json", json.dumps(harness))
write("sdpa.json", json.dumps({"rows": [{"backend": "flash", "pass": "backward", "tflops": 250.0},
                                        {"backend": "cudnn", "pass": "forward", "tflops": 400.0}]}))
write("pipeline.json", json.dumps({"benchmarks": [
    {"name": "1f1b", "states": [{"axes": {"model": "mlp", "stages": 2, "microbatches": 8},
                                 "summaries": {"ratio_to_unpipelined": 0.8}}]},
    {"name": "action_cost", "states": [{"axes": {"stages": 4}, "summaries": {"mean_action_us": 4.5}}]}]}))
write("test.log", "...\ntest cases:  40 |  38 passed | 2 failed\nassertions: 900 | 890 passed | 10 failed\n")
write("test_pipeline.log", "All tests passed (120 assertions in 12 test cases)\n")

info, rows = gpu_results.rows_of(work)
got = {r["name"]: (r["value"], r["unit"]) for r in rows}
want = {
    "gpt2_124m/cupipe/bf16/b8/tokens_per_s": (409600.0, "tokens/s"),
    "gpt2_124m/cupipe/bf16/b8/mfu": (0.41, "fraction"),
    "gpt2_124m/cupipe_mma/bf16/b8/tokens_per_s": (300000.0, "tokens/s"),
    "gpt2_124m/cupipe_mma/bf16/b8/mfu": (0.3, "fraction"),
    "gpt2_124m/torch_compile/bf16/b8/tokens_per_s": (291211.0, "tokens/s"),
    "gpt2_124m/torch_compile/bf16/b8/mfu": (0.3, "fraction"),
    "attention/cudnn/fwd/tflops": (310.5, "TFLOP/s"),
    "attention/reference/bwd/tflops": (1.5, "TFLOP/s"),
    "attention/tiled_fp32/fwd/tflops": (20.0, "TFLOP/s"),
    "attention/torch_sdpa/bwd/tflops": (250.0, "TFLOP/s"),
    "attention/torch_sdpa_cudnn/fwd/tflops": (400.0, "TFLOP/s"),
    "pipeline/ratio/mlp/p2/m8": (0.8, "ratio"),
    "pipeline/action_cost_us/p4": (4.5, "us"),
    "tests/gpu/passed": (50, "count"),
    "tests/gpu/failed": (2, "count"),
    "tests/gpu/skipped": (0, "count"),
}
failures = []
if got != want:
    for name in sorted(set(got) | set(want)):
        if got.get(name) != want.get(name):
            failures.append(f"{name}: got {got.get(name)}, want {want.get(name)}")
for r in rows:
    if (r["commit"], r["device"], r["date"]) != ("abc1234", "NVIDIA H200", "2026-12-03"):
        failures.append(f"row {r['name']} carries {r['commit']}, {r['device']}, {r['date']}")
done = subprocess.run([sys.executable, os.path.join(scripts, "gpu_results.py"), work, "--write-dir", work],
                      capture_output=True, text=True)
path = done.stdout.strip()
if done.returncode != 0 or os.path.basename(path) != "2026-12-03-nvidia-h200.json":
    failures.append(f"--write-dir wrote '{path}' (rc {done.returncode}): {done.stderr}")
elif json.load(open(path)) != rows:
    failures.append(f"{path} does not hold the rows")
for f in failures:
    print("FAILED:", f)
print(f"gpu_results: {len(rows)} rows checked, {len(failures)} problems")
sys.exit(1 if failures else 0)
