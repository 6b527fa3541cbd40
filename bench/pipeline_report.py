#!/usr/bin/env python3
"""Markdown tables of bench/pipeline.sh's output, with the theory alongside.

    python3 bench/pipeline_report.py out/pipeline

Per run: mean and lowest stage utilization (forward + backward + W seconds
over training seconds), the plan's prediction (`pipemarectl simulate` on the
same plan and costs), samples/s, and memory: the microbatches each stage held
at its peak (peak saved activations over one microbatch's saved input, where
each stage is one unit) against the formula (pipeline/core/schedule.h:
HeldByFormula), the largest peak stash, and the largest worker's peak
resident set during the job above its resident set at the job's start. Then, per (P, N), each schedule's samples/s over the best
synchronous schedule's (gpipe, 1f1b, zero_bubble) and over gpipe's.
"""
import glob
import json
import os
import sys

ORDER = ["gpipe", "1f1b", "zero_bubble", "pipedream", "pipedream_2bw", "async", "pipemare"]
SYNCHRONOUS = ["gpipe", "1f1b", "zero_bubble"]


def held(r):
    per = r.get("saved_bytes_per_microbatch")
    peaks = r.get("peak_saved_activations") or []
    if not per or len(peaks) != len(per):
        return None
    return [round(b / m) for b, m in zip(peaks, per)]


def fmt_list(xs):
    if len(xs) > 8:
        return "%s … %s" % (",".join(str(x) for x in xs[:3]), ",".join(str(x) for x in xs[-2:]))
    return ",".join(str(x) for x in xs)


def main():
    out = sys.argv[1] if len(sys.argv) > 1 else "out/pipeline"
    runs = [json.load(open(f)) for f in sorted(glob.glob(os.path.join(out, "*.json")))]
    runs.sort(key=lambda r: (r["p"], r["n"], r.get("recompute", "default"),
                             ORDER.index(r["schedule"]) if r["schedule"] in ORDER else 99))
    print("| P | N | schedule | recompute | mean utilization | lowest stage | predicted | samples/s "
          "| held per stage (measured) | held (formula) | peak stash, largest | peak RSS growth, "
          "largest worker | state |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    rate = {}
    for r in runs:
        p, n, m = r["p"], r["n"], r["microbatches"]
        sps = r["metrics"].get("samples_per_second", 0.0)
        train_seconds = m * r["microbatch"] / sps if sps else float("nan")
        util = [b / train_seconds for b in r["busy_seconds"]]
        measured = held(r)
        rc = r.get("recompute", "default")
        rate[(p, n, rc, r["schedule"])] = sps
        print("| %d | %d | %s | %s | %.3f | %.3f | %.3f | %.0f | %s | %s | %.0f KiB | %.0f MiB | %s |" % (
            p, n, r["schedule"], rc, sum(util) / len(util), min(util),
            r.get("predicted_utilization", float("nan")), sps,
            fmt_list(measured) if measured else "n/a", fmt_list(r.get("held_by_formula", [])),
            max(r.get("peak_stash") or [0]) / 1024, max(r.get("peak_rss_kib") or [0]) / 1024,
            r["state"]))
    print()
    print("| P | N | recompute | schedule | samples/s over the best synchronous (which) "
          "| over gpipe |")
    print("|---|---|---|---|---|---|")
    for (p, n, rc, s), sps in sorted(rate.items(), key=lambda kv: (
            kv[0][0], kv[0][1], kv[0][2], ORDER.index(kv[0][3]) if kv[0][3] in ORDER else 99)):
        sync = {x: rate.get((p, n, rc, x)) for x in SYNCHRONOUS if rate.get((p, n, rc, x))}
        if not sync:
            continue
        best = max(sync, key=sync.get)
        gpipe = rate.get((p, n, rc, "gpipe"))
        print("| %d | %d | %s | %s | %.2f (%s) | %s |" % (
            p, n, rc, s, sps / sync[best], best, "%.2f" % (sps / gpipe) if gpipe else "n/a"))


if __name__ == "__main__":
    main()
