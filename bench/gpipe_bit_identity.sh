#!/usr/bin/env bash
# Whether two builds train gpipe bit for bit alike: the same job (2 stages, 12,800 MNIST examples,
# 2 epochs, shuffled, momentum) on each build's own local cluster; prints each epoch's train and test
# loss (every digit of the double) and the SHA-256 of the final checkpoint's unit files, then
# "IDENTICAL" or the difference.
#   bench/gpipe_bit_identity.sh OLD_BIN_DIR NEW_BIN_DIR
# e.g. with a worktree of the older commit built into OLD_BIN_DIR.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
run() {
  (
    bin=$(realpath "$1")
    # shellcheck source=bench/cluster.sh
    source "$root/bench/cluster.sh" 2
    cat >"$work/job.yaml" <<YAML
name: bit-identity
model: {type: mlp, layers: [784, 128, 10]}
data: {type: mnist, path: $root/data/mnist, train_limit: 12800, test_limit: 2000}
optimizer: {type: sgd, lr: 0.05, momentum: 0.9}
schedule: {type: gpipe, stages: 2, microbatch_size: 32, microbatches_per_step: 4}
train: {epochs: 2, seed: 5}
checkpoint: {dir: $work/ckpt}
YAML
    run_job "$work/job.yaml" "$work/status.json" >/dev/null
    python3 -c 'import json,sys; s=json.load(open(sys.argv[1])); print(s["state"]); [print("epoch", e["epoch"], repr(e["train_loss"]), repr(e["test_loss"])) for e in s["epochs"]]' "$work/status.json"
    find "$work/ckpt" -name 'unit-*.pt' -print0 | sort -z | xargs -0 sha256sum | awk '{print "unit", $1}'
  )
}
old=$(run "$1")
new=$(run "$2")
echo "$old"
if [ "$old" = "$new" ]; then echo IDENTICAL; else echo DIFFERENT; diff <(echo "$old") <(echo "$new") || true; fi
