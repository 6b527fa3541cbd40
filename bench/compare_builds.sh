#!/usr/bin/env bash
# Two builds of Pipemare side by side on this machine, alternating runs so
# that a noisy host hits both alike: per-hop overhead (bench/overhead.sh,
# 1 MiB and 8 KiB) and pipeline utilization (bench/pipeline.sh, pipemare at
# P = 8 and 32, N = 8, on the virtual device). Each tree runs its own
# scripts and binaries (its build/bin).
#
#   git worktree add /tmp/base <commit> && (cd /tmp/base && cmake -S . -B build -G Ninja \
#     -DCMAKE_BUILD_TYPE=RelWithDebInfo && cmake --build build --target pipemare-worker \
#     pipemare-coordinator pipemarectl) && ln -s "$PWD/data" /tmp/base/data
#   bench/compare_builds.sh /tmp/base . [ROUNDS]
#
# TRANSPORTS="grpc gloo" runs each build under each schedule.transport in
# turn (the build column then names it); with one tree given twice, one
# build's transports side by side:
#   TRANSPORTS="grpc gloo" bench/compare_builds.sh . . 2
# A transport written gloo/BYTES also sets schedule.data_plane_min_bytes
# (gloo/0: every tensor over Gloo).
set -euo pipefail
base=$(cd "$1" && pwd)
this=$(cd "$2" && pwd)
rounds=${3:-2}
out=$(mktemp -d)
trees=("$base")
[ "$this" = "$base" ] || trees+=("$this")
echo "| build | round | per hop 1 MiB µs | per hop 8 KiB µs | pipemare P=8 N=8 utilization | pipemare P=32 N=8 utilization |"
echo "|---|---|---|---|---|---|"
for round in $(seq 1 "$rounds"); do
  for tree in "${trees[@]}"; do
    for transport in ${TRANSPORTS:-grpc}; do
      export TRANSPORT=${transport%%/*}
      if [ "$transport" != "$TRANSPORT" ]; then
        export DATA_PLANE_MIN_BYTES=${transport#*/}
      else
        unset DATA_PLANE_MIN_BYTES
      fi
      name=$(cd "$tree" && git rev-parse --short HEAD)
      [ -n "$(cd "$tree" && git status --porcelain --untracked-files=no)" ] && name="$name+"
      [ -z "${TRANSPORTS:-}" ] || name="$name $transport"
      d="$out/$round-$(basename "$tree")-$(echo "$name" | tr ' /' '--')"
      hop1=$(cd "$tree" && bench/overhead.sh "$d/o1" 2>&1 | sed -n 's/.*per hop: \([0-9]*\) µs/\1/p')
      hop8=$(cd "$tree" && WIDTH=256 MICROBATCH=8 bench/overhead.sh "$d/o8" 2>&1 |
        sed -n 's/.*per hop: \([0-9]*\) µs/\1/p')
      util() {
        (cd "$tree" && PS=$1 NS=8 SCHEDULES=pipemare MICROBATCHES_PER_STAGE=32 \
          bench/pipeline.sh "$d/p$1" >/dev/null 2>&1 &&
          python3 bench/pipeline_report.py "$d/p$1" | awk -F'|' 'NR==3 {gsub(/ /,"",$5); print $5}')
      }
      echo "| $name | $round | $hop1 | $hop8 | $(util 8) | $(util 32) |"
    done
  done
done
rm -rf "$out"
