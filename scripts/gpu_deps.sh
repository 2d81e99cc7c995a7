#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# For a GPU machine without apt: downloads, on a Debian machine with apt, the Debian packages that
# cupipe's build and tests need beside the CUDA toolkit (Catch2, OpenBLAS, nlohmann-json, CLI11, zlib)
# and the data the GPU run trains on (Fashion-MNIST, fortunes), as .deb files into DIR, and the cuDNN
# frontend's headers (from PyPI, through setup.sh) into DIR/cudnn-frontend. Copy DIR to the
# GPU machine and run scripts/gpu_check.sh --deps DIR there; it unpacks them with dpkg -x.
#   scripts/gpu_deps.sh DIR
set -euo pipefail
dir="${1:?usage: scripts/gpu_deps.sh DIR}"
mkdir -p "$dir"
cd "$dir"
command -v apt-get >/dev/null || { echo "gpu_deps: needs apt-get (a Debian or Ubuntu machine)" >&2; exit 1; }
apt-get download catch2 libopenblas-dev libopenblas-pthread-dev libopenblas0-pthread libgfortran5 libquadmath0 \
  nlohmann-json3-dev libcli11-dev zlib1g zlib1g-dev dataset-fashion-mnist fortunes fortunes-min
# The cuDNN frontend's headers (3 MB), for cuDNN's fused attention: the GPU machine has no pip.
# gpu_check.sh --deps DIR passes DIR/cudnn-frontend to CMake.
version=$(sed -n 's/^cudnn_frontend_version=//p' "$(dirname "${BASH_SOURCE[0]}")/setup.sh")
frontend="/usr/local/lib/cupipe/cudnn-frontend-$version"
[ -f "$frontend/include/cudnn_frontend.h" ] || bash "$(dirname "${BASH_SOURCE[0]}")/setup.sh"
rm -rf cudnn-frontend && cp -r "$frontend" cudnn-frontend
ls -l "$dir"
