#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Installs what cupipe needs from Debian's packages (idempotent). The CUDA toolkit is not a Debian
# package: when nvcc is on PATH (or in /usr/local/cuda/bin) the CUDA targets are built too.
set -euo pipefail

packages=(
  build-essential cmake ninja-build ccache pkg-config
  catch2 libopenblas-dev zlib1g-dev nlohmann-json3-dev libcli11-dev
  openmpi-bin libopenmpi-dev
  clang libclang-rt-dev
  dataset-fashion-mnist fortunes
)

missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done

if ((${#missing[@]})); then
  sudo=""
  if [ "$(id -u)" != 0 ]; then
    command -v sudo >/dev/null || { echo "setup: need root (or sudo) to install: ${missing[*]}" >&2; exit 1; }
    sudo=sudo
  fi
  echo "setup: installing ${missing[*]}"
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

if ! command -v nvcc >/dev/null && [ -x /usr/local/cuda/bin/nvcc ]; then
  echo "setup: CUDA toolkit found in /usr/local/cuda (add /usr/local/cuda/bin to PATH to use it elsewhere)"
fi
