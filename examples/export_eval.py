#!/usr/bin/env python3
"""Rebuilds a Pipemare model in plain PyTorch from `pipemarectl export` and
evaluates it on the job's test split.

    pipemarectl export job-1 --out model.pt      # writes model.pt and model.pt.json
    python3 examples/export_eval.py model.pt     # prints the test accuracy

The state dict's keys are those of nn.Sequential(unit_0, unit_1, ...), each
unit an nn.Sequential of its layers, so `load_state_dict(strict=True)` checks
every name and shape. The zoo's `mlp` on idx/mnist images is rebuilt here; a
TorchScript job's export is its own module with the trained weights, loaded
with torch.jit.load. The input is normalised exactly as the job did
(model.pt.json: input).
Needs only PyTorch and NumPy (Debian: python3-torch, python3-numpy).
"""
import argparse
import gzip
import json
import os
import sys

import numpy as np
import torch
from torch import nn

ACTIVATIONS = {"relu": nn.ReLU, "tanh": nn.Tanh, "gelu": nn.GELU, "sigmoid": nn.Sigmoid}


def read_idx(path):
    """An idx file (plain or gzipped) as a NumPy array."""
    if not os.path.exists(path) and os.path.exists(path + ".gz"):
        path += ".gz"
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rb") as f:
        data = f.read()
    dims = data[3]
    shape = [int.from_bytes(data[4 + 4 * i:8 + 4 * i], "big") for i in range(dims)]
    return np.frombuffer(data, dtype=np.uint8, offset=4 + 4 * dims).reshape(shape)


def build_mlp(model, input_shape):
    """The zoo's mlp: unit u is [Flatten (unit 0 on images)] Linear [activation]."""
    layers = [int(w) for w in model["layers"]]  # protobuf JSON writes int64 as strings
    act = ACTIVATIONS[model.get("activation", "relu")]
    units = []
    for u in range(len(layers) - 1):
        seq = []
        if u == 0 and len(input_shape) != 1:
            seq.append(nn.Flatten())
        seq.append(nn.Linear(layers[u], layers[u + 1]))
        if u + 1 < len(layers) - 1:
            seq.append(act())
        units.append(nn.Sequential(*seq))
    return nn.Sequential(*units)


def test_split(spec, info):
    """The job's test images, normalised as it did, and their labels."""
    data = spec["data"]
    if data.get("type") not in ("mnist", "idx"):
        sys.exit(f"data.type {data.get('type')!r}: this example reads idx/mnist files only")
    path = data.get("path", "")
    # As the job resolved them: a relative file name is under data.path.
    images = os.path.join(path, data.get("test_images") or "t10k-images-idx3-ubyte")
    labels = os.path.join(path, data.get("test_labels") or "t10k-labels-idx1-ubyte")
    for name in (images, labels):
        if not os.path.exists(name) and not os.path.exists(name + ".gz"):
            sys.exit(f"{name}: not found (the job's data.path and test files, as the coordinator "
                     "saw them; run this where those files are)")
    x = read_idx(images).astype(np.float32) / 255.0
    y = read_idx(labels).astype(np.int64)
    limit = int(data.get("test_limit", 0))
    if limit > 0:
        x, y = x[:limit], y[:limit]
    norm = info["input"]["normalisation"][0]
    x = (x - norm["mean"]) / norm["std"]
    shape = [int(d) for d in info["input"]["shape"]]
    return torch.from_numpy(x.reshape([len(x)] + shape)), torch.from_numpy(y)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("model", help="the file pipemarectl export wrote (its spec: MODEL.json)")
    args = parser.parse_args()
    with open(args.model + ".json") as f:
        info = json.load(f)
    spec = info["spec"]
    if info["format"] == "torchscript":
        # The job's own TorchScript module, carrying the trained weights.
        model = torch.jit.load(args.model)
    elif spec["model"]["type"] == "mlp":
        model = build_mlp(spec["model"], info["input"]["shape"])
        model.load_state_dict(torch.load(args.model), strict=True)
    else:
        sys.exit(f"model.type {spec['model']['type']!r}: this example rebuilds the zoo's mlp "
                 "(and loads TorchScript exports)")
    model.eval()
    x, y = test_split(spec, info)
    if hasattr(model, "forward"):
        forward = model
    else:
        # A TorchScript container without a forward of its own: its children
        # in order, as Pipemare ran them (each child one unit).
        units = list(model.children())

        def forward(inputs):
            for unit in units:
                inputs = unit(inputs)
            return inputs
    with torch.no_grad():
        correct = sum(int((forward(x[i:i + 1000]).argmax(-1) == y[i:i + 1000]).sum())
                      for i in range(0, len(x), 1000))
    accuracy = correct / len(x)
    print(json.dumps({"step": info["step"], "examples": len(x), "test_accuracy": accuracy,
                      "job_test_accuracy": info.get("metrics", {}).get("test_accuracy")}))


if __name__ == "__main__":
    main()
