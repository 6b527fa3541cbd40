#!/usr/bin/env bash
# Convergence and speed of one spec under each schedule, side by side on one
# local cluster (one coordinator, P workers), over several seeds.
#   bench/mnist_schedules.sh [SPEC] [SEED...]      (default: the example, seeds 1 2 3)
# SCHEDULES (default "pipemare gpipe pipedream async") picks the schedules.
# Prints one Markdown row per run: schedule, seed, final test accuracy,
# seconds per epoch, samples/s. Copy the table into docs/benchmarks.md.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
bin=${BIN_DIR:-$root/build/bin}
spec=${1:-$root/examples/mnist_pipemare.yaml}
shift || true
seeds=(1 2 3)
[ $# -gt 0 ] && seeds=("$@")
stages=$(grep -oE 'stages: *[0-9]+' "$spec" | grep -oE '[0-9]+')
source "$root/bench/cluster.sh" "$stages"
cd "$root"
echo "| schedule | seed | test accuracy | s/epoch | samples/s |"
echo "|---|---|---|---|---|"
for schedule in ${SCHEDULES:-pipemare gpipe pipedream async}; do
  for seed in "${seeds[@]}"; do
    sed -E "s/type: (pipemare|gpipe|pipedream|async), stages/type: $schedule, stages/; s/seed: *[0-9]+/seed: $seed/" \
      "$spec" > "$work/spec.yaml"
    "$bin/pipemarectl" --coordinator "$addr" submit "$work/spec.yaml" --wait >/dev/null 2>&1 || true
    id=$("$bin/pipemarectl" --coordinator "$addr" list --output json |
      python3 -c 'import json,sys; print(json.load(sys.stdin)["jobs"][-1]["id"])')
    "$bin/pipemarectl" --coordinator "$addr" status "$id" --output json | python3 -c '
import json, sys
j = json.load(sys.stdin)
e = j.get("epochs", [])
spe = sum(x["seconds"] for x in e) / max(len(e), 1)
print("| %s | %s | %.2f%% | %.1f | %.0f |" % (j["schedule"], j["spec"]["train"].get("seed", 0),
      100 * j["metrics"].get("test_accuracy", 0), spe, j["metrics"].get("samples_per_second", 0)))'
  done
done
