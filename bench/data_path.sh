#!/usr/bin/env bash
# The coordinator's share of the data path. Trains one MNIST epoch (gpipe, 2 stages, R replicas) on
# local workers and prints, beside the epoch's data at float32 (train and test inputs, int64 targets),
#   - fed: what the stages received on the coordinator's feeds (stage 0's activation bytes and the
#     last stage's target bytes, pipemare_stage_received_bytes_total: a tensor, or a data slice's
#     message), measured the same way on any build;
#   - sent: the coordinator's own pipemare_coordinator_sent_bytes_total (builds that have it).
# Usage: bench/data_path.sh [BIN_DIR] [REPLICAS]   (default build/bin, 1)
set -euo pipefail
bin=$(realpath "${1:-build/bin}")
R=${2:-1}
mnist=$(realpath data/mnist)
# shellcheck source=bench/cluster.sh
source "$(dirname "$0")/cluster.sh" $((2 * R))
spec="$work/job.yaml"
cat >"$spec" <<YAML
name: data-path
model: {type: mlp, layers: [784, 128, 10]}
data: {type: mnist, path: $mnist}
optimizer: {type: sgd, lr: 0.05}
schedule: {type: gpipe, stages: 2, replicas: $R, microbatch_size: 64, microbatches_per_step: 4}
train: {epochs: 1, seed: 1}
YAML
[ "$R" = 1 ] && sed -i 's/ replicas: 1,//' "$spec"
id=$(run_job "$spec" "$work/status.json")
state=$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["state"])' "$work/status.json")
stage_metrics "$id" 'pipemare_stage_received_bytes_total' "$work/received"
curl -s "http://$(cat "$work/metrics_addr")/metrics" >"$work/coordinator" || true
python3 - "$work/received" "$work/coordinator" "$state" <<'PY'
import re, sys
received, coordinator, state = sys.argv[1:4]
fed = 0.0
last = max(int(m.group(1)) for m in re.finditer(r'stage="(\d+)"', open(received).read()))
for line in open(received):
    kind = re.search(r'kind="(\w+)"', line).group(1)
    stage = int(re.search(r'stage="(\d+)"', line).group(1))
    if (kind == "activation" and stage == 0) or (kind == "targets" and stage == last):
        fed += float(line.split()[-1])
sent = None
for line in open(coordinator):
    if line.startswith("pipemare_coordinator_sent_bytes_total"):
        sent = (sent or 0) + float(line.split()[-1])
dataset = (60000 + 10000) * (784 * 4 + 8)
print(f"job {state}; epoch data at float32 {dataset / 1e6:.1f} MB")
print(f"fed on the coordinator's feeds: {fed / 1e6:.3f} MB = {100 * fed / dataset:.3f}% of it")
if sent is not None:
    print(f"coordinator sent on its feeds (its metric): {sent / 1e6:.3f} MB = {100 * sent / dataset:.3f}%")
PY
