#!/usr/bin/env python3
"""The Markdown table of bench/convergence.sh's runs (standard library only).

  python3 bench/convergence_report.py [OUT_DIR] [TARGET]   (default out/convergence)

One row per run: final test accuracy (and with TARGET, a percentage: each
epoch's test accuracy and the training seconds until the first epoch at or
above TARGET, the time to accuracy), seconds per epoch, samples/s, peak
weight + optimizer memory (weights, optimizer state, T2 velocity, stash) per
stage (largest) and in total, and mean stage utilization (busy / (busy +
idle) of each stage's compute thread, from the workers' /metrics). Then, per
pipeline, pipedream's total weight + optimizer memory over pipemare's.
"""
import glob
import json
import os
import re
import sys

out = sys.argv[1] if len(sys.argv) > 1 else "out/convergence"
target = float(sys.argv[2]) if len(sys.argv) > 2 else None
rows = []
for path in sorted(glob.glob(os.path.join(out, "*.status.json"))):
    name = os.path.basename(path)[: -len(".status.json")]
    p, n, opt, schedule, warmup, anneal, seed = re.match(
        r"p(\d+)-n(\d+)-(\w+)-([\w.]+)(?:-w(\d+))?(?:-k(\d+))?(?:-s(\d+))?$", name).groups()
    if warmup:
        schedule += ", %s warm-up epoch%s" % (warmup, "" if warmup == "1" else "s")
    if anneal:
        schedule += ", T1 K = %s epochs" % anneal
    s = json.load(open(path))
    m = s.get("metrics", {})
    epochs = s.get("epochs", [])
    per_stage = []
    for st in s.get("stages", []):
        peak = st.get("peak_memory", {})
        per_stage.append(sum(int(peak.get(k, 0)) for k in
                             ("weights", "optimizer_state", "t2_velocity", "stash")))
    busy, idle = {}, {}
    for line in open(os.path.join(out, name + ".metrics")):
        stage = re.search(r'stage="(\d+)"', line).group(1)
        value = float(line.split()[-1])
        (busy if "_busy_" in line else idle)[stage] = value
    util = [busy[k] / (busy[k] + idle[k]) for k in busy if busy[k] + idle[k] > 0]
    rows.append(dict(
        p=int(p), n=int(n), opt=opt, schedule=schedule, state=s.get("state"), seed=int(seed or 1),
        per_epoch=[100 * float(e.get("test_accuracy", 0)) for e in epochs],
        seconds=[float(e.get("seconds", 0)) for e in epochs],
        acc=100 * float(m.get("test_accuracy", 0)),
        spe=sum(float(e.get("seconds", 0)) for e in epochs) / max(len(epochs), 1),
        sps=float(m.get("samples_per_second", 0)),
        mem_max=max(per_stage) if per_stage else 0, mem_total=sum(per_stage),
        util=sum(util) / len(util) if util else 0))

order = {"gpipe": 0, "pipemare": 1, "pipedream": 2, "async": 3}
rows.sort(key=lambda r: (r["p"], r["n"], r["opt"], r["seed"], order.get(r["schedule"], 9),
                         r["schedule"]))
kib = lambda b: "%.0f KiB" % (b / 1024)
seeds = len({r["seed"] for r in rows}) > 1


def time_to(r):
    t = 0.0
    for acc, sec in zip(r["per_epoch"], r["seconds"]):
        t += sec
        if acc >= target:
            return "%.1f s" % t
    return "not reached"


print("| P | N | optimizer | schedule |" + (" seed |" if seeds else "") + " test accuracy |" +
      (" per epoch | s to %g%% |" % target if target else "") +
      " s/epoch | samples/s | weight+opt memory, largest stage | weight+opt memory, total "
      "| mean utilization |")
print("|---|---|---|---|" + ("---|" if seeds else "") + "---|" + ("---|---|" if target else "") +
      "---|---|---|---|---|")
for r in rows:
    acc = "%.2f%%" % r["acc"] if r["state"] == "SUCCEEDED" else "%s (%.2f%%)" % (r["state"], r["acc"])
    cells = [str(r["p"]), str(r["n"]), "SGD m=0.9" if r["opt"] == "momentum" else "SGD",
             r["schedule"]]
    if seeds:
        cells.append(str(r["seed"]))
    cells.append(acc)
    if target:
        cells += [" / ".join("%.2f" % a for a in r["per_epoch"]), time_to(r)]
    cells += ["%.1f" % r["spe"], "%.0f" % r["sps"], kib(r["mem_max"]), kib(r["mem_total"]),
              "%.2f" % r["util"]]
    print("| " + " | ".join(cells) + " |")
print()
for r in rows:
    if r["schedule"] != "pipedream":
        continue
    mare = [x for x in rows if x["schedule"] == "pipemare" and
            (x["p"], x["n"], x["opt"]) == (r["p"], r["n"], r["opt"])]
    # A run that failed reports no memory: no ratio from it.
    if mare and mare[0]["mem_total"] and r["mem_total"]:
        print("P=%d N=%d %s: pipedream / pipemare weight+optimizer memory = %.2fx" % (
            r["p"], r["n"], r["opt"], r["mem_total"] / mare[0]["mem_total"]))
