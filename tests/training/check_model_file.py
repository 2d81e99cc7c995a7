#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Checks that cupipe's model file is a PyTorch state_dict for nn.Sequential.

Usage: check_model_file.py path/to/test_checkpoint [--torch]
test_checkpoint's hidden case [.export_model] writes mlp.safetensors (a trained 6-16-12-8-3 MLP) and
io.safetensors (inputs "x" and cupipe's Pipeline::predict output "y"). We rebuild the forward pass
from the model file alone, in numpy (default) or with torch.nn.Sequential.load_state_dict (--torch),
and compare it with cupipe's output.
"""
import os
import subprocess
import sys
import tempfile

import numpy as np
from safetensors.numpy import load_file


def main():
    test_binary, use_torch = sys.argv[1], "--torch" in sys.argv[2:]
    with tempfile.TemporaryDirectory() as directory:
        env = dict(os.environ, CUPIPE_TRAINING_EXPORT_DIR=directory)
        result = subprocess.run([test_binary, "[.export_model]", "-w", "NoTests"], env=env, capture_output=True, text=True)
        if result.returncode != 0:
            sys.exit(f"{test_binary} [.export_model] failed:\n{result.stdout}\n{result.stderr}")
        model = load_file(os.path.join(directory, "mlp.safetensors"))
        io = load_file(os.path.join(directory, "io.safetensors"))

    expected = {"0.weight": (16, 6), "0.bias": (16,), "2.weight": (12, 16), "2.bias": (12,),
                "4.weight": (8, 12), "4.bias": (8,), "6.weight": (3, 8), "6.bias": (3,)}
    got = {name: tuple(t.shape) for name, t in model.items()}
    if got != expected:
        sys.exit(f"model file tensors {got}, expected {expected}")
    for name, tensor in model.items():
        if tensor.dtype != np.float32:
            sys.exit(f"{name} is {tensor.dtype}, expected float32")

    x, y = io["x"], io["y"]
    if use_torch:
        import torch
        net = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.ReLU(), torch.nn.Linear(16, 12), torch.nn.ReLU(),
                                  torch.nn.Linear(12, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
        net.load_state_dict({name: torch.from_numpy(t) for name, t in model.items()}, strict=True)
        with torch.no_grad():
            ours = net(torch.from_numpy(x)).numpy()
    else:
        h = x.astype(np.float64)
        for layer in ("0", "2", "4", "6"):
            # PyTorch's Linear: y = x W^T + b with W of shape [out, in].
            h = h @ model[layer + ".weight"].astype(np.float64).T + model[layer + ".bias"]
            if layer != "6":
                h = np.maximum(h, 0.0)
        ours = h
    error = float(np.max(np.abs(ours - y)))
    if not error <= 1e-5:
        sys.exit(f"forward pass from the model file differs from cupipe's predict by {error}:\n{ours}\nvs\n{y}")
    print(f"model file OK ({'torch' if use_torch else 'numpy'}): max |difference| {error:.2e}")


if __name__ == "__main__":
    main()
