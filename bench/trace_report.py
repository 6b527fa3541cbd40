#!/usr/bin/env python3
"""Summarises the loss traces of `TRACE=PREFIX bench/spec_variants.sh ...`
around one step (a T3 warm-up's switch to the asynchronous schedule): per
variant, the mean sampled training loss over the WINDOW steps before STEP, the
highest in the WINDOW after it, the mean over the WINDOW after that, and the
last sampled loss. One Markdown row per PREFIX.*.tsv file.
  python3 bench/trace_report.py out/lmn1/trace 107 [WINDOW=30]"""
import glob
import sys


def main():
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    prefix, step = sys.argv[1], int(sys.argv[2])
    window = int(sys.argv[3]) if len(sys.argv) > 3 else 30
    print(f"| variant | mean loss, steps {step - window}..{step - 1} | highest, {step}..{step + window - 1} "
          f"| mean, {step + window}..{step + 2 * window - 1} | last |")
    print("|---|---|---|---|---|")
    for path in sorted(glob.glob(prefix + ".*.tsv")):
        samples = {}
        for line in open(path):
            fields = line.split()
            if len(fields) == 2 and int(fields[0]) > 0:
                samples[int(fields[0])] = float(fields[1])
        if not samples:
            continue

        def within(lo, hi):
            return [v for k, v in samples.items() if lo <= k < hi]

        def fmt(values, f):
            return "%.3f" % f(values) if values else "-"

        before = within(step - window, step)
        spike = within(step, step + window)
        after = within(step + window, step + 2 * window)
        last = samples[max(samples)]
        variant = path[len(prefix) + 1:-len(".tsv")]
        print(f"| {variant} | {fmt(before, lambda v: sum(v) / len(v))} | {fmt(spike, max)} "
              f"| {fmt(after, lambda v: sum(v) / len(v))} | {last:.3f} |")


if __name__ == "__main__":
    main()
