#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# The whole GPU run, on any machine with an NVIDIA GPU. It builds cupipe with CUDA for the GPU in
# this machine (architecture `native`), runs every GPU and multi-GPU test, compute-sanitizer
# (memcheck, racecheck and initcheck) over the GPU test programs, the kernel benchmarks, the pipeline
# throughput benchmark, a Fashion-MNIST training run on the GPU, the GPT-2-124M-shaped training step
# and, where python3 has PyTorch, the same GPT step in PyTorch (eager and torch.compile); then it
# writes report.md and results.json into the output folder. Every step is timed, logged to
# OUT/<step>.log and reported PASS, FAIL, SKIP or TIMEOUT with the command that reproduces it; a
# failing step does not stop the others, and the exit status is non-zero when any step failed.
#
#   scripts/gpu_check.sh [--out DIR] [--build DIR] [--deps DIR] [--prebuilt PACK] [--steps LIST] [--deadline S]
#                        [--pack FILE] [--quick] [--label TEXT]
#
#   --out DIR     where the report and logs go (default out/gpu_check); the logs and results of an
#                 earlier run there are removed first
#   --build DIR   the CUDA build folder (default build/gpu)
#   --deps DIR    for a machine without apt: Debian packages unpacked here (dpkg -x), or the .deb files
#                 themselves, which are unpacked into DIR/root first. scripts/gpu_deps.sh DIR fetches
#                 them on a Debian machine: Catch2, OpenBLAS, nlohmann-json, CLI11, zlib, the data
#                 (Fashion-MNIST, fortunes) and the cuDNN frontend's headers (DIR/cudnn-frontend).
#   --prebuilt PACK  the programs scripts/gpu_pack.sh built elsewhere (its .tar.xz, or the folder it
#                 unpacks to): unpacked beside --build (prebuilt/), run with its libraries and data, no
#                 build. If they do not start here (another libc, a missing library), the script builds
#                 as without it; the step `prebuilt` in the report says PASS or FALLBACK, and why.
#   --steps LIST  a comma-separated subset of build,test,gpt,torch,sanitize,kernels,mlp,pipeline, run in
#                 the order given (build always first); the default is that list, most wanted first:
#                 what has never run on a GPU is checked before it is timed
#   --deadline S  finish within S seconds of the start, for a lease with a limit per call: 15 s are
#                 kept for the report and the pack, a step that would start with under 10 s left
#                 before them is skipped (SKIP, "deadline"), and a running one is stopped when they
#                 begin (DEADLINE; the run then exits non-zero, as for a step past its own limit,
#                 TIMEOUT)
#   --pack FILE   at the end, pack the output folder into FILE (.tgz): one file to bring back
#   --quick       fewer repeats and steps (a smoke run; its figures are not for the record)
#   --label TEXT  what is being checked, for the report (default: git describe, when there is a .git)
#
# Environment: CUPIPE_GPU_TARGETS=a,b builds only those targets; CUPIPE_SANITIZER_TIMEOUT=S bounds
# each compute-sanitizer run (default 300 s). The whole run took about 10 minutes on an H100 machine
# with 16 cores, 4 to 6 minutes of it building (docs/gpu_notes.md has a plan for a 15-minute lease).
set -uo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
out="$root/out/gpu_check"
build="$root/build/gpu"
deps=""
prebuilt=""
all_steps="build,test,gpt,torch,sanitize,kernels,mlp,pipeline"
steps="$all_steps"
quick=0
label=""
deadline=""
pack=""
started=$SECONDS
while [ $# -gt 0 ]; do
  case "$1" in
    --out|--build|--deps|--prebuilt|--steps|--deadline|--pack|--label)
      [ $# -ge 2 ] || { echo "gpu_check: $1 needs a value (see --help)" >&2; exit 2; } ;;&
    --out) out="$2"; shift 2 ;;
    --build) build="$2"; shift 2 ;;
    --deps) deps="$2"; shift 2 ;;
    --prebuilt) prebuilt="$2"; shift 2 ;;
    --steps) steps="$2"; shift 2 ;;
    --deadline) deadline="$2"; shift 2 ;;
    --pack) pack="$2"; shift 2 ;;
    --quick) quick=1; shift ;;
    --label) label="$2"; shift 2 ;;
    -h|--help) awk 'NR > 2 && /^#/ { sub(/^# ?/, ""); print; next } NR > 2 { exit }' "$0"; exit 0 ;;
    *) echo "gpu_check: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
done
for s in ${steps//,/ }; do
  case ",$all_steps," in *",$s,"*) ;;
    *) echo "gpu_check: unknown step '$s' in --steps ($all_steps)" >&2; exit 2 ;;
  esac
done
[ -n "${steps//[ ,]/}" ] || { echo "gpu_check: --steps names no step ($all_steps)" >&2; exit 2; }
if [ -n "$prebuilt" ] && [ ! -e "$prebuilt" ]; then
  echo "gpu_check: --prebuilt $prebuilt does not exist (scripts/gpu_pack.sh makes it)" >&2; exit 2
fi
if [ -n "$deadline" ] && ! { [[ "$deadline" =~ ^[1-9][0-9]*$ ]] && [ "$deadline" -ge 30 ]; }; then
  echo "gpu_check: --deadline takes whole seconds, at least 30 (15 are kept for the report), got '$deadline'" >&2; exit 2
fi
wants() { [[ ",$steps," == *",$1,"* ]]; }
mkdir -p "$out" || { echo "gpu_check: cannot create $out" >&2; exit 2; }
out="$(cd "$out" && pwd -P)"
# What an earlier run left here would otherwise be reported as this run's.
rm -f "$out"/*.log "$out"/steps.tsv "$out"/report.md "$out"/results.json "$out"/machine.txt "$out"/kernels.json \
  "$out"/pipeline.json "$out"/torch.jsonl "$out"/sdpa.json
if [ -n "$pack" ]; then
  mkdir -p "$(dirname "$pack")" && pack="$(cd "$(dirname "$pack")" && pwd -P)/$(basename "$pack")" ||
    { echo "gpu_check: cannot create the folder of --pack $pack" >&2; exit 2; }
  case "$pack" in "$out"/*) echo "gpu_check: --pack $pack lies inside --out $out" >&2; exit 2 ;; esac
fi
jobs="$(nproc)"
if ! command -v nvcc >/dev/null && [ -x /usr/local/cuda/bin/nvcc ]; then export PATH="/usr/local/cuda/bin:$PATH"; fi
command -v nvcc >/dev/null || { echo "gpu_check: no nvcc on PATH or in /usr/local/cuda/bin" >&2; exit 2; }
command -v nvidia-smi >/dev/null && nvidia-smi -L >/dev/null 2>&1 ||
  { echo "gpu_check: nvidia-smi finds no GPU; this script needs one" >&2; exit 2; }
if [ -z "$label" ] && git -C "$root" rev-parse --git-dir >/dev/null 2>&1; then
  label="$(git -C "$root" describe --always --dirty)"
fi

# ---- the Debian-only pieces, from a folder -------------------------------------------------------
cmake_args=()
if [ -n "$deps" ]; then
  [ -d "$deps" ] || { echo "gpu_check: --deps $deps is not a folder" >&2; exit 2; }
  prefix="$(cd "$deps" && pwd)"
  if compgen -G "$prefix/*.deb" >/dev/null; then
    command -v dpkg >/dev/null || { echo "gpu_check: $deps holds .deb files but there is no dpkg to unpack them" >&2; exit 2; }
    mkdir -p "$prefix/root"
    for f in "$prefix"/*.deb; do dpkg -x "$f" "$prefix/root" || { echo "gpu_check: dpkg -x $f failed" >&2; exit 2; }; done
    prefix="$prefix/root"
  fi
  lib="$prefix/usr/lib/x86_64-linux-gnu"
  cmake_args+=("-DCMAKE_PREFIX_PATH=$prefix/usr" "-DCMAKE_LIBRARY_PATH=$lib/openblas-pthread;$lib")
  if [ -f "$prefix/usr/include/x86_64-linux-gnu/openblas-pthread/cblas.h" ]; then
    cmake_args+=("-DCUPIPE_CBLAS_INCLUDE_DIR=$prefix/usr/include/x86_64-linux-gnu/openblas-pthread")
  fi
  # Debian's libz.so points at an absolute /lib path; link the soname itself.
  if [ -e "$prefix/lib/x86_64-linux-gnu/libz.so.1" ] && [ -f "$prefix/usr/include/zlib.h" ]; then
    cmake_args+=("-DZLIB_INCLUDE_DIR=$prefix/usr/include" "-DZLIB_LIBRARY=$prefix/lib/x86_64-linux-gnu/libz.so.1")
  fi
  [ -d "$prefix/usr/share/games/fortunes" ] && cmake_args+=("-DCUPIPE_FORTUNES_DIR=$prefix/usr/share/games/fortunes")
  # The cuDNN frontend's headers (gpu_deps.sh puts them beside the .deb files): cuDNN's attention.
  [ -f "$(cd "$deps" && pwd)/cudnn-frontend/include/cudnn_frontend.h" ] &&
    cmake_args+=("-DCUDNN_FRONTEND_ROOT=$(cd "$deps" && pwd)/cudnn-frontend")
  [ -d "$prefix/usr/share/datasets/fashion-mnist" ] && cmake_args+=("-DCUPIPE_FASHION_MNIST_DIR=$prefix/usr/share/datasets/fashion-mnist")
  export LD_LIBRARY_PATH="$lib/openblas-pthread:$lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
fi
fashion="${CUPIPE_FASHION_MNIST_DIR:-}"
for c in "${cmake_args[@]}"; do [[ "$c" == -DCUPIPE_FASHION_MNIST_DIR=* ]] && fashion="${c#*=}"; done
[ -n "$fashion" ] || fashion=/usr/share/datasets/fashion-mnist
export OPENBLAS_NUM_THREADS="${OPENBLAS_NUM_THREADS:-1}"

# ---- steps: each logged, timed and recorded ------------------------------------------------------
: >"$out/steps.tsv"
failed=0
# step NAME [--limit S] COMMAND...: runs the command with its output in OUT/NAME.log, stopped after S
# seconds (TIMEOUT) or at the deadline (DEADLINE), whichever comes first, and records the outcome. With
# --deadline, a step with under 10 s left is skipped instead. One `timeout` per step: a nested one would
# put the command in a process group of its own, which the outer one's kill would not reach.
seconds_left() { echo $(( deadline - 15 - (SECONDS - started) )); }
skip_for_deadline() { skip "$1" "deadline: ${deadline} s, $(( SECONDS - started )) s gone"; }
step() {
  local name="$1"; shift
  local t0 t1 rc status limit="" left="" cause=TIMEOUT
  if [ "${1:-}" = --limit ]; then limit="$2"; shift 2; fi
  if [ -n "$deadline" ]; then
    left=$(seconds_left)
    if [ "$left" -lt 10 ]; then skip_for_deadline "$name"; return 0; fi
    if [ -z "$limit" ] || [ "$left" -lt "$limit" ]; then limit="$left"; cause=DEADLINE; fi
  fi
  echo "== $name: $*"
  t0=$(date +%s.%N)
  if [ -n "$limit" ]; then
    ( cd "$root" && timeout --kill-after=5 "$limit" "$@" ) >"$out/$name.log" 2>&1
  else
    ( cd "$root" && "$@" ) >"$out/$name.log" 2>&1
  fi
  rc=$?
  t1=$(date +%s.%N)
  if [ $rc -eq 0 ]; then status=PASS; elif [ $rc -eq 77 ]; then status=SKIP
  elif [ -n "$limit" ] && { [ $rc -eq 124 ] || [ $rc -eq 137 ]; }; then status=$cause; failed=1
  else status=FAIL; failed=1; fi
  local secs; secs=$(awk -v a="$t0" -v b="$t1" 'BEGIN { printf "%.1f", b - a }')
  printf '%s\t%s\t%s\t%s\n' "$name" "$status" "$secs" "$*" >>"$out/steps.tsv"
  echo "   $status (rc $rc) in $secs s; log: $out/$name.log"
  tail -n 3 "$out/$name.log" | sed 's/^/   | /'
  return 0
}
skip() { printf '%s\tSKIP\t0\t%s\n' "$1" "$2" >>"$out/steps.tsv"; echo "== $1: SKIP ($2)"; }

{
  echo "date: $(date -u '+%Y-%m-%d %H:%M:%S UTC')"
  echo "checked: ${label:-unknown}"
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm,power.limit --format=csv,noheader | sed 's/^/gpu: /'
  echo "nvcc: $(nvcc --version | sed -n 's/.*release \([0-9.]*\), \(V[0-9.]*\).*/\1 (\2)/p')"
  echo "cmake: $(cmake --version | head -1)"
  echo "host: $(uname -sr), $(nproc) cores, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ //')"
  command -v python3 >/dev/null && python3 -c 'import torch; print("torch:", torch.__version__, "CUDA", torch.version.cuda)' 2>/dev/null
  command -v compute-sanitizer >/dev/null && echo "compute-sanitizer: $(compute-sanitizer --version | tail -1)"
} >"$out/machine.txt"
cat "$out/machine.txt"

# ---- programs built elsewhere (gpu_pack.sh), when given and when they start here ------------------
use_prebuilt() {
  local from="$prebuilt" dir t0 why=""
  dir="$(dirname "$build")/prebuilt"
  t0=$(date +%s.%N)
  if [ -d "$from" ]; then
    dir="$(cd "$from" && pwd)"
    [ -d "$dir/gpu-pack" ] && dir="$dir/gpu-pack"
  else
    rm -rf "$dir" && mkdir -p "$dir" || why="could not create $dir"
    if [ -z "$why" ] && command -v xz >/dev/null; then tar -xJf "$from" -C "$dir" || why="could not unpack $from"
    elif [ -z "$why" ]; then  # no xz here: Python's tarfile reads .tar.xz itself
      python3 -c 'import sys, tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2])' "$from" "$dir" || why="could not unpack $from"
    fi
    dir="$dir/gpu-pack"
  fi
  if [ -z "$why" ] && [ ! -x "$dir/build/tests/cuda/test_cuda_ops" ] && [ ! -x "$dir/build/bench/gpt_step/bench_gpt_step" ]; then
    why="$from holds no GPU programs"
  fi
  if [ -z "$why" ]; then
    export LD_LIBRARY_PATH="$dir/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    # A program that starts can list its tests or print its help without touching the GPU.
    local probe="$dir/build/tests/cuda/test_cuda_ops" probe_args=(--list-tests)
    [ -x "$probe" ] || { probe="$dir/build/bench/gpt_step/bench_gpt_step"; probe_args=(--help); }
    local said rc
    said=$(timeout 30 "$probe" "${probe_args[@]}" 2>&1 >/dev/null); rc=$?
    said=$(head -3 <<<"$said")
    if [ "$rc" = 126 ] || [ "$rc" = 127 ] || [[ "$said" == *"error while loading shared libraries"* ]] ||
       [[ "$said" == *"GLIBC"*"not found"* ]]; then
      why="$(basename "$probe") does not start here: ${said:-exit $rc}"
    fi
  fi
  local secs; secs=$(awk -v a="$t0" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f", b - a }')
  if [ -n "$why" ]; then
    printf 'prebuilt\tFALLBACK\t%s\t%s\n' "$secs" "building here instead: $why" >>"$out/steps.tsv"
    echo "== prebuilt: FALLBACK ($why); building here instead"
    return 1
  fi
  build="$dir/build"
  [ -d "$dir/data/fashion-mnist" ] && fashion="$dir/data/fashion-mnist"
  printf 'prebuilt\tPASS\t%s\t%s\n' "$secs" "the programs of $from ($(sed -n 's/^commit: //p' "$dir/manifest.txt" 2>/dev/null)), no build" >>"$out/steps.tsv"
  echo "== prebuilt: PASS, running $build"
  return 0
}

targets=(test_cuda_ops test_cuda_pipeline gpt_train mlp_fashion_mnist bench_kernels bench_gpt_step pipeline_throughput)
if [ -n "${CUPIPE_GPU_TARGETS:-}" ]; then read -ra targets <<<"${CUPIPE_GPU_TARGETS//,/ }"; fi
run_build() {
  step configure cmake -S "$root" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_ARCHITECTURES=native \
    -DCUPIPE_ENABLE_CUDA=ON -DCUPIPE_BUILD_TESTS=ON -DCUPIPE_BUILD_EXAMPLES=ON -DCUPIPE_BUILD_BENCH=ON \
    "-DCUPIPE_TEST_AREAS_ONLY=cuda;comm;examples" "${cmake_args[@]}"
  # NCCL's two-rank check exists where NCCL and MPI were found (it skips with fewer than two GPUs).
  if cmake --build "$build" --target help 2>/dev/null | grep -q "^nccl_check:"; then targets+=(nccl_check); fi
  step build cmake --build "$build" -j "$jobs" --target "${targets[@]}"
}
bin_ok() { [ -x "$build/$1" ]; }

run_test() {
  if bin_ok tests/cuda/test_cuda_ops && [ -f "$build/CTestTestfile.cmake" ]; then
    # Serially: a GPU test that times two streams against one kernel alone wants the GPU to itself.
    step test ctest --test-dir "$build" --output-on-failure --timeout 300 -L "gpu|multi_gpu" -LE headers
  elif bin_ok tests/cuda/test_cuda_ops; then  # prebuilt: no ctest files, the programs themselves
    step test --limit 300 "$build/tests/cuda/test_cuda_ops"
    bin_ok tests/cuda/test_cuda_pipeline && step test_pipeline --limit 300 "$build/tests/cuda/test_cuda_pipeline" "~[multi_gpu]"
  else skip test "the build did not produce the test programs"; fi
}

run_mlp() {
  if bin_ok examples/mlp_fashion_mnist/mlp_fashion_mnist && [ -d "$fashion" ]; then
    step mlp --limit 180 "$build/examples/mlp_fashion_mnist/mlp_fashion_mnist" --backend cuda --data "$fashion" --stages 2 \
      --schedule 1f1b --epochs "$([ $quick = 1 ] && echo 1 || echo 3)" --progress lines
    # bf16 beyond 1F1B and GPipe on CUDA (ZB-H1: a flush schedule, in gpu_pack.sh's pack too), which no
    # GPU has run yet.
    step mlp_zbh1_bf16 --limit 120 "$build/examples/mlp_fashion_mnist/mlp_fashion_mnist" --backend cuda --data "$fashion" \
      --stages 2 --schedule zb-h1 --precision bf16 --epochs 1 --progress lines
  else skip mlp "no mlp_fashion_mnist or no Fashion-MNIST in $fashion"; fi
}
run_sanitize() {
  if command -v compute-sanitizer >/dev/null && bin_ok tests/cuda/test_cuda_ops; then
    # Each under a deadline (TIMEOUT in the report): the tools slow kernels down many times over.
    cs=(--limit "${CUPIPE_SANITIZER_TIMEOUT:-300}" compute-sanitizer --error-exitcode 1 --print-limit 20)
    # API errors are not reported: the tests provoke some on purpose (the pool's out-of-memory path), and
    # the library checks every API call's return code itself; kernels' accesses are what is checked here.
    step memcheck_ops "${cs[@]}" --tool memcheck --leak-check full --report-api-errors no "$build/tests/cuda/test_cuda_ops"
    step memcheck_pipeline "${cs[@]}" --tool memcheck --leak-check full --report-api-errors no \
      "$build/tests/cuda/test_cuda_pipeline" "~[multi_gpu]"
    step racecheck_ops "${cs[@]}" --tool racecheck --racecheck-report hazard "$build/tests/cuda/test_cuda_ops"
    step initcheck_ops "${cs[@]}" --tool initcheck "$build/tests/cuda/test_cuda_ops"
    step initcheck_pipeline "${cs[@]}" --tool initcheck "$build/tests/cuda/test_cuda_pipeline" "~[multi_gpu]"
  else skip sanitize "no compute-sanitizer or no test programs"; fi
}

repeats=(); [ $quick = 1 ] && repeats=(--quick)
run_kernels() {
  if bin_ok bench/kernels/bench_kernels; then
    step kernels --limit 300 "$build/bench/kernels/bench_kernels" --json "$out/kernels.json" "${repeats[@]}"
  else skip kernels "no bench_kernels"; fi
}
run_pipeline() {
  if bin_ok bench/pipeline_throughput/pipeline_throughput; then
    step pipeline --limit 300 "$build/bench/pipeline_throughput/pipeline_throughput" --models mlp,wide --stages 2,4 \
      --microbatches 8,16,32 --json "$out/pipeline.json"
  else skip pipeline "no pipeline_throughput"; fi
}
gpt_steps=20; [ $quick = 1 ] && gpt_steps=5
run_gpt() {
  if bin_ok bench/gpt_step/bench_gpt_step; then
    # bf16 first: its default attention (auto) is cuDNN's fused SDPA, which has never run on a GPU.
    step gpt_bf16 --limit 180 "$build/bench/gpt_step/bench_gpt_step" --batch 8 --steps $gpt_steps --precision bf16
    step gpt_bf16_b64 --limit 240 "$build/bench/gpt_step/bench_gpt_step" --batch 64 --microbatches 8 --steps 5 --precision bf16
    step gpt_bf16_mma --limit 180 "$build/bench/gpt_step/bench_gpt_step" --batch 8 --steps $gpt_steps --precision bf16 --attention mma
    step gpt_bf16_tiled --limit 180 "$build/bench/gpt_step/bench_gpt_step" --batch 8 --steps $gpt_steps --precision bf16 --attention tiled
    step gpt_tf32 --limit 180 "$build/bench/gpt_step/bench_gpt_step" --batch 8 --steps $gpt_steps --math tf32
    step gpt_tf32_tiled --limit 180 "$build/bench/gpt_step/bench_gpt_step" --batch 8 --steps $gpt_steps --math tf32 --attention tiled
    step gpt_fp32 --limit 180 "$build/bench/gpt_step/bench_gpt_step" --batch 8 --steps $gpt_steps --math fp32
  else skip gpt "no bench_gpt_step"; fi
}
run_torch() {
  if command -v python3 >/dev/null &&
     timeout 60 python3 -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
    py=(python3 "$root/bench/gpt_step/gpt2_pytorch.py" --batch 8 --steps $gpt_steps --json "$out/torch.jsonl")
    rm -f "$out/torch.jsonl"
    step torch_eager_tf32 "${py[@]}" --precision tf32
    step torch_eager_bf16 "${py[@]}" --precision bf16
    step torch_compile_tf32 "${py[@]}" --precision tf32 --compile
    step torch_compile_bf16 "${py[@]}" --precision bf16 --compile
    step torch_sdpa python3 "$root/bench/gpt_step/sdpa_pytorch.py" --json "$out/sdpa.json"
  else skip torch "no python3 with PyTorch and CUDA"; fi
}

# Build first (unless programs built elsewhere start here), then the other steps in the order --steps gives.
if [ -n "$prebuilt" ] && use_prebuilt; then :; else wants build && run_build; fi
for s in ${steps//,/ }; do
  [ "$s" = build ] && continue
  # A group's own checks (torch's import) must not eat the time kept for the report either.
  if [ -n "$deadline" ] && [ "$(seconds_left)" -lt 10 ]; then skip_for_deadline "$s"; continue; fi
  "run_$s"
done

# ---- the report ----------------------------------------------------------------------------------
{
  echo "# cupipe GPU check"
  echo
  sed 's/^/    /' "$out/machine.txt"
  echo
  echo "| step | result | seconds | command |"
  echo "| --- | --- | --- | --- |"
  while IFS=$'\t' read -r name status secs cmd; do
    echo "| $name | $status | $secs | \`${cmd//|/\\|}\` |"
  done <"$out/steps.tsv"
  for f in test test_pipeline memcheck_ops memcheck_pipeline racecheck_ops initcheck_ops initcheck_pipeline; do
    [ -f "$out/$f.log" ] || continue
    echo; echo "## $f"; echo; echo '```'
    grep -E "tests passed|tests failed|Failed|\*\*\*|ERROR SUMMARY|RACECHECK SUMMARY|LEAK SUMMARY|Skipped|Not Run" "$out/$f.log" | head -40
    echo '```'
  done
  for f in kernels pipeline mlp gpt_bf16 gpt_bf16_b64 gpt_bf16_mma gpt_bf16_tiled gpt_tf32 gpt_tf32_tiled gpt_fp32 torch_eager_tf32 \
           torch_eager_bf16 torch_compile_tf32 torch_compile_bf16 torch_sdpa; do
    [ -f "$out/$f.log" ] || continue
    echo; echo "## $f"; echo; echo '```'
    case "$f" in
      mlp) grep -vE "^\s*$" "$out/$f.log" | tail -15 ;;
      kernels|pipeline) cat "$out/$f.log" ;;
      *) tail -5 "$out/$f.log" ;;
    esac
    echo '```'
  done
} >"$out/report.md"

python3 - "$out" <<'EOF' || echo "gpu_check: results.json not written (python3 failed)"
import json, os, sys
out = sys.argv[1]
res = {"machine": open(os.path.join(out, "machine.txt")).read().splitlines(), "steps": []}
for line in open(os.path.join(out, "steps.tsv")):
    name, status, secs, cmd = line.rstrip("\n").split("\t", 3)
    res["steps"].append({"name": name, "status": status, "seconds": float(secs), "command": cmd})
for key, fname in (("kernels", "kernels.json"), ("pipeline", "pipeline.json")):
    p = os.path.join(out, fname)
    if os.path.exists(p):
        try: res[key] = json.load(open(p))
        except ValueError as e: res[key] = f"unreadable: {e}"
for name in ("gpt_bf16", "gpt_bf16_b64", "gpt_bf16_mma", "gpt_bf16_tiled", "gpt_tf32", "gpt_tf32_tiled", "gpt_fp32"):
    p = os.path.join(out, name + ".log")
    if os.path.exists(p):
        lines = [l for l in open(p) if l.startswith("{")]
        if lines: res[name] = json.loads(lines[-1])
p = os.path.join(out, "torch.jsonl")
if os.path.exists(p):
    res["torch"] = [json.loads(l) for l in open(p) if l.strip()]
p = os.path.join(out, "sdpa.json")
if os.path.exists(p):
    try: res["torch_sdpa"] = json.load(open(p))
    except ValueError as e: res["torch_sdpa"] = f"unreadable: {e}"
json.dump(res, open(os.path.join(out, "results.json"), "w"), indent=1)
EOF
# The figures as rows (bench/results/<date>-<device>.json once committed): scripts/gpu_results.py.
rm -f "$out"/20[0-9][0-9]-[0-9][0-9]-[0-9][0-9]-*.json
rows=$(python3 "$root/scripts/gpu_results.py" "$out" --write-dir "$out") && echo "== rows: $rows (commit it as bench/results/$(basename "$rows"))" ||
  echo "gpu_check: the result rows were not written (python3 failed)"
echo "== report: $out/report.md"
awk -F'\t' '{ printf "%-20s %-5s %8s s\n", $1, $2, $3 }' "$out/steps.tsv"
if [ -n "$pack" ]; then
  if tar czf "$pack" -C "$(dirname "$out")" "$(basename "$out")"; then echo "== packed: $pack ($(du -h "$pack" | cut -f1))"
  else echo "gpu_check: could not pack $out into $pack" >&2; failed=1; fi
fi
echo "== done in $(( SECONDS - started )) s"
exit $failed
