#!/usr/bin/env python3
"""Markdown table of bench/pipeline.sh's output, with the theory alongside.

    python3 bench/pipeline_report.py out/pipeline

Per run: mean and lowest stage utilization (forward + backward seconds over
training seconds), the theory, and samples/s; per (P, N), the throughput
ratio of pipemare to gpipe next to (N + P - 1) / N.

Theory: gpipe keeps a stage busy N / (N + P - 1) of a step. The asynchronous
schedules (1F1B) keep it busy all of the steady state; over a run of M
microbatches that starts filled and ends drained, M / (M + P - 1).
"""
import glob
import json
import os
import sys


def main():
    out = sys.argv[1] if len(sys.argv) > 1 else "out/pipeline"
    runs = [json.load(open(f)) for f in sorted(glob.glob(os.path.join(out, "*.json")))]
    order = {"gpipe": 0, "pipedream": 1, "async": 2, "pipemare": 3}
    runs.sort(key=lambda r: (r["p"], r["n"], order.get(r["schedule"], 9)))
    print("| P | N | schedule | mean utilization | lowest stage | theory (run) | theory (steady) "
          "| samples/s | state |")
    print("|---|---|---|---|---|---|---|---|---|")
    rate = {}
    for r in runs:
        p, n, m = r["p"], r["n"], r["microbatches"]
        sps = r["metrics"].get("samples_per_second", 0.0)
        train_seconds = m * r["microbatch"] / sps if sps else float("nan")
        util = [b / train_seconds for b in r["busy_seconds"]]
        if r["schedule"] == "gpipe":
            run_theory = steady = n / (n + p - 1)
        else:
            run_theory, steady = m / (m + p - 1), 1.0
        rate[(p, n, r["schedule"])] = sps
        print("| %d | %d | %s | %.3f | %.3f | %.3f | %.3f | %.0f | %s |" % (
            p, n, r["schedule"], sum(util) / len(util), min(util), run_theory, steady, sps,
            r["state"]))
    print()
    print("| P | N | pipemare / gpipe samples/s | (N+P-1)/N | same, over the run (M/(M+P-1) fill) |")
    print("|---|---|---|---|---|")
    for (p, n, s), sps in sorted(rate.items()):
        if s != "pipemare" or not rate.get((p, n, "gpipe")):
            continue
        m = next(r["microbatches"] for r in runs if (r["p"], r["n"]) == (p, n))
        ideal = (n + p - 1) / n
        print("| %d | %d | %.2f | %.2f | %.2f |" % (
            p, n, sps / rate[(p, n, "gpipe")], ideal, ideal * m / (m + p - 1)))


if __name__ == "__main__":
    main()
