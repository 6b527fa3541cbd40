#!/usr/bin/env bash
# The paper's comparison on our system: a fine-grained MLP on MNIST with one
# stage per layer, every schedule with the same hyperparameters and epochs,
# through real worker processes (one coordinator, max(P) workers, loopback).
#
#   bench/convergence.sh [OUT_DIR]          (default out/convergence)
#
# Knobs (environment): PS="8 16", NS="1 4", OPTIMIZERS="momentum plain",
# SCHEDULES="gpipe pipemare pipedream async", EPOCHS=2, TRAIN_LIMIT=20000,
# TEST_LIMIT=5000, WIDTH=128, LR_MOMENTUM=0.05, LR_PLAIN=0.2, WARMUP_EPOCHS=0
# (T3: that many synchronous epochs first; the asynchronous schedules only,
# and runs are then named with a "-wN" suffix), SEED=1 (weights and shuffling;
# another seed adds "-sS" to the names), ANNEAL_EPOCHS=1 (T1's K in epochs;
# another adds "-kK" to pipemare's names).
# "momentum" is SGD with momentum 0.9; "plain" is SGD without momentum.
# A schedule written SCHEDULE.sc runs SCHEDULE with
# schedule.spike_compensation: true, SCHEDULE.lwp with weight_prediction: true
# (and T2 off), SCHEDULE.sc.lwp with both (e.g. async.sc.lwp), SCHEDULE.dc
# with delay_compensation: 2 (SCHEDULE.dc0p5: λ0 = 0.5), SCHEDULE.rc with
# recompute: true (the backward recomputes the forward; the default keeps its
# graph where the schedule allows). Any schedule.type works: 1f1b,
# zero_bubble, pipedream_2bw (N >= P - 1) as well.
#
# For each run it writes OUT_DIR/NAME.status.json (the final job status),
# OUT_DIR/NAME.curve (step and training loss, polled from the job while it
# runs) and OUT_DIR/NAME.metrics (each stage's busy and idle seconds, scraped
# from the workers' /metrics). bench/convergence_report.py turns them into
# the Markdown table of docs/benchmarks.md; bench/convergence.gp into
# docs/convergence.png.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
bin=${BIN_DIR:-$root/build/bin}
out=${1:-$root/out/convergence}
PS=${PS:-"8 16"}
NS=${NS:-"1 4"}
OPTIMIZERS=${OPTIMIZERS:-"momentum plain"}
SCHEDULES=${SCHEDULES:-"gpipe pipemare pipedream async"}
EPOCHS=${EPOCHS:-2}
TRAIN_LIMIT=${TRAIN_LIMIT:-20000}
TEST_LIMIT=${TEST_LIMIT:-5000}
WIDTH=${WIDTH:-128}
LR_MOMENTUM=${LR_MOMENTUM:-0.05}
LR_PLAIN=${LR_PLAIN:-0.2}
WARMUP_EPOCHS=${WARMUP_EPOCHS:-0}
SEED=${SEED:-1}
ANNEAL_EPOCHS=${ANNEAL_EPOCHS:-1}
mkdir -p "$out"
max_p=0
for p in $PS; do [ "$p" -gt "$max_p" ] && max_p=$p; done
source "$root/bench/cluster.sh" "$max_p"

cd "$root"
for p in $PS; do
  for n in $NS; do
    for opt in $OPTIMIZERS; do
      if [ "$opt" = momentum ]; then
        optimizer="{type: sgd, lr: $LR_MOMENTUM, momentum: 0.9, lr_schedule: cosine}"
      else
        optimizer="{type: sgd, lr: $LR_PLAIN, lr_schedule: cosine}"
      fi
      for schedule in $SCHEDULES; do
        name="p${p}-n${n}-${opt}-${schedule}"
        # SCHEDULE[.sc][.lwp]: the corrections beyond the paper.
        type=${schedule%%.*}
        extra=", discrepancy_decay: 0.1"
        for option in $(echo "${schedule#"$type"}" | tr '.' ' '); do
          case "$option" in
            sc) extra="$extra, spike_compensation: true" ;;
            # Prediction and T2 pull in opposite directions: one or the other.
            lwp) extra="${extra/, discrepancy_decay: 0.1/}, weight_prediction: true" ;;
            # Delay compensation (DC-ASGD) with λ0 = 2, or .dcX with λ0 = X
            # (p for the decimal point: .dc0p5 is 0.5).
            dc) extra="$extra, delay_compensation: 2" ;;
            dc[0-9]*) lambda=${option#dc}; extra="$extra, delay_compensation: ${lambda/p/.}" ;;
            # Recompute the forward in the backward (schedule.recompute).
            rc) extra="$extra, recompute: true" ;;
            *) echo "convergence.sh: unknown option .$option in $schedule" >&2; exit 2 ;;
          esac
        done
        # T3's warm-up is for the asynchronous schedules.
        case "$type" in gpipe | 1f1b | zero_bubble) synchronous=1 ;; *) synchronous=0 ;; esac
        if [ "$WARMUP_EPOCHS" != 0 ] && [ "$synchronous" = 0 ]; then
          extra="$extra, warmup_epochs: $WARMUP_EPOCHS"
          name="$name-w$WARMUP_EPOCHS"
        fi
        [ "$ANNEAL_EPOCHS" = 1 ] || [ "$type" != pipemare ] || name="$name-k$ANNEAL_EPOCHS"
        [ "$SEED" = 1 ] || name="$name-s$SEED"
        cat >"$work/spec.yaml" <<EOF
name: $name
model: {type: mlp, layers: $(mlp_layers "$p" "$WIDTH"), activation: relu, init: he}
data: {type: mnist, path: data/mnist, train_limit: $TRAIN_LIMIT, test_limit: $TEST_LIMIT}
optimizer: $optimizer
schedule: {type: $type, stages: $p, microbatch_size: 64, microbatches_per_step: $n,
           lr_anneal_epochs: $ANNEAL_EPOCHS$extra}
train: {epochs: $EPOCHS, seed: $SEED}
EOF
        id=$(ctl submit "$work/spec.yaml" --output json |
          python3 -c 'import json,sys; print(json.load(sys.stdin)["id"])')
        : >"$out/$name.curve"
        while true; do
          ctl status "$id" --output json >"$work/status.json" 2>/dev/null || continue
          python3 - "$work/status.json" "$out/$name.curve" <<'PY'
import json, sys
s = json.load(open(sys.argv[1]))
step = int(s.get("progress", {}).get("step", 0))
loss = s.get("metrics", {}).get("train_loss")
if loss and step > 0:
    with open(sys.argv[2], "a") as f:
        f.write("%d %.6g\n" % (step, loss))
PY
          state=$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["state"])' \
            "$work/status.json")
          case "$state" in SUCCEEDED | FAILED | CANCELLED) break ;; esac
          sleep 0.5
        done
        cp "$work/status.json" "$out/$name.status.json"
        # Each stage's busy and idle seconds, from the workers that ran it.
        stage_metrics "$id" "pipemare_stage_(busy|idle)_seconds_total" "$out/$name.metrics"
        echo "$name: $state" >&2
      done
    done
  done
done
