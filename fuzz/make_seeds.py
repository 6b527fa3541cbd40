#!/usr/bin/env python3
"""Writes the fuzz targets' seed corpora (fuzz/corpus/<target>/): valid and
near-valid inputs, so that each fuzzer starts deep inside its parser. The
protobuf seeds are encoded by hand (no protobuf module needed); field numbers
follow proto/pipemare/v1/pipemare.proto. Run from anywhere:
    python3 fuzz/make_seeds.py
"""
import json
import os
import shutil
import struct

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def varint(n):
    out = bytearray()
    n &= (1 << 64) - 1
    while True:
        b = n & 0x7F
        n >>= 7
        out.append(b | (0x80 if n else 0))
        if not n:
            return bytes(out)


def field(number, wire, payload):
    key = varint((number << 3) | wire)
    if wire == 0:
        return key + varint(payload)
    if wire == 1:  # 64-bit
        return key + struct.pack("<d", payload)
    return key + varint(len(payload)) + payload


def tensor(dtype, shape, data):
    packed = b"".join(varint(d) for d in shape)
    return field(1, 0, dtype) + field(2, 2, packed) + field(3, 2, data)


def write(target, name, data):
    d = os.path.join(HERE, "corpus", target)
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, name), "wb") as f:
        f.write(data)


FLOAT32, FLOAT64, FLOAT16, BFLOAT16, INT64, INT32, UINT8 = 1, 2, 3, 4, 5, 6, 7
tensors = {
    "f32_2x3": tensor(FLOAT32, [2, 3], struct.pack("<6f", *range(6))),
    "i64_4": tensor(INT64, [4], struct.pack("<4q", 1, 2, 3, 9)),
    "u8_2x2x2": tensor(UINT8, [2, 2, 2], bytes(range(8))),
    "f16_3": tensor(FLOAT16, [3], bytes(6)),
    "f32_truncated": tensor(FLOAT32, [2, 3], bytes(7)),
    "f32_scalar": tensor(FLOAT32, [], struct.pack("<f", 1.5)),
    # Found by the fuzzer (of the tensor codec the Pipe wire took over): a 0
    # in the shape (no storage) made a copy into a null pointer.
    "i64_empty": tensor(INT64, [3, 0], b""),
}

# StageMessage: open 1, microbatch 2, phase 3, activation 4, gradient 5,
# targets 6, done 7, result 8, error 9. The first byte of a pipe_message
# input picks where the fuzzer cuts it into slices.
open_msg = field(1, 2, field(1, 2, b"job-1") + field(2, 0, 1))
messages = {
    "activation": field(2, 0, 7) + field(3, 0, 1) + field(4, 2, tensors["f32_2x3"]),
    "gradient": field(2, 0, 7) + field(5, 2, tensors["f32_2x3"]),
    "targets": field(2, 0, 3) + field(6, 2, tensors["i64_4"]),
    "done": field(2, 0, 3) + field(7, 2, b""),
    "result": field(2, 0, 3) + field(8, 2, field(1, 1, 0.5) + field(3, 0, 4)),
    "error": field(9, 2, field(1, 2, b"stage 1 failed")),
    "open": open_msg,
    "truncated": field(2, 0, 7) + field(4, 2, tensors["f32_truncated"]),
}
# Every tensor layout above as an activation (the wire's layout checks).
for name in ("u8_2x2x2", "f16_3", "f32_scalar", "i64_empty"):
    messages["activation_" + name] = field(2, 0, 9) + field(4, 2, tensors[name])
for name, data in messages.items():
    for cuts in (0x00, 0x1B, 0xE4):
        write("pipe_message", "%s_%02x" % (name, cuts), bytes([cuts]) + data)

for spec in sorted(os.listdir(os.path.join(ROOT, "examples"))):
    if spec.endswith((".yaml", ".json")):
        shutil.copy(os.path.join(ROOT, "examples", spec), os.path.join(HERE, "corpus", "job_spec", spec))
write("job_spec", "inline.json", json.dumps({
    "name": "j", "model": {"type": "mlp", "layers": [784, 10]},
    "data": {"type": "mnist", "path": "data/mnist"}, "optimizer": {"type": "adam", "lr": 1e-3},
    "schedule": {"type": "pipemare", "stages": 1}, "train": {"epochs": 1}}).encode())

manifest = {
    "format": "pipemare-checkpoint-1", "job": "job-1", "generation": 2, "step": 7,
    "microbatch": 7, "epoch": 0, "index_in_epoch": 7, "seed": 1,
    "stages": [{"first_unit": 0, "units": 1}, {"first_unit": 1, "units": 1}],
    "files": [{"unit": 0, "file": "unit-0.pt", "bytes": 4, "sha256": "00" * 32},
              {"unit": 1, "file": "unit-1.pt", "bytes": 4, "sha256": "11" * 32}],
    "spec": {"name": "j"}, "input": {}}
write("manifest", "valid.json", json.dumps(manifest, indent=2).encode())
manifest["step"] = 8
write("manifest", "other_step.json", json.dumps(manifest).encode())
# Found by the fuzzer: a float where an int belongs was cast unchecked (UB).
manifest["step"] = 7
write("manifest", "float_unit.json", json.dumps(manifest).replace('"unit": 1,', '"unit": 1.2e42,').encode())
write("manifest", "escaping_file.json", json.dumps(manifest).replace("unit-1.pt", "../../x").encode())
write("manifest", "no_files.json", json.dumps({k: v for k, v in manifest.items() if k != "files"}).encode())
