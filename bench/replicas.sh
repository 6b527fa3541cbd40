#!/usr/bin/env bash
# Data parallelism across pipelines (schedule.replicas) on the virtual device
# (pipemare-worker --virtual-device FWD_MS,BWD_MS: each unit's compute is a
# sleep, every message, tensor, all-reduce and schedule decision is real).
# For each schedule and R, R pipelines of P stages train STEPS steps of N
# microbatches of MB examples each (R x as many examples as R = 1), and the
# table gives samples/s, its ratio to R = 1 measured in the same run, and
# the all-reduce's share of the run: the stages' mean all-reduce seconds
# over the training seconds.
#   bench/replicas.sh            (knobs: P=4 N=4 MB=8 STEPS=48 RS="1 2 4"
#                                 SCHEDULES="gpipe pipemare" FWD_MS=4 BWD_MS=8 WIDTH=256)
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
bin=${BIN_DIR:-$root/build/bin}
P=${P:-4} N=${N:-4} MB=${MB:-8} STEPS=${STEPS:-48} RS=${RS:-"1 2 4"}
SCHEDULES=${SCHEDULES:-"gpipe pipemare"} FWD_MS=${FWD_MS:-4} BWD_MS=${BWD_MS:-8} WIDTH=${WIDTH:-256}
max_r=0
for r in $RS; do [ "$r" -gt "$max_r" ] && max_r=$r; done
export WORKER_FLAGS="--virtual-device $FWD_MS,$BWD_MS ${WORKER_FLAGS:-}"
source "$root/bench/cluster.sh" $((max_r * P))
cd "$root"
echo "| schedule | R | workers | effective batch | samples/s | vs R = 1 | all-reduce share of training | all-reduce bytes per stage step |"
echo "|---|---|---|---|---|---|---|---|"
for schedule in $SCHEDULES; do
  base=""
  for r in $RS; do
    cat >"$work/spec.yaml" <<SPEC
name: replicas-$schedule-$r
model: {type: mlp, layers: $(mlp_layers "$P" "$WIDTH"), activation: relu}
data: {type: mnist, path: data/mnist, train_limit: $((STEPS * r * N * MB)), test_limit: $MB}
optimizer: {type: sgd, lr: 0.01}
schedule: {type: $schedule, stages: $P, replicas: $r, microbatch_size: $MB, microbatches_per_step: $N,
           lr_anneal_steps: 100, discrepancy_decay: 0.1}
train: {epochs: 1, seed: 1, shuffle: false}
SPEC
    run_job "$work/spec.yaml" "$work/status.json" >/dev/null
    row=$(python3 - "$work/status.json" "$r" "$P" "$N" "$MB" "$schedule" "${base:-0}" <<'PY'
import json, sys
s = json.load(open(sys.argv[1]))
r, p, n, mb, schedule, base = int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]), sys.argv[6], float(sys.argv[7])
assert s["state"] == "SUCCEEDED", s.get("reason")
rate = s["metrics"]["samples_per_second"]
train = s["epochs"][0]["seconds"]
stages = s.get("stages", [])
share = sum(float(st.get("allreduce_seconds", 0)) for st in stages) / len(stages) / train
steps = max(1, int(stages[0].get("allreduces", 0))) if stages else 1
per = sum(int(st.get("allreduce_bytes", 0)) for st in stages) / len(stages) / steps
ratio = f"{rate / base:.2f}x" if base else "1.00x"
print(f"| {schedule} | {r} | {r * p} | {r * n * mb} | {rate:.0f} | {ratio} | {100 * share:.1f}% | {per / 1024:.0f} KiB |")
print(rate)
PY
)
    echo "$row" | head -1
    [ -n "$base" ] || base=$(echo "$row" | tail -1)
  done
done
