# SPDX-License-Identifier: Apache-2.0
"""gpt_train's tiny GPT trained in PyTorch with gpt_train's recipe, and a float64 scorer for either's
checkpoint: how well each learns from the same compute (compare_gpt.py times the step).

  train: gpt::tiny (gpt_pytorch.py's model) on the first part of the corpus, gpt_train's defaults:
         batch 16 x 64 bytes, 2,000 steps, AdamW (lr 2e-3, betas 0.9/0.999, eps 1e-8, weight decay 0.1
         on the matrices and embeddings only), 100 warm-up steps then cosine to 10%, clip 1.0,
         float32. Saves a checkpoint with nanoGPT's names, as gpt_train does.
           --order shuffled   gpt_train's: each epoch a permutation of the T + 1-token windows drawn by
                              cupipe's generator (io::WindowLoader), the same batches gpt_train trains on
           --order in-order   gpt_train --data-order in-order (its only order before 2026-12-03):
                              consecutive windows in corpus order
           --order random     nanoGPT's: B windows at random byte offsets every step
           --init cupipe      cupipe's initial weights, drawn as gpt::Model<tiny> draws them (bit for bit)
           --init torch       GPT-2's initialisation from torch.manual_seed(--seed)
           --decay-on all     weight decay on every tensor (torch.optim.AdamW's single group)
  score: the mean cross-entropy (nats per byte) of a checkpoint (cupipe's or this script's, nanoGPT
         names) on every whole window of the held-out part, in float64.

  python3 gpt_learning.py train --out /tmp/torch_tiny [--order shuffled] [--init cupipe] [--threads 2]
  python3 gpt_learning.py score /tmp/cupipe_tiny.safetensors /tmp/torch_tiny.safetensors

The corpus and the split are gpt_train's: every regular file under --data except fortune's *.dat
index files (symbolic links not followed), in path order, concatenated; the last --held-out of the
bytes held out. Never part of the tests: PyTorch is a benchmark's reference, not a dependency.
"""
import argparse
import json
import math
import os
import struct
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "gpt_step"))
from gpt2_pytorch import GPT  # noqa: E402  (the model gpt_pytorch.py times, at gpt::tiny's shape)

V, T, L, H, C = 256, 64, 4, 4, 128
MASK = (1 << 64) - 1
# io::window_order_stream: the data order's stream of cupipe::Rng::derive(seed, stream).
WINDOW_ORDER_STREAM = 1 << 32


# ---- the corpus and its split, as io::load_text and io::split_held_out make them ----

def load_text(path):
    if os.path.isfile(path):
        files = [path]
    else:
        files = []
        for folder, dirs, names in os.walk(path):  # os.walk does not follow links to folders
            for name in names:
                full = os.path.join(folder, name)
                if not os.path.islink(full) and os.path.isfile(full) and not name.endswith(".dat"):
                    files.append(full)
        files.sort(key=lambda f: os.path.relpath(f, path).split(os.sep))  # std::filesystem::path order
    data = b"".join(open(f, "rb").read() for f in files)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).long(), len(files)


def split_held_out(tokens, fraction):
    cut = len(tokens) - int(len(tokens) * fraction)
    return tokens[:cut], tokens[cut:]


# ---- cupipe::Rng (xoshiro256**, seeded through splitmix64) ----

def _splitmix64(x):
    x = (x + 0x9E3779B97F4A7C15) & MASK
    z = x
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK
    return x, z ^ (z >> 31)


def _rotl(x, k):
    return ((x << k) | (x >> (64 - k))) & MASK


class Rng:
    def __init__(self, seed):
        self.s = []
        x = seed & MASK
        for _ in range(4):
            x, word = _splitmix64(x)
            self.s.append(word)

    @staticmethod
    def derive(seed, stream):
        _, word = _splitmix64((seed ^ ((0x9E3779B97F4A7C15 * (stream + 1)) & MASK)) & MASK)
        return Rng(word)

    def next_u64(self):
        s = self.s
        result = (_rotl((s[1] * 5) & MASK, 7) * 9) & MASK
        t = (s[1] << 17) & MASK
        s[2] ^= s[0]
        s[3] ^= s[1]
        s[1] ^= s[2]
        s[0] ^= s[3]
        s[2] ^= t
        s[3] = _rotl(s[3], 45)
        return result

    def uniform(self):
        return (self.next_u64() >> 11) * 2.0 ** -53

    def below(self, n):
        limit = ((1 << 64) - n) % n
        while True:
            r = self.next_u64()
            if r >= limit:
                return r % n

    def normal(self):
        u1 = 1.0 - self.uniform()
        u2 = self.uniform()
        return math.sqrt(-2.0 * math.log(u1)) * math.cos(2.0 * math.pi * u2)


# ---- the windows a step trains on ----

def batches(train, order, batch, steps, seed):
    """Yields (x, y) of (batch, T) for each step."""
    windows = (len(train) - 1) // T
    if order == "random":  # nanoGPT's get_batch
        g = torch.Generator().manual_seed(seed)
        for _ in range(steps):
            ix = torch.randint(len(train) - T, (batch,), generator=g)
            yield torch.stack([train[i:i + T] for i in ix]), torch.stack([train[i + 1:i + 1 + T] for i in ix])
        return
    per_epoch = windows // batch  # io::WindowLoader: whole batches from one epoch's permutation
    rng = Rng.derive(seed, WINDOW_ORDER_STREAM)
    step = 0
    while step < steps:
        perm = list(range(windows))
        if order == "shuffled":
            for i in range(windows - 1, 0, -1):
                j = rng.below(i + 1)
                perm[i], perm[j] = perm[j], perm[i]
        for b in range(per_epoch):
            if step == steps:
                return
            starts = [perm[b * batch + s] * T for s in range(batch)]
            yield (torch.stack([train[w:w + T] for w in starts]), torch.stack([train[w + 1:w + 1 + T] for w in starts]))
            step += 1


# ---- gpt::Model<tiny>'s parameters under nanoGPT's names ----

def nanogpt_names(model):
    """nanoGPT state_dict name -> the parameter of gpt2_pytorch.GPT."""
    names = {"transformer.wte.weight": model.wte.weight, "transformer.wpe.weight": model.wpe.weight,
             "transformer.ln_f.weight": model.ln_f.weight, "transformer.ln_f.bias": model.ln_f.bias,
             "lm_head.weight": model.lm_head.weight}
    ours = {"ln_1": "ln_1", "attn.c_attn": "c_attn", "attn.c_proj": "attn_proj", "ln_2": "ln_2", "mlp.c_fc": "c_fc",
            "mlp.c_proj": "mlp_proj"}
    for i, block in enumerate(model.blocks):
        for theirs, mine in ours.items():
            for kind in ("weight", "bias"):
                names[f"transformer.h.{i}.{theirs}.{kind}"] = getattr(getattr(block, mine), kind)
    return names


def cupipe_init(model, seed):
    """The weights gpt::Model<tiny> starts from with --seed `seed` (LayerSeq::init): layer i of the model
    draws from Rng::derive(seed, i); a Residual half draws a seed from its stream and its inner layers
    from derive(that, j); matrices N(0, 0.02), c_proj's N(0, 0.02 / sqrt(2 L)), vectors 0, LayerNorm 1
    and 0; the tied lm_head draws what wte drew."""
    def normal(rng, shape, std):
        values = [std * rng.normal() for _ in range(math.prod(shape))]
        return torch.tensor(values, dtype=torch.float64).float().view(shape)

    with torch.no_grad():
        embedding = Rng.derive(seed, 0)
        model.wte.weight.copy_(normal(embedding, (V, C), 0.02))
        model.wpe.weight.copy_(normal(embedding, (T, C), 0.02))
        projection = 0.02 / math.sqrt(2.0 * L)
        for i, block in enumerate(model.blocks):
            attention = Rng.derive(Rng.derive(seed, 1 + 2 * i).next_u64(), 1)
            block.c_attn.weight.copy_(normal(attention, (3 * C, C), 0.02))
            block.attn_proj.weight.copy_(normal(attention, (C, C), projection))
            inner = Rng.derive(seed, 2 + 2 * i).next_u64()
            block.c_fc.weight.copy_(normal(Rng.derive(inner, 1), (4 * C, C), 0.02))
            block.mlp_proj.weight.copy_(normal(Rng.derive(inner, 2), (C, 4 * C), projection))
            for p in (block.c_attn.bias, block.attn_proj.bias, block.c_fc.bias, block.mlp_proj.bias):
                p.zero_()
            for ln in (block.ln_1, block.ln_2):
                ln.weight.fill_(1)
                ln.bias.zero_()
        model.ln_f.weight.fill_(1)
        model.ln_f.bias.zero_()


# ---- safetensors, read and written by hand (no dependency beyond torch) ----

_DTYPES = {"F32": torch.float32, "F64": torch.float64, "BF16": torch.bfloat16}


def read_safetensors(path):
    blob = open(path, "rb").read()
    (length,) = struct.unpack("<Q", blob[:8])
    header = json.loads(blob[8:8 + length])
    body = bytearray(blob[8 + length:])
    out = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        begin, end = entry["data_offsets"]
        out[name] = torch.frombuffer(body[begin:end], dtype=_DTYPES[entry["dtype"]]).view(entry["shape"]).clone()
    return out


def write_safetensors(path, tensors):
    header, offset, chunks = {}, 0, []
    for name, t in tensors.items():
        data = t.detach().contiguous().float().numpy().tobytes()
        header[name] = {"dtype": "F32", "shape": list(t.shape), "data_offsets": [offset, offset + len(data)]}
        offset += len(data)
        chunks.append(data)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text + b"".join(chunks))


def load_checkpoint(model, path):
    tensors = read_safetensors(path)
    names = nanogpt_names(model)
    missing = sorted(set(names) - set(tensors))
    if missing:
        raise SystemExit(f"{path}: no {', '.join(missing)}")
    if "lm_head.weight" in tensors and not torch.equal(tensors["lm_head.weight"], tensors["transformer.wte.weight"]):
        print(f"{path}: lm_head.weight differs from transformer.wte.weight; the tied model takes wte's", file=sys.stderr)
    with torch.no_grad():
        for name, p in names.items():
            if name != "lm_head.weight":
                p.copy_(tensors[name].to(p.dtype))


# ---- scoring and training ----

def held_out_loss(model, held_out, rows=256):
    """Mean cross-entropy in nats per byte over every whole window of T + 1 held-out bytes (the windows
    io::WindowLoader cuts), in the model's precision."""
    windows = (len(held_out) - 1) // T
    total, count = 0.0, 0
    with torch.no_grad():
        for first in range(0, windows, rows):
            starts = range(first * T, min(windows, first + rows) * T, T)
            x = torch.stack([held_out[w:w + T] for w in starts])
            y = torch.stack([held_out[w + 1:w + 1 + T] for w in starts])
            total += F.cross_entropy(model(x).view(-1, V), y.reshape(-1), reduction="sum").item()
            count += y.numel()
    return total / count


def lr_factor(step, warmup, steps, min_factor):
    """optim::LrSchedule::factor: linear warm-up from 1/warmup, then cosine to min_factor."""
    if step < warmup:
        return (step + 1) / warmup
    if steps <= warmup:
        return 1.0
    progress = min(max((step - warmup) / (steps - warmup), 0.0), 1.0)
    return min_factor + (1.0 - min_factor) * 0.5 * (1.0 + math.cos(math.pi * progress))


def train(a):
    torch.set_num_threads(a.threads)
    tokens, files = load_text(a.data)
    train_part, held_out = split_held_out(tokens, a.held_out)
    print(f"{a.data}: {files} files, {len(tokens)} tokens; {len(train_part)} train, {len(held_out)} held out")
    torch.manual_seed(a.seed)
    model = GPT(V=V, T=T, L=L, H=H, C=C)  # GPT-2's initialisation from torch's generator
    if a.init == "cupipe":
        cupipe_init(model, a.seed)
    decay = [p for p in model.parameters() if a.decay_on == "all" or p.dim() >= 2]
    keep = [p for p in model.parameters() if not (a.decay_on == "all" or p.dim() >= 2)]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": a.weight_decay},
                                   {"params": keep, "weight_decay": 0.0}], lr=a.lr, betas=(0.9, 0.999), eps=1e-8)
    times, curve = [], []
    start = time.perf_counter()
    for step, (x, y) in enumerate(batches(train_part, a.order, a.batch, a.steps, a.seed)):
        t0 = time.perf_counter()
        for group in optimizer.param_groups:
            group["lr"] = a.lr * lr_factor(step, a.warmup, a.steps, a.min_lr)
        loss = F.cross_entropy(model(x).view(-1, V), y.reshape(-1))
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), a.clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t0)
        if (step + 1) % a.eval_every == 0 or step + 1 == a.steps:
            curve.append({"step": step + 1, "seconds": time.perf_counter() - start, "train_loss": loss.item()})
            print(f"step {step + 1}/{a.steps}: loss {loss.item():.4f}, grad norm {norm.item():.3f}, "
                  f"{sorted(times)[len(times) // 2] * 1e3:.1f} ms a step (median so far)", flush=True)
    seconds = time.perf_counter() - start
    write_safetensors(a.out + ".safetensors", {name: p for name, p in nanogpt_names(model).items()})
    score = held_out_loss(model.double(), held_out)
    summary = {"impl": f"PyTorch {torch.__version__} eager", "order": a.order, "init": a.init, "decay_on": a.decay_on,
               "seed": a.seed, "threads": a.threads, "steps": a.steps, "seconds": seconds,
               "step_seconds_measured": sorted(times)[len(times) // 2], "held_out_loss_float64": score, "curve": curve}
    print(json.dumps(summary))


def score(a):
    torch.set_num_threads(a.threads)
    tokens, _ = load_text(a.data)
    _, held_out = split_held_out(tokens, a.held_out)
    for path in a.checkpoints:
        model = GPT(V=V, T=T, L=L, H=H, C=C)
        load_checkpoint(model, path)
        loss = held_out_loss(model.double(), held_out)
        print(json.dumps({"checkpoint": path, "held_out_bytes": len(held_out), "held_out_loss_float64": loss,
                          "bits_per_byte": loss / math.log(2)}), flush=True)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", default="/usr/share/games/fortunes")
    p.add_argument("--held-out", type=float, default=0.1, help="the fraction held out (the corpus's end)")
    p.add_argument("--threads", type=int, default=2)
    sub = p.add_subparsers(dest="command", required=True)
    t = sub.add_parser("train", help="train in PyTorch with gpt_train's recipe")
    t.add_argument("--out", required=True, help="checkpoint prefix: OUT.safetensors (nanoGPT names)")
    t.add_argument("--order", choices=["shuffled", "in-order", "random"], default="shuffled")
    t.add_argument("--init", choices=["cupipe", "torch"], default="cupipe")
    t.add_argument("--decay-on", choices=["matrices", "all"], default="matrices")
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--steps", type=int, default=2000)
    t.add_argument("--batch", type=int, default=16)
    t.add_argument("--lr", type=float, default=2e-3)
    t.add_argument("--warmup", type=int, default=100)
    t.add_argument("--min-lr", type=float, default=0.1)
    t.add_argument("--weight-decay", type=float, default=0.1)
    t.add_argument("--clip", type=float, default=1.0)
    t.add_argument("--eval-every", type=int, default=100, help="steps between progress lines")
    s = sub.add_parser("score", help="held-out loss of checkpoints in float64")
    s.add_argument("checkpoints", nargs="+", help="PREFIX.safetensors files with nanoGPT's names")
    a = p.parse_args()
    train(a) if a.command == "train" else score(a)


if __name__ == "__main__":
    main()
