# Sourced by the benchmarks: starts one coordinator and $1 workers on
# loopback (1 thread each, metrics on free ports), waits until every worker
# is IDLE, and sets $addr and $work (a temporary directory with the logs,
# removed with every process on exit). Needs $bin.
work=$(mktemp -d)
trap 'kill $(jobs -p) 2>/dev/null || true; rm -rf "$work"' EXIT
"$bin/pipemare-coordinator" --listen 127.0.0.1:0 --address-file "$work/addr" \
  --metrics-listen 127.0.0.1:0 2>"$work/coordinator.log" &
for _ in $(seq 100); do [ -s "$work/addr" ] && break; sleep 0.1; done
addr=$(cat "$work/addr")
for i in $(seq "$1"); do
  "$bin/pipemare-worker" --coordinator "$addr" --listen 127.0.0.1:0 --threads 1 \
    --metrics-listen 127.0.0.1:0 2>"$work/worker-$i.log" &
done
for _ in $(seq 150); do
  [ "$("$bin/pipemarectl" --coordinator "$addr" workers --output json | grep -c '"IDLE"')" \
    -ge "$1" ] && break
  sleep 0.2
done
