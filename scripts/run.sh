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
if [ "${1:-}" = gpt ]; then
  shift
  build "$root/build/host" -DCUPIPE_ENABLE_CUDA=OFF -DCUPIPE_BUILD_TESTS=OFF -DCUPIPE_BUILD_BENCH=OFF -- gpt_train >/dev/null
  "$root/build/host/examples/gpt_train/gpt_train" --schedule 1f1b --stages 2 --microbatches 4 --steps 600 \
    --save "$out/gpt" --sample 300 "$@"
  echo "checkpoint: $out/gpt.safetensors (nanoGPT state_dict names) + $out/gpt.state.safetensors"
  exit 0
fi
# Only the trainer: the tests and benchmarks are scripts/test.sh's job, and building them first
# would hold training back by minutes (test.sh turns them back on in this build dir).
build "$root/build/host" -DCUPIPE_ENABLE_CUDA=OFF -DCUPIPE_BUILD_TESTS=OFF -DCUPIPE_BUILD_BENCH=OFF \
  -- mlp_fashion_mnist >/dev/null
"$root/build/host/examples/mlp_fashion_mnist/mlp_fashion_mnist" \
  --schedule 1f1b --stages 4 --microbatches 8 --epochs 1 --train-limit 12000 \
  --save "$out/fashion_mnist" --trace "$out/fashion_mnist.trace.json" "$@"
echo "checkpoint: $out/fashion_mnist.safetensors (PyTorch state_dict names) + $out/fashion_mnist.state.safetensors"
echo "trace:      $out/fashion_mnist.trace.json (open in https://ui.perfetto.dev or chrome://tracing)"
