#!/usr/bin/env bash
# PipeDream on the fine-grained MLP (784-256x7-10, He init, P = 8, N = 1,
# plain SGD, microbatch 64, one epoch of MNIST): does production differ from
# the replay, or is this the edge of stability?
#
#   1. bench_harness: the in-process harness, i.e. the workers' own executor
#      and runtime (pipeline/runtime/stage_executor.h), on the job's own data in the
#      job's own order, for SEEDS at lr 0.1 and at lr 0.05.
#   2. the same spec through real worker processes (pipemarectl local), for
#      seeds 1 and 2 at lr 0.1 (REAL=0 skips it).
#
#   bench/pipedream_edge.sh        (prints the Markdown rows of docs/benchmarks.md)
# Knobs: SEEDS="1 2 3 4 5 6", REAL=1.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
bin=${BIN_DIR:-$root/build/bin}
SEEDS=${SEEDS:-"1 2 3 4 5 6"}
REAL=${REAL:-1}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

spec() {  # LR SEED
  cat >"$work/pd-$1-$2.yaml" <<EOF
name: pipedream-edge
model: {type: mlp, layers: [784, 256, 256, 256, 256, 256, 256, 256, 10], activation: relu, init: he}
data: {type: mnist, path: $root/data/mnist}
optimizer: {type: sgd, lr: $1}
schedule: {type: pipedream, stages: 8, microbatch_size: 64, microbatches_per_step: 1}
train: {epochs: 1, seed: $2}
EOF
  echo "$work/pd-$1-$2.yaml"
}
row() {  # WHERE LR SEED DIVERGED_AT ACCURACY
  if [ "$4" = "-1" ]; then d="no"; else d="at step $4"; fi
  printf '| %s | %s | %s | %s | %s |\n' "$1" "$2" "$3" "$d" "$5"
}

for lr in 0.1 0.05; do
  for seed in $SEEDS; do
    out=$("$bin/bench_harness" --spec "$(spec "$lr" "$seed")" --threads 1 --every 100000 | tail -1)
    read -r diverged acc < <(python3 -c 'import json,sys; d=json.loads(sys.argv[1]); print(d["diverged_at_step"], d["test_accuracy"])' "$out")
    row "harness (workers' executor, 1 process)" "$lr" "$seed" "$diverged" "$acc"
  done
done
if [ "$REAL" = 1 ]; then
  for seed in 1 2; do
    "$bin/pipemarectl" local "$(spec 0.1 "$seed")" --threads 1 --output json \
      >"$work/real-$seed.json" 2>"$work/real-$seed.log" || true
    read -r state acc < <(python3 -c '
import json, sys
try:
    d = json.load(open(sys.argv[1]))
    print(d.get("state"), d.get("metrics", {}).get("test_accuracy", 0))
except Exception:
    print("none", 0)' "$work/real-$seed.json")
    reason=$(grep -o "training diverged[^\"]*" "$work/real-$seed.log" | head -1 || true)
    printf '| 8 worker processes (pipemarectl local) | 0.1 | %s | %s | %s |\n' "$seed" \
      "${reason:-no}" "$state $acc"
  done
fi
