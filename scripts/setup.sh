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
  dataset-fashion-mnist fortunes xz-utils
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

# cuDNN's fused attention needs the cuDNN frontend's C++ headers, which NVIDIA ships in the PyPI wheel
# nvidia-cudnn-frontend (the cuDNN 9 library itself comes with the CUDA toolkit). Only where CUDA is:
# the wheel is downloaded (no Python environment is touched) and its include/ unpacked into
# /usr/local/lib/cupipe/cudnn-frontend-<version>, where CMake looks (CUDNN_FRONTEND_ROOT overrides).
# Without it, the build leaves cuDNN's attention out and says so; nothing else changes.
cudnn_frontend_version=1.32.0
cudnn_frontend_dir=/usr/local/lib/cupipe/cudnn-frontend-$cudnn_frontend_version
if { command -v nvcc >/dev/null || [ -x /usr/local/cuda/bin/nvcc ]; } && [ ! -f "$cudnn_frontend_dir/include/cudnn_frontend.h" ]; then
  sudo=""
  if [ "$(id -u)" != 0 ] && command -v sudo >/dev/null; then sudo=sudo; fi
  wheel_dir=$(mktemp -d)
  if python3 -m pip download --quiet --disable-pip-version-check --no-deps --only-binary=:all: -d "$wheel_dir" \
       "nvidia-cudnn-frontend==$cudnn_frontend_version" >/dev/null 2>&1; then
    $sudo mkdir -p "$cudnn_frontend_dir"
    $sudo python3 - "$wheel_dir" "$cudnn_frontend_dir" <<'PY'
import glob, sys, zipfile
wheel = glob.glob(sys.argv[1] + "/*.whl")[0]
with zipfile.ZipFile(wheel) as z:
    members = [m for m in z.namelist() if m.startswith("include/") or m.endswith("LICENSE.txt")]
    z.extractall(sys.argv[2], members)
PY
    echo "setup: cuDNN frontend $cudnn_frontend_version headers in $cudnn_frontend_dir"
  else
    echo "setup: could not download nvidia-cudnn-frontend $cudnn_frontend_version from PyPI; cuDNN's attention will be left out" >&2
  fi
  rm -rf "$wheel_dir"
fi
