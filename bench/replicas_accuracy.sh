#!/usr/bin/env bash
# Replicas train as well as one pipeline with the same effective batch:
# R = 2 pipelines of P = 3 stages at microbatch MB against R = 1 at 2 x MB,
# both `pipemare` (N = 1), on full MNIST for EPOCHS epochs, for each seed in
# SEEDS; prints each pair's test accuracies and their difference.
#   bench/replicas_accuracy.sh    (knobs: SEEDS="1 2 3" EPOCHS=2 MB=64 SCHEDULE=pipemare)
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
bin=${BIN_DIR:-$root/build/bin}
SEEDS=${SEEDS:-"1 2 3"} EPOCHS=${EPOCHS:-2} MB=${MB:-64} SCHEDULE=${SCHEDULE:-pipemare}
source "$root/bench/cluster.sh" 6
cd "$root"
echo "| seed | R = 2 x P = 3, microbatch $MB | R = 1 x P = 3, microbatch $((2 * MB)) | difference (points) |"
echo "|---|---|---|---|"
for seed in $SEEDS; do
  acc=()
  for r in 2 1; do
    cat >"$work/spec.yaml" <<SPEC
name: replicas-accuracy-r$r-s$seed
model: {type: mlp, layers: [784, 512, 256, 10], activation: relu}
data: {type: mnist, path: data/mnist}
optimizer: {type: sgd, lr: 0.03, momentum: 0.9, lr_schedule: cosine}
schedule: {type: $SCHEDULE, stages: 3, replicas: $r, microbatch_size: $((MB * (3 - r))),
           microbatches_per_step: 1, lr_anneal_steps: 500, discrepancy_decay: 0.1}
train: {epochs: $EPOCHS, seed: $seed}
SPEC
    run_job "$work/spec.yaml" "$work/status.json" >/dev/null
    acc+=("$(python3 -c 'import json,sys; s=json.load(open(sys.argv[1])); assert s["state"]=="SUCCEEDED", s.get("reason"); print(s["metrics"]["test_accuracy"])' "$work/status.json")")
  done
  python3 -c "import sys; a,b=map(float,sys.argv[1:3]); print(f'| $seed | {100*a:.2f}% | {100*b:.2f}% | {100*(a-b):+.2f} |')" "${acc[0]}" "${acc[1]}"
done
