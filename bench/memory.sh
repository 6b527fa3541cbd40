#!/usr/bin/env bash
# A worker's peak resident memory is bounded by its in-flight window, not by
# the length of the run: the same pipemare job for 1 epoch and for 10x as
# many steps, each on a fresh cluster of 4 workers (real compute), and the
# peak RSS (VmHWM) of every worker process after each.
#
#   bench/memory.sh      (knobs: TRAIN_LIMIT=6400, LONG=10, SCHEDULE=pipemare)
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
bin=${BIN_DIR:-$root/build/bin}
TRAIN_LIMIT=${TRAIN_LIMIT:-6400}
LONG=${LONG:-10}
SCHEDULE=${SCHEDULE:-pipemare}
cd "$root"
run() {  # $1 = epochs; prints "steps rss_stage0_kib ... rss_stage3_kib"
  (
    source "$root/bench/cluster.sh" 4
    cat >"$work/spec.yaml" <<SPEC
name: memory-$1
model: {type: mlp, layers: [784, 512, 512, 256, 10], activation: relu}
data: {type: mnist, path: data/mnist, train_limit: $TRAIN_LIMIT, test_limit: 1000}
optimizer: {type: sgd, lr: 0.03, momentum: 0.9, lr_schedule: cosine}
schedule: {type: $SCHEDULE, stages: 4, microbatch_size: 64, microbatches_per_step: 1,
           lr_anneal_steps: 500, discrepancy_decay: 0.1}
train: {epochs: $1, seed: 1}
SPEC
    run_job "$work/spec.yaml" "$work/status.json" >/dev/null
    steps=$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["progress"]["step"])' \
      "$work/status.json")
    line="$steps"
    for pid in "${worker_pids[@]}"; do
      line="$line $(awk '/VmHWM/ {print $2}' "/proc/$pid/status")"
    done
    echo "$line"
  )
}
short=$(run 1)
long=$(run "$LONG")
python3 - "$short" "$long" <<'PY'
import sys
short, long = ([int(x) for x in a.split()] for a in sys.argv[1:3])
print("| run | steps | peak RSS per worker (MiB) | largest |")
print("|---|---|---|---|")
for name, r in (("short", short), ("long", long)):
    print("| %s | %d | %s | %.1f |" % (name, r[0], ", ".join("%.1f" % (k / 1024) for k in r[1:]),
                                      max(r[1:]) / 1024))
print()
print("long / short steps = %.1fx; largest peak RSS long / short = %.3fx" % (
    long[0] / short[0], max(long[1:]) / max(short[1:])))
PY
