#!/usr/bin/env bash
# One job spec under several schedule variants, one after the other on one
# local cluster (one coordinator, P workers): each variant is
# TYPE[.sc][.lwp][.not2][.dc[X]][.wE] (the schedule type; .sc spike
# compensation, .lwp weight prediction, .not2 T2 off, .lwp implies .not2;
# .dc delay compensation with λ0 = 2, .dcX with λ0 = X (.dc0p5: 0.5); .wE a synchronous
# warm-up of E epochs, .nK K microbatches per step, .mbB microbatches of B,
# .sS train.seed S, .lrX optimizer.lr X, .b1X Adam's beta1 X, .aE T1 over E
# epochs; X and E write p for the decimal point: .lr0p002, .a1p5). Prints a Markdown row
# per variant with each epoch's test metric (perplexity for language models,
# accuracy otherwise) and seconds per epoch.
#   bench/spec_variants.sh SPEC VARIANT...
#   EPOCHS=3 bench/spec_variants.sh examples/transformer_lm_fortunes.yaml gpipe pipemare.n4 async
# EPOCHS overrides train.epochs. TARGET adds a column: the training seconds (the
# job's per-epoch times) until the first epoch at or better than TARGET
# (a perplexity for language models, an accuracy in % otherwise). TRACE=PREFIX
# also writes PREFIX.VARIANT.tsv: the job's step and last training loss,
# sampled every 0.3 s while it runs.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
bin=${BIN_DIR:-$root/build/bin}
spec=${1:?usage: bench/spec_variants.sh SPEC VARIANT...}
shift
[ $# -gt 0 ] || { echo "usage: bench/spec_variants.sh SPEC VARIANT..." >&2; exit 2; }
stages=$(grep -oE 'stages: *[0-9]+' "$spec" | grep -oE '[0-9]+')
source "$root/bench/cluster.sh" "$stages"
cd "$root"
if [ -n "${TARGET:-}" ]; then
  echo "| variant | test metric per epoch | s/epoch | s to $TARGET |"
  echo "|---|---|---|---|"
else
  echo "| variant | test metric per epoch | s/epoch |"
  echo "|---|---|---|"
fi
for variant in "$@"; do
  python3 - "$spec" "$variant" "${EPOCHS:-}" >"$work/spec.yaml" <<'PY'
import sys, yaml
spec = yaml.safe_load(open(sys.argv[1]))
parts = sys.argv[2].split(".")
s = spec["schedule"]
s["type"] = parts[0]
for option in parts[1:]:
    if option == "sc":
        s["spike_compensation"] = True
    elif option in ("lwp", "not2"):
        s.pop("discrepancy_decay", None)
        if option == "lwp":
            s["weight_prediction"] = True
    elif option.startswith("dc"):
        s["delay_compensation"] = float(option[2:].replace("p", ".") or 2)
    elif option.startswith("w") and option[1:2].isdigit():
        s["warmup_epochs"] = float(option[1:].replace("p", "."))
    elif option.startswith("n") and option[1:].isdigit():
        s["microbatches_per_step"] = int(option[1:])
    elif option.startswith("mb") and option[2:].isdigit():
        s["microbatch_size"] = int(option[2:])
    elif option.startswith("s") and option[1:].isdigit():
        spec["train"]["seed"] = int(option[1:])
    elif option.startswith("lr"):
        spec["optimizer"]["lr"] = float(option[2:].replace("p", "."))
    elif option.startswith("b1"):
        spec["optimizer"]["beta1"] = float(option[2:].replace("p", "."))
    elif option.startswith("a") and option[1:2].isdigit():
        s.pop("lr_anneal_steps", None)
        s["lr_anneal_epochs"] = float(option[1:].replace("p", "."))
    else:
        sys.exit(f"spec_variants.sh: unknown option .{option} in {sys.argv[2]}")
if sys.argv[3]:
    spec["train"]["epochs"] = int(sys.argv[3])
spec["name"] = "variant-" + sys.argv[2].replace("+", "-")
print(yaml.safe_dump(spec, default_flow_style=None, sort_keys=False))
PY
  id=$(ctl submit "$work/spec.yaml" --output json | python3 -c 'import json,sys; print(json.load(sys.stdin)["id"])')
  if [ -n "${TRACE:-}" ]; then
    # Sample the job's step and last training loss until it ends.
    while ctl status "$id" --output json | python3 -c '
import json, sys
j = json.load(sys.stdin)
print(j.get("progress", {}).get("step", 0), j.get("metrics", {}).get("train_loss", 0), sep="\t")
sys.exit(j["state"] in ("SUCCEEDED", "FAILED", "CANCELLED"))' >>"$TRACE.$variant.tsv"; do
      sleep 0.3
    done
  else
    ctl watch "$id" >/dev/null 2>&1 || true
  fi
  ctl status "$id" --output json | python3 -c '
import json, sys
j = json.load(sys.stdin)
name = sys.argv[1]
epochs = j.get("epochs", [])
lm = j.get("task") == "language_model" or any(e.get("test_perplexity") for e in epochs)
cells = []
for e in epochs:
    cells.append("%.2f" % e["test_perplexity"] if lm else "%.2f%%" % (100 * e.get("test_accuracy", 0)))
state = j["state"] if j["state"] != "SUCCEEDED" else ""
spe = sum(e.get("seconds", 0) for e in epochs) / max(len(epochs), 1)
row = "| %s | %s %s | %.0f |" % (name, " / ".join(cells), state, spe)
if sys.argv[2]:
    target, t, reached = float(sys.argv[2]), 0.0, "not reached"
    for e in epochs:
        t += e.get("seconds", 0)
        if (lm and e["test_perplexity"] <= target) or (
                not lm and 100 * e.get("test_accuracy", 0) >= target):
            reached = "%.0f s" % t
            break
    row += " %s |" % reached
print(row)' "$variant" "${TARGET:-}"
done
