#!/usr/bin/env bash
# Runtime plus transport cost per microbatch per stage hop: the virtual device
# with zero compute, activations and gradients of 1 MiB (microbatch 256 x
# width 1024, float32), gpipe with N = 1 so one microbatch at a time crosses
# the whole pipeline and back. Between P = 2 and P = 8 the path grows by
# 2 x 6 hops (each: encode, gRPC send and receive, decode, the stage's
# bookkeeping and its zero-filled output), so
#   per hop = (time per microbatch at P=8 - at P=2) / 12.
#
#   bench/overhead.sh [OUT_DIR]    (knobs: WIDTH=1024, MICROBATCH=256,
#                                   TRANSPORT=grpc|gloo,
#                                   DATA_PLANE_MIN_BYTES as in pipeline.sh)
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
out=${1:-$root/out/overhead}
rm -rf "$out"
PS="2 8" NS=1 SCHEDULES=gpipe FWD_MS=0 BWD_MS=0 WIDTH=${WIDTH:-1024} \
  MICROBATCH=${MICROBATCH:-256} MICROBATCHES_PER_STAGE=${MICROBATCHES_PER_STAGE:-40} \
  "$root/bench/pipeline.sh" "$out"
python3 - "$out" "${WIDTH:-1024}" <<'PY'
import json, sys
r = {p: json.load(open("%s/p%d-n1-gpipe.json" % (sys.argv[1], p))) for p in (2, 8)}
t = {p: 1e6 * r[p]["microbatch"] / r[p]["metrics"]["samples_per_second"] for p in r}
mib = r[8]["microbatch"] * int(sys.argv[2]) * 4 / 2**20
print("| P | µs per microbatch (forward and backward through all stages) |")
print("|---|---|")
for p in sorted(t):
    print("| %d | %.0f |" % (p, t[p]))
print()
print("activation and gradient size: %.2f MiB; per hop: %.0f µs" % (mib, (t[8] - t[2]) / 12))
PY
