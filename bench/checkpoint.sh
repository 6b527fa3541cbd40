#!/usr/bin/env bash
# What checkpoints and failures cost, through real coordinator and worker
# processes on loopback (4 workers, the example's MLP on MNIST, pipemare):
#
#   1. throughput with a checkpoint every 50 steps against none: ROUNDS
#      pairs of one-epoch jobs (EXAMPLES training examples) in alternating
#      order, in one run, samples/s as the coordinator reports it; the ratio
#      of the medians, and every sample.
#   2. a worker killed with SIGKILL mid-job, a spare idle: the job recovers
#      by itself; seconds from the kill until it is detected (RECOVERING) and
#      until the first step trained after recovery (JobStatus.restarts).
#   2b. a worker stopped with SIGTERM mid-job: seconds until it has exited
#      (its job drained and cut a checkpoint first), and the steps lost.
#   3. the coordinator killed with SIGKILL mid-job and restarted on its state
#      directory: seconds from the restart until the job has trained its
#      first step after the cut (the workers re-register by themselves).
#
#   bench/checkpoint.sh            (prints the Markdown rows of docs/benchmarks.md)
# Knobs: ROUNDS=4, EXAMPLES=19200, EVERY=50.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
bin=${BIN_DIR:-$root/build/bin}
ROUNDS=${ROUNDS:-4}
EXAMPLES=${EXAMPLES:-19200}
EVERY=${EVERY:-50}

# Plaintext, as every benchmark row before TLS was measured (the binaries
# read PIPEMARE_INSECURE; older builds that compare_builds.sh runs ignore it).
export PIPEMARE_INSECURE=1
work=$(mktemp -d)
trap 'kill $(jobs -p) 2>/dev/null || true; rm -rf "$work"' EXIT
state="$work/state"

start_coordinator() {
  rm -f "$work/addr"
  "$bin/pipemare-coordinator" --listen "${1:-127.0.0.1:0}" --address-file "$work/addr" \
    --metrics-listen 127.0.0.1:0 --state-dir "$state" --worker-timeout 3 \
    2>>"$work/coordinator.log" &
  coordinator=$!
  for _ in $(seq 100); do [ -s "$work/addr" ] && break; sleep 0.1; done
  addr=$(cat "$work/addr")
}
start_worker() {
  "$bin/pipemare-worker" --coordinator "$addr" --listen 127.0.0.1:0 --threads 1 \
    --metrics-listen 127.0.0.1:0 --coordinator-timeout 4 2>>"$work/worker-$1.log" &
  worker_pid[$1]=$!
}
ctl() { "$bin/pipemarectl" --coordinator "$addr" "$@"; }
field() { python3 -c 'import json,sys
d=json.load(sys.stdin)
for k in sys.argv[1].split("."): d=d.get(k, {}) if isinstance(d, dict) else {}
print(d if d != {} else 0)' "$1"; }
now() { date +%s.%N; }
idle_workers() { ctl workers --output json | grep -c '"IDLE"' || true; }
wait_idle() { for _ in $(seq 600); do [ "$(idle_workers)" -ge "$1" ] && return; sleep 0.1; done; }
wait_state() {  # JOB STATE...
  while true; do
    s=$(ctl status "$1" --output json | field state)
    for want in "${@:2}"; do [ "$s" = "$want" ] && return; done
    sleep 0.1
  done
}
wait_step_above() {  # JOB STEP
  while [ "$(ctl status "$1" --output json | field progress.step)" -le "$2" ]; do sleep 0.05; done
}
wait_checkpoint() {  # JOB: until a cut is committed
  while [ "$(ctl status "$1" --output json | field checkpoint.step)" -eq 0 ]; do sleep 0.1; done
}
spec() {  # NAME EVERY_STEPS
  cat >"$work/$1.yaml" <<EOF
name: $1
model: {type: mlp, layers: [784, 512, 512, 256, 10], activation: relu}
data: {type: mnist, path: $root/data/mnist, train_limit: $EXAMPLES, test_limit: 2000}
optimizer: {type: sgd, lr: 0.03, momentum: 0.9, lr_schedule: cosine}
schedule: {type: pipemare, stages: 4, microbatch_size: 64, lr_anneal_steps: 500,
           discrepancy_decay: 0.1}
train: {epochs: 1, seed: 1}
checkpoint: {every_steps: $2, dir: $work/checkpoints}
EOF
  echo "$work/$1.yaml"
}
submit() { ctl submit "$1" --output json | field id; }

start_coordinator
for i in 1 2 3 4 5; do start_worker "$i"; done
wait_idle 5

# 1. Throughput, alternating.
with=() without=()
for r in $(seq "$ROUNDS"); do
  # Odd rounds run the job without checkpoints first, even rounds second:
  # whatever the order costs falls on both sides alike.
  order="0 $EVERY"
  [ $((r % 2)) -eq 0 ] && order="$EVERY 0"
  for every in $order; do
    id=$(submit "$(spec "tp-$r-$every" "$every")")
    wait_state "$id" SUCCEEDED FAILED CANCELLED
    sps=$(ctl status "$id" --output json | field metrics.samples_per_second)
    if [ "$every" = 0 ]; then without+=("$sps"); else with+=("$sps"); last_with=$id; fi
  done
done
median() { printf '%s\n' "$@" | sort -g | awk '{a[NR]=$1} END {print (NR%2 ? a[(NR+1)/2] : (a[NR/2]+a[NR/2+1])/2)}'; }
m0=$(median "${without[@]}")
m1=$(median "${with[@]}")
echo "| checkpoint every $EVERY steps vs none (4 stages, $EXAMPLES examples, $ROUNDS rounds) | $(printf '%.0f' "$m1") vs $(printf '%.0f' "$m0") samples/s | $(python3 -c "print(f'{$m1/$m0:.3f}x')") |"
echo "samples/s with: ${with[*]}; without: ${without[*]}" >&2
# What the cuts cost the compute threads, read from the workers' own
# metrics for the last job with checkpoints: the share of each stage's busy
# time spent copying its state to host memory (the only work a cut adds to
# training; the write runs on another thread).
cut_share() {  # JOB
  ctl workers --output json | python3 -c '
import json, sys, urllib.request
job = sys.argv[1]
snap, busy, cuts = {}, {}, {}
for w in json.load(sys.stdin).get("workers", []):
    addr = w.get("metricsAddress") or w.get("metrics_address")
    if not addr: continue
    for line in urllib.request.urlopen("http://" + addr + "/metrics").read().decode().splitlines():
        if "job_id=\"" + job + "\"" not in line: continue
        stage = line.split("stage=\"")[1].split("\"")[0]
        v = float(line.rsplit(" ", 1)[1])
        if line.startswith("pipemare_stage_checkpoint_snapshot_seconds_sum"): snap[stage] = v
        if line.startswith("pipemare_stage_checkpoint_snapshot_seconds_count"): cuts[stage] = v
        if line.startswith("pipemare_stage_busy_seconds_total"): busy[stage] = v
shares = {s: snap[s] / busy[s] for s in snap if busy.get(s)}
worst = max(shares, key=shares.get)
print(f"{100*shares[worst]:.2f}% (stage {worst}: {int(cuts[worst])} cuts, {1000*snap[worst]/cuts[worst]:.2f} ms each) | stages: " +
      ", ".join(f"{s}: {100*shares[s]:.2f}%" for s in sorted(shares)))' "$1"
}
echo "| checkpoint every $EVERY steps: compute-thread time in cuts, worst stage | $(cut_share "$last_with") |"

# 2. A worker killed mid-job; a spare is idle; recovery is automatic.
restart() {  # JOB FIELD: the job's first restart's field
  ctl status "$1" --output json | python3 -c 'import json,sys
r=(json.load(sys.stdin).get("restarts") or [{}])[0]
print(r.get(sys.argv[1], 0))' "$2"
}
stage_worker() {  # JOB STAGE: the index of the worker serving it (last loaded)
  local found=""
  for i in "${!worker_pid[@]}"; do
    if grep -q "job=$1 stage=$2 loaded stage" "$work/worker-$i.log" 2>/dev/null; then found=$i; fi
  done
  echo "$found"
}
id=$(submit "$(spec kill-worker "$EVERY")")
wait_checkpoint "$id"
victim=$(stage_worker "$id" 1)
t0=$(date +%s%3N)
kill -9 "${worker_pid[$victim]}"
wait_state "$id" SUCCEEDED FAILED
detected=$(restart "$id" detected_unix_ms)
recover=$(restart "$id" recover_seconds)
echo "| worker SIGKILL: kill to detection (RECOVERING) | $(python3 -c "print(f'{($detected-$t0)/1000:.2f} s')") | |"
echo "| worker SIGKILL: kill to the first step trained after recovery (spare idle) | $(python3 -c "print(f'{($detected-$t0)/1000+$recover:.2f} s')") | job $(ctl status "$id" --output json | field state), from step $(restart "$id" from_step) (failed at $(restart "$id" failed_at_step)) |"
start_worker 6  # the next spare
wait_idle 1

# 2b. A worker stopped with SIGTERM mid-job: it drains, and leaves.
id=$(submit "$(spec leave-worker 0)")
wait_step_above "$id" 100
victim=$(stage_worker "$id" 1)
t0=$(now)
kill -TERM "${worker_pid[$victim]}"
wait "${worker_pid[$victim]}" 2>/dev/null || true
t1=$(now)
wait_state "$id" SUCCEEDED FAILED
lost=$(( $(restart "$id" failed_at_step) - $(restart "$id" from_step) ))
echo "| worker SIGTERM: to its exit (job drained, cut at its last step) | $(python3 -c "print(f'{$t1-$t0:.2f} s')") | job $(ctl status "$id" --output json | field state), $lost steps lost |"

# 3. The coordinator killed mid-job and restarted on its state directory.
id=$(submit "$(spec kill-coordinator "$EVERY")")
wait_checkpoint "$id"
cut=$(ctl status "$id" --output json | field checkpoint.step)
kill -9 "$coordinator"
wait "$coordinator" 2>/dev/null || true
t0=$(now)
start_coordinator "$addr"
wait_step_above "$id" "$cut"
t1=$(now)
wait_state "$id" SUCCEEDED FAILED
echo "| coordinator SIGKILL + restart: to the first step after the cut | $(python3 -c "print(f'{$t1-$t0:.1f} s')") | job $(ctl status "$id" --output json | field state) |"
