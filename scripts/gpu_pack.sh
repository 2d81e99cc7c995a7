#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Builds the GPU programs here, where building costs no device time, and packs them into one file
# that travels with the working tree to a lent GPU machine (64 MiB may travel per call in all), where
# `scripts/gpu_check.sh --prebuilt FILE` runs them without building. The GPU machine has the same
# CUDA toolkit (nvcc 13.0, cuBLAS, cuDNN, NCCL) but no apt: the pack holds the programs (Release,
# stripped, device code for sm_90: H100 and H200), every library they load from outside the CUDA
# toolkit and the C and C++ runtimes (OpenBLAS and its Fortran runtime), and the data the runs read
# (Fashion-MNIST, fortunes).
#
#   scripts/gpu_pack.sh [--out FILE] [--build DIR] [--max-mib N] [--no-data]
#
#   --out FILE     the pack, a .tar.xz (default gpu-pack.tar.xz at the top of the checkout, git-ignored)
#   --build DIR    the build folder (default build/gpu-pack)
#   --max-mib N    refuse to write a pack larger than this (default 56: the rest of 64 MiB is the tree)
#   --no-data      leave Fashion-MNIST (30 MB) out; the mlp step then skips
#
# CUPIPE_GPU_TARGETS=a,b packs only those targets. It prints what the pack holds and its size, and
# exits non-zero, writing nothing, when the pack would be over the limit.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
out="$root/gpu-pack.tar.xz"
build="$root/build/gpu-pack"
max_mib=56
data=1
while [ $# -gt 0 ]; do
  case "$1" in
    --out|--build|--max-mib) [ $# -ge 2 ] || { echo "gpu_pack: $1 needs a value" >&2; exit 2; } ;;&
    --out) out="$2"; shift 2 ;;
    --build) build="$2"; shift 2 ;;
    --max-mib) max_mib="$2"; shift 2 ;;
    --no-data) data=0; shift ;;
    -h|--help) awk 'NR > 2 && /^#/ { sub(/^# ?/, ""); print; next } NR > 2 { exit }' "$0"; exit 0 ;;
    *) echo "gpu_pack: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
done
[[ "$max_mib" =~ ^[1-9][0-9]*$ ]] || { echo "gpu_pack: --max-mib takes a whole number of MiB, got '$max_mib'" >&2; exit 2; }
if ! command -v nvcc >/dev/null && [ -x /usr/local/cuda/bin/nvcc ]; then export PATH="/usr/local/cuda/bin:$PATH"; fi
command -v nvcc >/dev/null || { echo "gpu_pack: no nvcc on PATH or in /usr/local/cuda/bin" >&2; exit 2; }
command -v xz >/dev/null || { echo "gpu_pack: needs xz (xz-utils)" >&2; exit 2; }

# The programs gpu_check.sh runs, at the paths it looks for them under its build folder.
programs=(tests/cuda/test_cuda_ops tests/cuda/test_cuda_pipeline examples/gpt_train/gpt_train
          examples/mlp_fashion_mnist/mlp_fashion_mnist bench/kernels/bench_kernels bench/gpt_step/bench_gpt_step
          bench/pipeline_throughput/pipeline_throughput)
if [ -n "${CUPIPE_GPU_TARGETS:-}" ]; then
  wanted=",${CUPIPE_GPU_TARGETS},"
  kept=()
  for p in "${programs[@]}"; do [[ "$wanted" == *",$(basename "$p"),"* ]] && kept+=("$p"); done
  [ ${#kept[@]} -gt 0 ] || { echo "gpu_pack: CUPIPE_GPU_TARGETS names none of: ${programs[*]##*/}" >&2; exit 2; }
  programs=("${kept[@]}")
fi
targets=()
for p in "${programs[@]}"; do targets+=("$(basename "$p")"); done

# Release for Hopper alone (sm_90 code and compute_90 PTX): no kernel uses sm_90a's wgmma yet. MPI is
# off: the GPU machine has no MPI, and these runs are one process. The trainers keep the flush
# schedules, in fp32 and bf16: their two-chunk and asynchronous families on CUDA
# (trainer_cuda_other.cu) would make gpt_train several times larger and the build longer; a build on
# the GPU machine (gpu_check.sh without --prebuilt) has them, and runs examples:*_cuda_schedules.
echo "== configure and build ${targets[*]} in $build"
cmake -S "$root" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_ARCHITECTURES=90 \
  -DCUPIPE_ENABLE_CUDA=ON -DCUPIPE_ENABLE_MPI=OFF -DCUPIPE_BUILD_TESTS=ON -DCUPIPE_BUILD_EXAMPLES=ON -DCUPIPE_BUILD_BENCH=ON \
  -DCUPIPE_TRAINER_SCHEDULES=flush "-DCUPIPE_TEST_AREAS_ONLY=cuda;examples" >"$build.configure.log" 2>&1 ||
  { cat "$build.configure.log"; exit 1; }
grep "cupipe" "$build.configure.log" || true
grep -q "cuDNN's fused attention on" "$build.configure.log" ||
  echo "gpu_pack: warning: this build leaves cuDNN's attention out (scripts/setup.sh installs the frontend's headers)" >&2
cmake --build "$build" -j "$(nproc)" --target "${targets[@]}"

stage="$(mktemp -d)"
trap 'rm -rf "$stage"' EXIT
pack="$stage/gpu-pack"
mkdir -p "$pack/lib"
# A library is the GPU machine's own when it belongs to the CUDA toolkit (same release there) or to
# the base system every Linux has (glibc, libstdc++, libgcc); everything else travels in lib/.
system_lib='^(linux-vdso|ld-linux|libc|libm|libdl|librt|libpthread|libstdc\+\+|libgcc_s)\.so'
for p in "${programs[@]}"; do
  [ -x "$build/$p" ] || { echo "gpu_pack: $build/$p was not built" >&2; exit 1; }
  mkdir -p "$pack/build/$(dirname "$p")"
  strip --strip-unneeded -o "$pack/build/$p" "$build/$p"
  while read -r name _ path _; do
    [ -n "$path" ] && [ -f "$path" ] || continue
    [[ "$name" =~ $system_lib ]] && continue
    case "$(readlink -f "$path")" in /usr/local/cuda*) continue ;; esac
    [ -f "$pack/lib/$name" ] || cp -L "$path" "$pack/lib/$name"
  done < <(ldd "$build/$p" | awk '/=>/ { print $1, $2, $3, $4 }')
done
if [ $data = 1 ]; then
  mkdir -p "$pack/data"
  [ -d /usr/share/datasets/fashion-mnist ] && cp -r /usr/share/datasets/fashion-mnist "$pack/data/"
  [ -d /usr/share/games/fortunes ] && cp -r /usr/share/games/fortunes "$pack/data/"
fi
{
  echo "commit: $(git -C "$root" describe --always --dirty 2>/dev/null || echo unknown)"
  echo "packed: $(date -u '+%Y-%m-%d %H:%M:%S UTC') on $(uname -sr)"
  echo "nvcc: $(nvcc --version | sed -n 's/.*release \([0-9.]*\), \(V[0-9.]*\).*/\1 (\2)/p')"
  echo "device code: sm_90, compute_90"
  grep "cuDNN's fused attention" "$build.configure.log" | sed 's/^-- //' || echo "cupipe: cuDNN's attention left out"
  (cd "$pack" && find build lib data -type f 2>/dev/null | sort | while read -r f; do
     printf '%10d  %s\n' "$(stat -c %s "$f")" "$f"; done)
} >"$pack/manifest.txt"

tar -C "$stage" -cf - gpu-pack | xz -T"$(nproc)" -6 >"$stage/pack.tar.xz"
bytes=$(stat -c %s "$stage/pack.tar.xz")
unpacked=$(du -sb "$pack" | cut -f1)
mib() { awk -v b="$1" 'BEGIN { printf "%.1f MiB", b / 1048576 }'; }
cat "$pack/manifest.txt"
echo "gpu_pack: $(mib "$bytes") packed ($(mib "$unpacked") unpacked), limit $max_mib MiB"
if [ "$bytes" -gt $(( max_mib * 1048576 )) ]; then
  echo "gpu_pack: the pack is over the $max_mib MiB limit; nothing written (try --no-data or CUPIPE_GPU_TARGETS)" >&2
  exit 1
fi
mkdir -p "$(dirname "$out")"
mv "$stage/pack.tar.xz" "$out"
echo "gpu_pack: wrote $out; carry it and run: bash scripts/gpu_check.sh --prebuilt $(basename "$out") ..."
