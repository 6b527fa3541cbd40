#!/usr/bin/env bash
# Thread wake-ups per message: context switches per stage event (a forward
# or a backward, each one received and one sent message), by thread name,
# over all workers, while bench/overhead.sh's job runs (the virtual device
# with zero compute, gpipe, N = 1, P = 8: one microbatch at a time, so
# every switch is on its path). Samples each worker's per-thread switch
# counters (/proc/PID/task/*/status) and the stages' forward and backward
# counts (their /metrics) SECONDS apart, mid-run.
#
#   bench/context_switches.sh    (knobs: WIDTH=256, MICROBATCH=8 (8 KiB),
#                                 SECONDS_SAMPLED=10, TRANSPORT=grpc)
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
bin=${BIN_DIR:-$root/build/bin}
p=8
WIDTH=${WIDTH:-256}
MICROBATCH=${MICROBATCH:-8}
SECONDS_SAMPLED=${SECONDS_SAMPLED:-10}
TRANSPORT=${TRANSPORT:-grpc}
export WORKER_FLAGS="--virtual-device 0,0 ${WORKER_FLAGS:-}"
source "$root/bench/cluster.sh" "$p"
cd "$root"
microbatches=20000 # far more than the sampled window needs; cancelled after it
cat >"$work/spec.yaml" <<SPEC
name: context-switches
model: {type: mlp, layers: $(mlp_layers "$p" "$WIDTH"), activation: relu}
data: {type: mnist, path: data/mnist, train_limit: $((microbatches * MICROBATCH)), test_limit: $MICROBATCH}
optimizer: {type: sgd, lr: 0.01}
schedule: {type: gpipe, stages: $p, microbatch_size: $MICROBATCH, microbatches_per_step: 1,
           transport: $TRANSPORT}
train: {epochs: 1, seed: 1, shuffle: false}
SPEC
id=$(ctl submit "$work/spec.yaml" --output json | python3 -c 'import json,sys; print(json.load(sys.stdin)["id"])')
# Until every stage has trained a while (the first microbatches warm up).
for _ in $(seq 600); do
  ctl status "$id" --output json >"$work/status.json"
  grep -q '"RUNNING"' "$work/status.json" && break
  sleep 0.5
done
sleep 5
switches() { # pid name count, one line per thread
  for pid in "${worker_pids[@]}"; do
    for t in /proc/"$pid"/task/*; do
      echo "$pid:$(basename "$t") $(tr ' ' _ <"$t/comm") \
        $(awk '/ctxt_switches/ {s += $2} END {print s}' "$t/status" 2>/dev/null)"
    done
  done 2>/dev/null | sort
}
events="pipemare_stage_(forward|backward)_seconds_count"
switches >"$work/s1"
stage_metrics "$id" "$events" "$work/m1"
sleep "$SECONDS_SAMPLED"
switches >"$work/s2"
stage_metrics "$id" "$events" "$work/m2"
ctl cancel "$id" >/dev/null
python3 - "$work" "$WIDTH" "$MICROBATCH" "$TRANSPORT" <<'PY'
import collections, re, sys
w = sys.argv[1]
def threads(f):
    return {k: (name, int(n)) for k, name, n in (l.split() for l in open(f) if len(l.split()) == 3)}
def events(f):
    return sum(float(l.rsplit(" ", 1)[1]) for l in open(f)
               if re.match(r'pipemare_stage_(forward\S*phase="train"|backward)', l))
a, b = threads(w + "/s1"), threads(w + "/s2")
n = events(w + "/m2") - events(w + "/m1")
by = collections.Counter()
for k, (name, c) in b.items():
    by[name] += c - a.get(k, (name, 0))[1]
kib = int(sys.argv[2]) * int(sys.argv[3]) * 4 / 1024
print("transport %s, %.0f KiB tensors, P = 8: %d stage events (forwards and backwards) sampled"
      % (sys.argv[4], kib, n))
print()
print("| thread | context switches per stage event |")
print("|---|---|")
for name, c in by.most_common():
    if c / n >= 0.01:
        print("| %s | %.2f |" % (name, c / n))
print("| all | %.2f |" % (sum(by.values()) / n))
PY
