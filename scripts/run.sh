#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# The main job on a fresh Debian machine: installs the Debian packages, builds the Fashion-MNIST
# trainer and trains it for a short run with a 4-stage 1F1B pipeline on the CPU, writing a
# checkpoint and a Chrome trace of the last step (measured next to simulated).
# Extra arguments go to the trainer, e.g. `bash scripts/run.sh --epochs 10` for the full run.
# `bash scripts/run.sh gpt [flags]` runs the GPT trainer instead: the tiny preset on Debian's
# fortunes, 1F1B on 2 stages, then a sample of what it learned.
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
bash "$root/scripts/setup.sh"
mkdir -p "$root/build"
out="$root/build/run"
mkdir -p "$out"
# trainer_build TARGET [trainer flags...]: builds only the trainer (the tests and benchmarks are
# scripts/test.sh's job) and sets $dir to its build folder. The runs below use 1F1B, so unless the
# flags pick a schedule, a precision or a plan, it compiles 1F1B alone in build/host-1f1b
# (-DCUPIPE_TRAINER_SCHEDULES=1f1b, examples/common/trainer_schedules.hpp): every schedule and
# precision took 6.3 minutes to compile on 2 cores before the first step. Such a flag builds every
# schedule, in build/host.
trainer_build() {
  local target="$1" schedules=1f1b; shift
  for a in "$@"; do
    case "$a" in --schedule* | --precision* | --plan* | --stage-backends*) schedules=all ;; esac
  done
  if [ "$schedules" = 1f1b ]; then dir="$root/build/host-1f1b"; else dir="$root/build/host"; fi
  echo "building $target ($([ "$schedules" = 1f1b ] && echo "1F1B only: the schedule this run uses" || echo "every schedule")) in ${dir#"$root/"} at $(date -u +%H:%M:%S)"
  build "$dir" -DCUPIPE_ENABLE_CUDA=OFF -DCUPIPE_BUILD_TESTS=OFF -DCUPIPE_BUILD_BENCH=OFF \
    -DCUPIPE_TRAINER_SCHEDULES="$schedules" -- "$target" >/dev/null
  echo "built at $(date -u +%H:%M:%S)"
}

if [ "${1:-}" = gpt ]; then
  shift
  trainer_build gpt_train "$@"
  "$dir/examples/gpt_train/gpt_train" --schedule 1f1b --stages 2 --microbatches 4 --steps 600 \
    --save "$out/gpt" --sample 300 "$@"
  echo "checkpoint: $out/gpt.safetensors (nanoGPT state_dict names) + $out/gpt.state.safetensors"
  exit 0
fi
trainer_build mlp_fashion_mnist "$@"
"$dir/examples/mlp_fashion_mnist/mlp_fashion_mnist" \
  --schedule 1f1b --stages 4 --microbatches 8 --epochs 1 --train-limit 12000 \
  --save "$out/fashion_mnist" --trace "$out/fashion_mnist.trace.json" "$@"
echo "checkpoint: $out/fashion_mnist.safetensors (PyTorch state_dict names) + $out/fashion_mnist.state.safetensors"
echo "trace:      $out/fashion_mnist.trace.json (open in https://ui.perfetto.dev or chrome://tracing)"
