#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Checks cupipe's safetensors files against Python's safetensors, both ways.

Usage: check_safetensors.py path/to/test_io
test_io's hidden case [.interop_write] writes from_cpp.safetensors, which we load and check here;
we write from_python.safetensors, which its hidden case [.interop_read] loads and checks.
"""
import os
import subprocess
import sys
import tempfile

import numpy as np
from safetensors import deserialize, safe_open
from safetensors.numpy import save_file


def run_test_io(test_io, tag, directory):
    env = dict(os.environ, CUPIPE_IO_INTEROP_DIR=directory)
    # -w NoTests: fail, rather than pass vacuously, if the tag matches no test case.
    result = subprocess.run([test_io, tag, "-w", "NoTests"], env=env, capture_output=True, text=True)
    if result.returncode != 0:
        sys.exit(f"{test_io} {tag} failed:\n{result.stdout}\n{result.stderr}")


def bf16_to_f32(raw):
    return (np.frombuffer(raw, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)


def check_cpp_file(path):
    with safe_open(path, framework="np") as f:
        assert f.metadata() == {"format": "pt", "step": "100"}, f.metadata()
    # BF16 has no numpy dtype: load the others by name, and check BF16's raw bytes below.
    with safe_open(path, framework="np") as f:
        tensors = {name: f.get_tensor(name) for name in f.keys() if name != "half.bf16"}
    np.testing.assert_array_equal(
        tensors["weights.f32"],
        np.array([[1.5, -2.0, 0.25], [3.0e-8, -0.0, 65504.0]], dtype=np.float32))
    assert tensors["weights.f32"].dtype == np.float32
    np.testing.assert_array_equal(tensors["bias.f64"], np.array([3.141592653589793, -1e300]))
    np.testing.assert_array_equal(tensors["counts.i32"], np.array([[-7], [0], [2147483647]], dtype=np.int32))
    np.testing.assert_array_equal(tensors["big.i64"], np.array([-9000000000000000000, 42], dtype=np.int64))
    np.testing.assert_array_equal(tensors["pixels.u8"], np.array([0, 127, 255], dtype=np.uint8))

    with open(path, "rb") as f:
        raw = dict(deserialize(f.read()))
    half = raw["half.bf16"]
    assert half["dtype"] in ("bfloat16", "BF16"), half["dtype"]
    assert list(half["shape"]) == [2, 2], half["shape"]
    values = bf16_to_f32(bytes(half["data"]))
    np.testing.assert_array_equal(values[:3], np.array([1.0, -0.5, 3.0], dtype=np.float32))
    assert abs(values[3] / 1e10 - 1) < 1e-2, values[3]


def write_python_file(path):
    save_file({
        "f32": np.array([[0.5, -1.0], [2.0, 1e-3]], dtype=np.float32),
        "f64": np.array([1.0 / 3.0, -2.5, 1e100]),
        "i32": np.array([-123, 456], dtype=np.int32),
        "i64": np.array([1 << 40], dtype=np.int64),
        "u8": np.array([[[1, 2]], [[3, 250]]], dtype=np.uint8),
        "f16": np.array([1.0, -2.0, 0.5], dtype=np.float16),
    }, path, metadata={"written_by": "python"})


def main():
    test_io = sys.argv[1]
    with tempfile.TemporaryDirectory(prefix="cupipe-io-interop-") as directory:
        run_test_io(test_io, "[.interop_write]", directory)
        check_cpp_file(os.path.join(directory, "from_cpp.safetensors"))
        write_python_file(os.path.join(directory, "from_python.safetensors"))
        run_test_io(test_io, "[.interop_read]", directory)
    print("safetensors interop: C++ -> Python and Python -> C++ agree")


if __name__ == "__main__":
    main()
