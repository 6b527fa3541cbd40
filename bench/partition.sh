#!/usr/bin/env bash
# Partition benchmark: a deliberately unbalanced model (one wide layer up
# front, narrow ones after) cut into P = 2 stages by `uniform` and by
# `profile`, one worker pinned per core, real compute on MNIST.
#
#   bench/partition.sh            # prints a markdown table
#
# Predicted: each stage's forward + backward seconds per microbatch from the
# profile job's per-unit costs (its coordinator log), summed over each
# partition's ranges. Measured: each stage's forward (train) + backward
# seconds per microbatch from the workers' Prometheus histograms; the
# slowest stage bounds the pipeline. Knobs: MICROBATCH (64), TRAIN (12800),
# SCHEDULE (pipemare), WORKER_CPUS ("0 1").
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
bin=${BIN_DIR:-$root/build/bin}
MICROBATCH=${MICROBATCH:-64}
TRAIN=${TRAIN:-12800}
SCHEDULE=${SCHEDULE:-pipemare}
export WORKER_CPUS=${WORKER_CPUS:-"0 1"}
source "$root/bench/cluster.sh" 2
cd "$root"
for partition in uniform profile; do
  cat >"$work/$partition.yaml" <<SPEC
name: partition-$partition
model: {type: sequential, units: [
  {type: flatten}, {type: linear, out: 2048}, {type: relu}, {type: linear, out: 256},
  {type: relu}, {type: linear, out: 256}, {type: relu}, {type: linear, out: 256}, {type: relu},
  {type: linear, out: 10}]}
data: {type: mnist, path: data/mnist, train_limit: $TRAIN, test_limit: 1000}
optimizer: {type: sgd, lr: 0.05, momentum: 0.5}
schedule: {type: $SCHEDULE, stages: 2, microbatch_size: $MICROBATCH, partition: $partition,
           lr_anneal_steps: 100, discrepancy_decay: 0.1}
train: {epochs: 1, seed: 1}
SPEC
  id=$(run_job "$work/$partition.yaml" "$work/$partition.json")
  stage_compute_metrics "$id" "$work/$partition.metrics"
done
python3 - "$work" <<'PY'
import json, re, sys
work = sys.argv[1]
log = open(f"{work}/coordinator.log").read()
rows = [[float(x) / 1000 for x in m.split()]
        for m in re.findall(r"profiled \d+ units on stage \d+ .*?: forward \+ backward ms \[([^\]]*)\]", log)]
print("| partition | stages (units) | predicted s/microbatch per stage | predicted slowest | "
      "measured s/microbatch per stage | measured slowest | samples/s | test accuracy |")
print("|---|---|---|---|---|---|---|---|")
result = {}
for part in ("uniform", "profile"):
    st = json.load(open(f"{work}/{part}.json"))
    stages = st["stages"]
    ranges = [(s.get("firstUnit", s.get("first_unit", 0)), s["units"]) for s in stages]
    pred = [sum(rows[i][u] for u in range(a, a + n)) for i, (a, n) in enumerate(ranges)]
    busy, count = {}, {}
    for line in open(f"{work}/{part}.metrics"):
        m = re.match(r'pipemare_stage_(forward|backward)_seconds_(sum|count)\{(.*)\} (\S+)', line)
        if not m: continue
        labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group(3)))
        if m.group(1) == "forward" and labels.get("phase") != "train": continue
        i = int(labels["stage"])
        if m.group(2) == "sum": busy[i] = busy.get(i, 0) + float(m.group(4))
        elif m.group(1) == "backward": count[i] = float(m.group(4))
    meas = [busy[i] / count[i] for i in sorted(busy)]
    metrics = st.get("metrics", {})
    sps = metrics.get("samplesPerSecond", metrics.get("samples_per_second", 0))
    acc = metrics.get("testAccuracy", metrics.get("test_accuracy", 0))
    result[part] = (max(pred), max(meas), sps)
    print("| %s | %s | %s | %.5f | %s | %.5f | %.0f | %.4f |" % (
        part, ", ".join("[%d,%d)" % (a, a + n) for a, n in ranges),
        ", ".join("%.5f" % p for p in pred), max(pred),
        ", ".join("%.5f" % m for m in meas), max(meas), sps, acc))
u, p = result["uniform"], result["profile"]
print()
print("profile / uniform: predicted slowest %.2fx, measured slowest %.2fx, samples/s %.2fx" % (
    p[0] / u[0], p[1] / u[1], p[2] / u[2] if u[2] else float("nan")))
PY
