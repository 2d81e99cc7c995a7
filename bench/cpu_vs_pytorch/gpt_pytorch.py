# SPDX-License-Identifier: Apache-2.0
"""gpt_train's `tiny` GPT step on the CPU in PyTorch: the reference compare_gpt.py times beside cupipe.

Model (as cupipe's gpt::Model<gpt::tiny>): V 256 (bytes), T 64, 4 pre-LN blocks of C 128 with 4 heads,
biases, tanh GELU, causal attention (scaled_dot_product_attention), lm_head tied to wte; AdamW (lr 2e-3,
weight decay 0.1), gradient clipping at 1.0; float32. One step: forward, cross-entropy, backward, clip,
AdamW. Prints one JSON line: the median step time over --steps timed steps (after --warmup).

  python3 gpt_pytorch.py [--batch 8] [--steps 60] [--threads 1]

Never part of the tests: PyTorch is a benchmark's reference, not a dependency.
"""
import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "gpt_step"))
from gpt2_pytorch import GPT  # noqa: E402  (the GPU benchmark's model, at gpt::tiny's shape here)

V, T, L, H, C = 256, 64, 4, 4, 128


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(1)
    model = GPT(V=V, T=T, L=L, H=H, C=C)
    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=0.1)
    x = torch.randint(0, V, (args.batch, T))
    y = torch.randint(0, V, (args.batch, T))

    def step():
        loss = F.cross_entropy(model(x).view(-1, V), y.view(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.item()

    for _ in range(args.warmup):
        step()
    times = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    median = statistics.median(times)
    print(json.dumps({"impl": f"PyTorch {torch.__version__} eager", "threads": args.threads, "batch": args.batch,
                      "step_seconds": median, "tokens_per_second": args.batch * T / median}))


if __name__ == "__main__":
    main()
