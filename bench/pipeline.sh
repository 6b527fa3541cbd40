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
# SCHEDULES="gpipe 1f1b zero_bubble pipedream pipedream_2bw async pipemare"
# (pipedream_2bw only where N >= P - 1), FWD_MS=4, BWD_MS=8, W_MS (the
# virtual device's weight gradient, zero_bubble's W: --virtual-device
# FWD_MS,BWD_MS,W_MS; unset, W is half of BWD_MS), RECOMPUTE (true or false:
# schedule.recompute; unset leaves each schedule's default; false skips
# pipemare and async, which must recompute),
# MICROBATCHES_PER_STAGE=16, MICROBATCH=8, WIDTH=64, VIRTUAL=1,
# WIRE_DTYPE=float32 (schedule.wire_dtype), TRANSPORT=grpc (schedule.transport:
# grpc or gloo), DATA_PLANE_MIN_BYTES (gloo only: schedule.data_plane_min_bytes;
# unset leaves it unset).
# VIRTUAL=0 runs real compute instead, with one worker pinned per core
# (WORKER_CPUS="0 1" by default): use it with PS=2 and a wider model, e.g.
# LAYERS="[784, 512, 2048, 512, 10]" (overrides the generated layer list;
# utilization is then per stage of however many units it gets).
#
# Per run, OUT_DIR/NAME.json holds the job's status, each stage's forward
# (train), backward and weight gradient seconds, scraped from the workers'
# /metrics, what `pipemarectl simulate` predicts for the same plan, and the
# workers' peak resident sets during the job above their resident sets at
# its start (VmHWM reset before it, less VmRSS then).
# Utilization of a stage = (forward + backward + W seconds) / training seconds.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
bin=${BIN_DIR:-$root/build/bin}
out=${1:-$root/out/pipeline}
PS=${PS:-"2 4 8 16 32"}
NS=${NS:-"4 8"}
SCHEDULES=${SCHEDULES:-"gpipe 1f1b zero_bubble pipedream pipedream_2bw async pipemare"}
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
  export WORKER_FLAGS="--virtual-device $FWD_MS,$BWD_MS${W_MS:+,$W_MS} ${WORKER_FLAGS:-}"
else
  export WORKER_CPUS=${WORKER_CPUS:-"0 1"}
  # Tensors of 64 KiB and more straight from mmap, so a freed one leaves the
  # resident set: each job's peak RSS (VmHWM, reset before it) is then its
  # own, not the largest heap an earlier job on the same worker left.
  export MALLOC_MMAP_THRESHOLD_=${MALLOC_MMAP_THRESHOLD_:-65536}
fi
source "$root/bench/cluster.sh" "$max_p"

cd "$root"
for p in $PS; do
  for n in $NS; do
    microbatches=$((MICROBATCHES_PER_STAGE * p))
    microbatches=$(((microbatches + n - 1) / n * n))  # whole steps
    for schedule in $SCHEDULES; do
      name="p${p}-n${n}-${schedule}"
      recompute=""
      if [ -n "${RECOMPUTE:-}" ]; then
        case "$RECOMPUTE:$schedule" in false:pipemare | false:async) continue ;; esac
        recompute=", recompute: $RECOMPUTE"
        name="$name-rc$RECOMPUTE"
      fi
      [ "$schedule" != pipedream_2bw ] || [ "$n" -ge $((p - 1)) ] || continue
      cat >"$work/spec.yaml" <<SPEC
name: $name
model: {type: mlp, layers: ${LAYERS:-$(mlp_layers "$p" "$WIDTH")}, activation: relu}
data: {type: mnist, path: data/mnist, train_limit: $((microbatches * MICROBATCH)), test_limit: $MICROBATCH}
optimizer: {type: sgd, lr: 0.01}
schedule: {type: $schedule, stages: $p, microbatch_size: $MICROBATCH, microbatches_per_step: $n,
           lr_anneal_steps: 100, discrepancy_decay: 0.1, wire_dtype: $WIRE_DTYPE,
           transport: $TRANSPORT$min_bytes$recompute}
train: {epochs: 1, seed: 1, shuffle: false}
SPEC
      # The plan's prediction on the same model of time (W's share as the
      # virtual device's; a recompute costs a forward more, there and here).
      w_share=$(python3 -c "b=$BWD_MS; w=${W_MS:-$BWD_MS/2}; print(w / (b + ${W_MS:-0}) if b + ${W_MS:-0} else 0.5)")
      bwd_cost=$(python3 -c "print(($BWD_MS + ${W_MS:-0}) / $FWD_MS if $FWD_MS else 2)")
      "$bin/pipemarectl" --output json simulate "$work/spec.yaml" --steps $((microbatches / n)) \
        --backward-cost "$bwd_cost" --weight-share "$w_share" >"$work/predicted.json"
      reset_peak_rss
      rss_before=$(rss_kib VmRSS)
      id=$(run_job "$work/spec.yaml" "$work/status.json")
      stage_compute_metrics "$id" "$work/metrics.txt"
      python3 - "$work/status.json" "$work/metrics.txt" "$out/$name.json" \
        "$p" "$n" "$schedule" "$microbatches" "$MICROBATCH" "$VIRTUAL" "$FWD_MS" "$BWD_MS" \
        "$work/predicted.json" "$(rss_kib VmHWM)" "${RECOMPUTE:-default}" "$work/spec.yaml" \
        "$rss_before" <<'PY'
import json, re, sys
status = json.load(open(sys.argv[1]))
layers = [int(x) for x in re.search(r'layers: \[([^\]]*)\]', open(sys.argv[15]).read()).group(1).split(',')]
busy = {}
for line in open(sys.argv[2]):
    m = re.match(r'pipemare_stage_(forward|backward|weight_gradient)_seconds_sum\{(.*)\} (\S+)', line)
    if not m: continue
    labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group(2)))
    if m.group(1) == "forward" and labels.get("phase") != "train": continue
    stage = int(labels["stage"])
    busy[stage] = busy.get(stage, 0.0) + float(m.group(3))
p, n, mbs, mb = int(sys.argv[4]), int(sys.argv[5]), int(sys.argv[7]), int(sys.argv[8])
predicted = json.load(open(sys.argv[12]))
json.dump({"p": p, "n": n, "schedule": sys.argv[6], "microbatches": mbs, "microbatch": mb,
           "virtual": sys.argv[9] == "1", "fwd_ms": float(sys.argv[10]), "bwd_ms": float(sys.argv[11]),
           "recompute": sys.argv[14], "state": status["state"], "metrics": status.get("metrics", {}),
           "busy_seconds": [busy.get(i, 0.0) for i in range(p)],
           "predicted_utilization": predicted["predicted_utilization"],
           "held_by_formula": [s["held_by_formula"] for s in predicted["per_stage"]],
           "peak_saved_activations": [int(s.get("peak_memory", {}).get("saved_activations", 0))
                                      for s in status.get("stages", [])],
           "peak_stash": [int(s.get("peak_memory", {}).get("stash", 0))
                          for s in status.get("stages", [])],
           # Each worker's peak resident set during the job, above what it
           # held when the job started (workers outlive jobs).
           "peak_rss_kib": [int(h) - int(b) for h, b in zip(sys.argv[13].split(), sys.argv[16].split())],
           # A microbatch's saved stage input (and the last stage's targets;
           # and its output, the loss on the last stage, where a real device
           # keeps the graph), when each stage is one unit of the MLP.
           "saved_bytes_per_microbatch": [
               layers[i] * mb * 4 + (mb * 8 if i == p - 1 else 0) +
               (0 if predicted["recompute"] or sys.argv[9] == "1"  # the virtual device keeps none
                else (4 if i == p - 1 else layers[i + 1] * mb * 4))
               for i in range(p)] if len(layers) == p + 1 else None},
          open(sys.argv[3], "w"))
PY
      echo "$name: $(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["state"])' \
        "$work/status.json")" >&2
    done
  done
done
