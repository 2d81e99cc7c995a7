# SPDX-License-Identifier: Apache-2.0
"""The same GPT-2-124M-shaped training step as bench_gpt_step, in PyTorch: the reference that
scripts/gpu_check.sh times beside cupipe on the same GPU, in the same run.

Model (as cupipe's gpt::Model<gpt2_124m>): V 50304, T 1024, 12 blocks of C 768 with 12 heads, pre-LN
blocks with biases, tanh GELU, causal attention (scaled_dot_product_attention), the lm_head tied to
wte; AdamW (lr 6e-4, weight decay 0.1), gradient clipping at
1.0. Model FLOPs per token are counted as cupipe counts them: 6 per distinct parameter plus 6 L C T.

  python3 gpt2_pytorch.py [--batch 8] [--steps 10] [--precision fp32|tf32|bf16] [--compile] [--json F]

Never part of the tests: PyTorch is a benchmark's reference, not a dependency.
"""
import argparse
import json
import math
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

V, T, L, H, C = 50304, 1024, 12, 12, 768


class Block(nn.Module):
    def __init__(self, C=C, H=H):
        super().__init__()
        self.C, self.H = C, H
        self.ln_1 = nn.LayerNorm(C)
        self.c_attn = nn.Linear(C, 3 * C)
        self.attn_proj = nn.Linear(C, C)
        self.ln_2 = nn.LayerNorm(C)
        self.c_fc = nn.Linear(C, 4 * C)
        self.mlp_proj = nn.Linear(4 * C, C)

    def forward(self, x):
        b, t, _ = x.shape
        C, H = self.C, self.H
        q, k, v = self.c_attn(self.ln_1(x)).split(C, dim=2)
        q, k, v = (z.view(b, t, H, C // H).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.attn_proj(y.transpose(1, 2).contiguous().view(b, t, C))
        return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x)), approximate="tanh"))


class GPT(nn.Module):
    """GPT-2-124M by default; bench/cpu_vs_pytorch/gpt_pytorch.py builds gpt::tiny's shape from it."""

    def __init__(self, V=V, T=T, L=L, H=H, C=C):
        super().__init__()
        self.wte = nn.Embedding(V, C)
        self.wpe = nn.Embedding(T, C)
        self.blocks = nn.ModuleList(Block(C, H) for _ in range(L))
        self.ln_f = nn.LayerNorm(C)
        self.lm_head = nn.Linear(C, V, bias=False)
        self.lm_head.weight = self.wte.weight
        # GPT-2's initialisation, as cupipe's gpt::Model uses it: N(0, 0.02), the two residual
        # projections scaled by 1/sqrt(2 L), biases zero (PyTorch's defaults give a first loss near 75).
        for name, p in self.named_parameters():
            if p.dim() == 1 and "ln" not in name:
                nn.init.zeros_(p)
            elif p.dim() == 2:
                std = 0.02 / math.sqrt(2 * L) if name.endswith("proj.weight") else 0.02
                nn.init.normal_(p, mean=0.0, std=std)

    def forward(self, idx):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def measured_matmul_tflops(dtype, n=8192, repeats=10):
    """This GPU's large-GEMM rate in the step's precision, measured now (random data, not zeros)."""
    a = torch.randn(n, n, device="cuda", dtype=dtype)
    b = torch.randn(n, n, device="cuda", dtype=dtype)
    for _ in range(3):
        a @ b
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(repeats):
        start.record()
        a @ b
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    times.sort()
    return 2 * n ** 3 / times[len(times) // 2] / 1e12


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--precision", choices=["fp32", "tf32", "bf16"], default="tf32")
    parser.add_argument("--compile", action="store_true", help="torch.compile the model (the warm-up compiles)")
    parser.add_argument("--json", help="append one JSON line with the figures here")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("gpt2_pytorch: no CUDA device")
    allow_tf32 = args.precision != "fp32"
    torch.backends.cuda.matmul.allow_tf32 = allow_tf32
    torch.backends.cudnn.allow_tf32 = allow_tf32
    torch.manual_seed(1)

    model = GPT().cuda()
    unique = sum(p.numel() for p in model.parameters())  # the tied table once
    flops_per_token = 6.0 * unique + 6.0 * L * C * T
    optimizer = torch.optim.AdamW(model.parameters(), lr=6e-4, weight_decay=0.1, fused=True)
    step_model = torch.compile(model) if args.compile else model
    x = torch.randint(0, 50257, (args.batch, T), device="cuda")
    y = torch.randint(0, 50257, (args.batch, T), device="cuda")

    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=args.precision == "bf16"):
            logits = step_model(x)
            loss = F.cross_entropy(logits.view(-1, V).float(), y.view(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss

    t_compile = time.perf_counter()
    for _ in range(args.warmup):
        step()
    torch.cuda.synchronize()
    warmup_seconds = time.perf_counter() - t_compile
    t0 = time.perf_counter()
    for _ in range(args.steps):
        loss = step()
    torch.cuda.synchronize()
    per_step = (time.perf_counter() - t0) / args.steps
    tokens_per_second = args.batch * T / per_step
    achieved = tokens_per_second * flops_per_token / 1e12
    peak = measured_matmul_tflops(torch.bfloat16 if args.precision == "bf16" else torch.float32)
    label = f"PyTorch {torch.__version__} {'torch.compile' if args.compile else 'eager'} {args.precision}"
    print(f"{label}: batch {args.batch} x {T} tokens, step {per_step * 1e3:.1f} ms, {tokens_per_second:.0f} tokens/s, "
          f"{achieved:.1f} TFLOP/s; measured {args.precision} matmul peak {peak:.1f} TFLOP/s: MFU {100 * achieved / peak:.1f}% "
          f"(loss {loss.item():.4f}, warm-up {warmup_seconds:.1f} s, {unique / 1e6:.1f} M parameters)")
    record = {"impl": "pytorch", "torch": torch.__version__, "compile": args.compile, "precision": args.precision,
              "batch": args.batch, "tokens_per_second": tokens_per_second, "step_ms": per_step * 1e3,
              "achieved_tflops": achieved, "peak_tflops": peak, "mfu": achieved / peak,
              "loss": loss.item(), "device": torch.cuda.get_device_name()}
    if not math.isfinite(record["loss"]):
        sys.exit(f"gpt2_pytorch: the loss is {record['loss']}")
    if args.json:
        with open(args.json, "a") as f:
            f.write(json.dumps(record) + "\n")


if __name__ == "__main__":
    main()
