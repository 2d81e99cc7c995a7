# SPDX-License-Identifier: Apache-2.0
"""PyTorch's scaled_dot_product_attention at bench_kernels' attention shape, for a side-by-side row.

Shape: 8 sequences of T tokens (default 1024), 12 heads of 64 columns, causal, bf16. Each backend
(flash, cuDNN, efficient) that PyTorch will run is timed for the forward and for the backward alone
(the forward's graph kept, the backward replayed with retain_graph), with CUDA events, median of the
repetitions after a warm-up. FLOPs are counted as bench_kernels counts them: forward 2 products and
backward 5, each 2 * T (T + 1) / 2 * D per sequence and head.

    python3 bench/gpt_step/sdpa_pytorch.py [--context 1024] [--reps 50] [--json out.json]

Needs PyTorch 2.x with CUDA; a benchmark, never a test (CI does not run it).
"""
import argparse
import json
import statistics
import sys


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--reps", type=int, default=50)
    parser.add_argument("--json", default="")
    args = parser.parse_args()
    try:
        import torch
        import torch.nn.functional as F
        from torch.nn.attention import SDPBackend, sdpa_kernel
    except ImportError as e:
        print(f"sdpa_pytorch: PyTorch 2.x is needed ({e})", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("sdpa_pytorch: no CUDA device", file=sys.stderr)
        return 2
    B, H, T, D = 8, 12, args.context, 64
    pairs = B * H * T * (T + 1) / 2
    flops = {"forward": 2 * 2 * pairs * D, "backward": 5 * 2 * pairs * D}
    gen = torch.Generator(device="cuda").manual_seed(0)

    def tensor():
        return (torch.rand(B, T, H, D, device="cuda", dtype=torch.bfloat16, generator=gen) * 2 - 1).transpose(1, 2)

    results = []
    backends = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
                "efficient": SDPBackend.EFFICIENT_ATTENTION}
    for name, backend in backends.items():
        q, k, v = (tensor().requires_grad_() for _ in range(3))
        dout = tensor()
        try:
            with sdpa_kernel(backend):
                out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
                out.backward(dout, retain_graph=True)
        except RuntimeError as e:
            print(f"{name}: not available ({str(e).splitlines()[0]})")
            continue
        for pass_name in ("forward", "backward"):
            times = []
            for rep in range(args.reps + 5):
                start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                with sdpa_kernel(backend):
                    if pass_name == "forward":
                        start.record()
                        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
                        stop.record()
                    else:
                        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
                        start.record()
                        out.backward(dout, retain_graph=True)
                        stop.record()
                torch.cuda.synchronize()
                if rep >= 5:
                    times.append(start.elapsed_time(stop) / 1e3)
            seconds = statistics.median(times)
            row = {"backend": name, "pass": pass_name, "context": T, "seconds": seconds,
                   "tflops": flops[pass_name] / seconds / 1e12}
            results.append(row)
            print(f"{name:9s} {pass_name:8s} T {T}: {seconds * 1e6:8.1f} us  {row['tflops']:6.1f} TFLOP/s")
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}, cuDNN {torch.backends.cudnn.version()}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"torch": torch.__version__, "device": torch.cuda.get_device_name(), "rows": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
