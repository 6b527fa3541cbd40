#!/usr/bin/env bash
# The delay-tolerance diagnostic: the fine-grained MLP of bench/convergence.sh
# trained in one process with every gradient applied a uniform tau steps late,
# for each correction (bench/delay_tolerance.cc), at each learning rate; a
# table of test accuracy per (lr, correction) against tau, and a plot.
#   bench/delay_tolerance.sh [OUT_DIR]     (default out/delay_tolerance)
# Knobs: LRS="0.05 0.02 0.01", TAUS=0,1,2,4,8, TRAIN_LIMIT=12800, TEST_LIMIT=2000,
# EPOCHS=1, MOMENTUM=0.9, PNG=docs/delay_tolerance.png (needs gnuplot).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
bin=${BIN_DIR:-$root/build/bin}
out=${1:-$root/out/delay_tolerance}
LRS=${LRS:-"0.05 0.02 0.01"}
mkdir -p "$out"
cd "$root"
[ -s data/mnist/train-images-idx3-ubyte ] || scripts/fetch-mnist.sh data/mnist
for lr in $LRS; do
  "$bin/bench_delay_tolerance" --data data/mnist --taus "${TAUS:-0,1,2,4,8}" --lr "$lr" \
    --momentum "${MOMENTUM:-0.9}" --epochs "${EPOCHS:-1}" --train-limit "${TRAIN_LIMIT:-12800}" \
    --test-limit "${TEST_LIMIT:-2000}" >"$out/lr$lr.csv"
done
python3 - "$out" $LRS <<'PY'
import csv, sys
out, lrs = sys.argv[1], sys.argv[2:]
rows = {lr: list(csv.DictReader(open(f"{out}/lr{lr}.csv"))) for lr in lrs}
taus = sorted({int(r["tau"]) for lr in lrs for r in rows[lr]})
print("| lr | correction | " + " | ".join(f"τ = {t}" for t in taus) + " |")
print("|---|---|" + "---|" * len(taus))
for lr in lrs:
    for c in dict.fromkeys(r["correction"] for r in rows[lr]):
        cells = []
        for t in taus:
            r = next(r for r in rows[lr] if r["correction"] == c and int(r["tau"]) == t)
            cells.append("diverged" if r["diverged"] == "1" else f"{100 * float(r['test_accuracy']):.1f}%")
        print(f"| {lr} | {c} | " + " | ".join(cells) + " |")
    # The same data for gnuplot: tau, then one accuracy column per correction.
    corrections = list(dict.fromkeys(r["correction"] for r in rows[lr]))
    with open(f"{out}/lr{lr}.dat", "w") as f:
        f.write("# tau " + " ".join(corrections) + "\n")
        for t in taus:
            vals = []
            for c in corrections:
                r = next(r for r in rows[lr] if r["correction"] == c and int(r["tau"]) == t)
                vals.append("0" if r["diverged"] == "1" else r["test_accuracy"])
            f.write(f"{t} " + " ".join(vals) + "\n")
PY
if command -v gnuplot >/dev/null; then
  gnuplot -e "dir='$out'; lrs='$LRS'; png='${PNG:-docs/delay_tolerance.png}'" bench/delay_tolerance.gp
fi
