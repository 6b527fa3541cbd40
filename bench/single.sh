#!/usr/bin/env bash
# The price of the pipeline on one host: the MNIST MLP of the main example
# through 2 workers (one per core, 1 LibTorch thread each) against the same
# model trained by plain LibTorch in one process with 2 threads
# (bench_single, bench/single.cc). Same model, initial weights, microbatch
# and epochs; samples/s counts training time only on both sides.
#
#   bench/single.sh            (knobs: EPOCHS=1, SCHEDULES="pipemare gpipe",
#                               TRAIN_LIMIT=0 (all), MICROBATCH=64)
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
bin=${BIN_DIR:-$root/build/bin}
EPOCHS=${EPOCHS:-1}
SCHEDULES=${SCHEDULES:-"pipemare gpipe"}
TRAIN_LIMIT=${TRAIN_LIMIT:-0}
MICROBATCH=${MICROBATCH:-64}
export WORKER_CPUS=${WORKER_CPUS:-"0 1"}
source "$root/bench/cluster.sh" 2
cd "$root"
echo "| run | samples/s | test accuracy | ratio to one process |"
echo "|---|---|---|---|"
single=$("$bin/bench_single" --data data/mnist --layers 784,512,512,256,10 --threads 2 \
  --epochs "$EPOCHS" --microbatch "$MICROBATCH" --train-limit "$TRAIN_LIMIT" --lr 0.03 \
  --momentum 0.9 --seed 1)
single_sps=$(python3 -c 'import json,sys; print(json.loads(sys.argv[1])["samples_per_second"])' \
  "$single")
python3 -c 'import json,sys; j=json.loads(sys.argv[1]); print("| one process, 2 threads | %.0f | %.2f%% | 1.00 |" % (j["samples_per_second"], 100*j["test_accuracy"]))' "$single"
for schedule in $SCHEDULES; do
  limit=""
  [ "$TRAIN_LIMIT" != 0 ] && limit=", train_limit: $TRAIN_LIMIT"
  cat >"$work/spec.yaml" <<SPEC
name: single-$schedule
model: {type: mlp, layers: [784, 512, 512, 256, 10], activation: relu}
data: {type: mnist, path: data/mnist$limit}
optimizer: {type: sgd, lr: 0.03, momentum: 0.9}
schedule: {type: $schedule, stages: 2, microbatch_size: $MICROBATCH, microbatches_per_step: 1,
           lr_anneal_steps: 500, discrepancy_decay: 0.1}
train: {epochs: $EPOCHS, seed: 1}
SPEC
  run_job "$work/spec.yaml" "$work/status.json" >/dev/null
  python3 - "$work/status.json" "$single_sps" "$schedule" <<'PY'
import json, sys
j = json.load(open(sys.argv[1]))
m = j.get("metrics", {})
sps = m.get("samples_per_second", 0)
print("| %s, 2 workers x 1 thread (%s) | %.0f | %.2f%% | %.2f |" % (
    sys.argv[3], j["state"], sps, 100 * m.get("test_accuracy", 0), sps / float(sys.argv[2])))
PY
done
