#!/usr/bin/env python3
"""The baseline a Pipemare job on one GPU is compared with: the same model trained in plain
single-process PyTorch on the same device, one optimizer step per microbatch, on random data of
the job's shapes (the data pipeline is not what is compared). Prints one JSON line.

    python3 bench/plain_pytorch.py mlp --layers 784,512,512,256,10 --microbatch 64 --device cuda
    python3 bench/plain_pytorch.py lm --depth 4 --width 128 --heads 4 --context 64 \
        --microbatch 8 --device cuda

`mlp` is the zoo's mlp exactly (Linear + ReLU, none after the last). `lm` is a decoder-only
transformer of the zoo's sizes (byte vocabulary 256, learned positions, pre-norm blocks with causal
attention and a 4x MLP, a final LayerNorm and the head), built from torch.nn: the same arithmetic
per token as pipeline/model/model.cc's, not the same code.
Needs only PyTorch (scripts/gpu-check.sh runs it on the GPU host).
"""
import argparse
import json
import time

import torch
from torch import nn


def mlp(layers):
    seq = [nn.Flatten()]
    for i in range(len(layers) - 1):
        seq.append(nn.Linear(layers[i], layers[i + 1]))
        if i + 2 < len(layers):
            seq.append(nn.ReLU())
    return nn.Sequential(*seq)


class Block(nn.Module):
    def __init__(self, width, heads):
        super().__init__()
        self.norm1 = nn.LayerNorm(width)
        self.attn = nn.MultiheadAttention(width, heads, batch_first=True)
        self.norm2 = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x):
        n = x.shape[1]
        mask = torch.triu(torch.full((n, n), float("-inf"), device=x.device), diagonal=1)
        h = self.norm1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.norm2(x))


class LM(nn.Module):
    def __init__(self, depth, width, heads, context, vocab=256):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.pos = nn.Parameter(torch.zeros(context, width))
        self.blocks = nn.Sequential(*[Block(width, heads) for _ in range(depth)])
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab)

    def forward(self, tokens):
        x = self.embed(tokens) + self.pos[: tokens.shape[1]]
        return self.head(self.norm(self.blocks(x)))


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("model", choices=["mlp", "lm"])
    p.add_argument("--layers", default="784,512,512,256,10")
    p.add_argument("--depth", type=int, default=4)
    p.add_argument("--width", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--context", type=int, default=64)
    p.add_argument("--microbatch", type=int, default=64)
    p.add_argument("--steps", type=int, default=300, help="timed steps (after 30 warm-up steps)")
    p.add_argument("--device", default="cuda")
    a = p.parse_args()
    device = torch.device(a.device)
    torch.manual_seed(1)
    if a.model == "mlp":
        layers = [int(w) for w in a.layers.split(",")]
        model = mlp(layers).to(device)
        x = torch.randn(a.microbatch, 1, 28, 28, device=device) if layers[0] == 784 else \
            torch.randn(a.microbatch, layers[0], device=device)
        y = torch.randint(0, layers[-1], (a.microbatch,), device=device)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.03, momentum=0.9)

        def loss_fn():
            return nn.functional.cross_entropy(model(x), y)
    else:
        model = LM(a.depth, a.width, a.heads, a.context).to(device)
        x = torch.randint(0, 256, (a.microbatch, a.context), device=device)
        y = torch.randint(0, 256, (a.microbatch, a.context), device=device)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)

        def loss_fn():
            return nn.functional.cross_entropy(model(x).reshape(-1, 256), y.reshape(-1))

    def step():
        optimizer.zero_grad(set_to_none=True)
        loss = loss_fn()
        loss.backward()
        optimizer.step()
        return loss

    for _ in range(30):
        step()
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(a.steps):
        loss = step()
    loss = float(loss)  # one sync at the end
    if device.type == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    print(json.dumps({
        "model": a.model, "device": str(device), "microbatch": a.microbatch, "steps": a.steps,
        "samples_per_second": a.microbatch * a.steps / seconds, "seconds": seconds,
        "parameters": sum(t.numel() for t in model.parameters()), "final_loss": loss,
        "torch": torch.__version__,
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None}))


if __name__ == "__main__":
    main()
