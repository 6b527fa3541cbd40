#!/usr/bin/env bash
# Pipeline utilization and throughput of every schedule against the theory,
# through real coordinator and worker processes on loopback.
#
#   bench/pipeline.sh [OUT_DIR]                  (default out/pipeline)
#   python3 bench/pipeline_report.py OUT_DIR     (the Markdown table)
#
# By default the workers run on the virtual device (pipemare-worker
# --virtual-device FWD_MS,BWD_MS; pipeline/runtime/stage_runtime.h): each unit's
# compute is a sleep, every message, tensor shape and schedule decision is
# real, so a 32-stage pipeline can be measured on 2 cores. The model is an
# MLP with one unit per stage (784, WIDTH x (P-1), 10); a run trains
# MICROBATCHES_PER_STAGE * P microbatches of MICROBATCH examples.
#
# Knobs (environment): PS="2 4 8 16 32", NS="4 8",
# SCHEDULES="gpipe pipedream async pipemare", FWD_MS=4, BWD_MS=8,
# MICROBATCHES_PER_STAGE=16, MICROBATCH=8, WIDTH=64, VIRTUAL=1,
# WIRE_DTYPE=float32 (schedule.wire_dtype), TRANSPORT=grpc (schedule.transport:
# grpc or gloo), DATA_PLANE_MIN_BYTES (gloo only: schedule.data_plane_min_bytes;
# unset leaves it unset).
# VIRTUAL=0 runs real compute instead, with one worker pinned per core
# (WORKER_CPUS="0 1" by default): use it with PS=2 and a wider model, e.g.
# LAYERS="[784, 512, 2048, 512, 10]" (overrides the generated layer list;
# utilization is then per stage of however many units it gets).
#
# Per run, OUT_DIR/NAME.json holds the job's status and each stage's
# forward (train) and backward seconds, scraped from the workers' /metrics.
# Utilization of a stage = (forward + backward seconds) / training seconds.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
bin=${BIN_DIR:-$root/build/bin}
out=${1:-$root/out/pipeline}
PS=${PS:-"2 4 8 16 32"}
NS=${NS:-"4 8"}
SCHEDULES=${SCHEDULES:-"gpipe pipedream async pipemare"}
FWD_MS=${FWD_MS:-4}
BWD_MS=${BWD_MS:-8}
MICROBATCHES_PER_STAGE=${MICROBATCHES_PER_STAGE:-16}
MICROBATCH=${MICROBATCH:-8}
WIDTH=${WIDTH:-64}
VIRTUAL=${VIRTUAL:-1}
WIRE_DTYPE=${WIRE_DTYPE:-float32}
TRANSPORT=${TRANSPORT:-grpc}
min_bytes=""
[ -z "${DATA_PLANE_MIN_BYTES:-}" ] || min_bytes=", data_plane_min_bytes: $DATA_PLANE_MIN_BYTES"
mkdir -p "$out"
max_p=0
for p in $PS; do [ "$p" -gt "$max_p" ] && max_p=$p; done
if [ "$VIRTUAL" = 1 ]; then
  export WORKER_FLAGS="--virtual-device $FWD_MS,$BWD_MS ${WORKER_FLAGS:-}"
else
  export WORKER_CPUS=${WORKER_CPUS:-"0 1"}
fi
source "$root/bench/cluster.sh" "$max_p"

cd "$root"
for p in $PS; do
  for n in $NS; do
    microbatches=$((MICROBATCHES_PER_STAGE * p))
    microbatches=$(((microbatches + n - 1) / n * n))  # whole steps
    for schedule in $SCHEDULES; do
      name="p${p}-n${n}-${schedule}"
      cat >"$work/spec.yaml" <<SPEC
name: $name
model: {type: mlp, layers: ${LAYERS:-$(mlp_layers "$p" "$WIDTH")}, activation: relu}
data: {type: mnist, path: data/mnist, train_limit: $((microbatches * MICROBATCH)), test_limit: $MICROBATCH}
optimizer: {type: sgd, lr: 0.01}
schedule: {type: $schedule, stages: $p, microbatch_size: $MICROBATCH, microbatches_per_step: $n,
           lr_anneal_steps: 100, discrepancy_decay: 0.1, wire_dtype: $WIRE_DTYPE,
           transport: $TRANSPORT$min_bytes}
train: {epochs: 1, seed: 1, shuffle: false}
SPEC
      id=$(run_job "$work/spec.yaml" "$work/status.json")
      stage_compute_metrics "$id" "$work/metrics.txt"
      python3 - "$work/status.json" "$work/metrics.txt" "$out/$name.json" \
        "$p" "$n" "$schedule" "$microbatches" "$MICROBATCH" "$VIRTUAL" "$FWD_MS" "$BWD_MS" <<'PY'
import json, re, sys
status = json.load(open(sys.argv[1]))
busy = {}
for line in open(sys.argv[2]):
    m = re.match(r'pipemare_stage_(forward|backward)_seconds_sum\{(.*)\} (\S+)', line)
    if not m: continue
    labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group(2)))
    if m.group(1) == "forward" and labels.get("phase") != "train": continue
    stage = int(labels["stage"])
    busy[stage] = busy.get(stage, 0.0) + float(m.group(3))
p, n, mbs, mb = int(sys.argv[4]), int(sys.argv[5]), int(sys.argv[7]), int(sys.argv[8])
json.dump({"p": p, "n": n, "schedule": sys.argv[6], "microbatches": mbs, "microbatch": mb,
           "virtual": sys.argv[9] == "1", "fwd_ms": float(sys.argv[10]), "bwd_ms": float(sys.argv[11]),
           "state": status["state"], "metrics": status.get("metrics", {}),
           "busy_seconds": [busy.get(i, 0.0) for i in range(p)]}, open(sys.argv[3], "w"))
PY
      echo "$name: $(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["state"])' \
        "$work/status.json")" >&2
    done
  done
done
