# SPDX-License-Identifier: Apache-2.0
"""PyTorch twin of mlp_cpu_job: the same model, optimizer, batch, data and timing, on the CPU.

    python mlp_pytorch.py --threads 2 --samples 10000 --epochs 2 [--data DIR]

Prints one JSON line, as mlp_cpu_job does. Needs torch and numpy; reads the IDX files with gzip.
"""
import argparse
import gzip
import json
import os
import time

import numpy as np
import torch


def read_idx(path):
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rb") as f:
        raw = f.read()
    rank = raw[3]
    shape = [int.from_bytes(raw[4 + 4 * i:8 + 4 * i], "big") for i in range(rank)]
    return np.frombuffer(raw, dtype=np.uint8, offset=4 + 4 * rank).reshape(shape)


def find(folder, stem):
    for name in (stem + ".gz", stem):
        if os.path.exists(os.path.join(folder, name)):
            return os.path.join(folder, name)
    raise SystemExit(f"mlp_pytorch.py: {stem}(.gz) not found in {folder}")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--samples", type=int, default=10000)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--data", default="/usr/share/datasets/fashion-mnist")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    images = read_idx(find(a.data, "train-images-idx3-ubyte"))[: a.samples].reshape(-1, 784).astype(np.float32) / 255
    labels = read_idx(find(a.data, "train-labels-idx1-ubyte"))[: a.samples].astype(np.int64)
    images = (images - images.mean()) / images.std()
    x_all, y_all = torch.from_numpy(images), torch.from_numpy(labels)
    model = torch.nn.Sequential(torch.nn.Linear(784, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 512), torch.nn.ReLU(),
                                torch.nn.Linear(512, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10))
    # PyTorch's default AdamW implementation on the CPU (foreach); the fastest it offers there.
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=1e-4)
    loss_fn = torch.nn.CrossEntropyLoss()
    batch = 128
    steps = len(x_all) // batch
    seconds, loss = 0.0, 0.0
    for epoch in range(a.epochs + 1):  # epoch 0: warm-up, not timed
        start = time.perf_counter()
        total = 0.0
        for s in range(steps):
            x, y = x_all[s * batch:(s + 1) * batch], y_all[s * batch:(s + 1) * batch]
            opt.zero_grad(set_to_none=True)
            out = loss_fn(model(x), y)
            out.backward()
            opt.step()
            total += out.item()
        if epoch > 0:
            seconds += time.perf_counter() - start
        loss = total / steps
    print(json.dumps({"impl": "pytorch " + torch.__version__, "threads": a.threads,
                      "samples_per_second": round(steps * batch * a.epochs / seconds, 1), "loss": round(loss, 5),
                      "steps": steps * a.epochs}))


if __name__ == "__main__":
    main()
