# Sourced by the benchmarks: starts one coordinator and $1 workers on
# loopback (1 thread each, metrics on free ports), waits until every worker
# is IDLE, and sets $addr and $work (a temporary directory with the logs,
# removed with every process on exit) and $worker_pids. Needs $bin.
# WORKER_FLAGS: more pipemare-worker flags (e.g. --virtual-device 4,8).
# WORKER_CPUS: CPU ids to pin workers to, round robin (e.g. "0 1").
# Also defines ctl (pipemarectl on this cluster), run_job, mlp_layers,
# stage_metrics and stage_compute_metrics.
# Plaintext, as every benchmark row before TLS was measured (the binaries
# read PIPEMARE_INSECURE; older builds that compare_builds.sh runs ignore it).
export PIPEMARE_INSECURE=1
work=$(mktemp -d)
trap 'kill $(jobs -p) 2>/dev/null || true; rm -rf "$work"' EXIT
"$bin/pipemare-coordinator" --listen 127.0.0.1:0 --address-file "$work/addr" \
  --metrics-listen 127.0.0.1:0 --metrics-address-file "$work/metrics_addr" 2>"$work/coordinator.log" &
for _ in $(seq 100); do [ -s "$work/addr" ] && break; sleep 0.1; done
addr=$(cat "$work/addr")
read -r -a worker_cpus <<<"${WORKER_CPUS:-}"
read -r -a worker_flags <<<"${WORKER_FLAGS:-}"
worker_pids=()
for i in $(seq "$1"); do
  pin=()
  if [ ${#worker_cpus[@]} -gt 0 ]; then
    pin=(taskset -c "${worker_cpus[$(((i - 1) % ${#worker_cpus[@]}))]}")
  fi
  "${pin[@]}" "$bin/pipemare-worker" --coordinator "$addr" --listen 127.0.0.1:0 --threads 1 \
    --metrics-listen 127.0.0.1:0 "${worker_flags[@]}" 2>"$work/worker-$i.log" &
  worker_pids+=($!)
done
idle=0
for _ in $(seq 600); do
  idle=$("$bin/pipemarectl" --coordinator "$addr" workers --output json | grep -c '"IDLE"' || true)
  [ "$idle" -ge "$1" ] && break
  sleep 0.2
done
if [ "$idle" -lt "$1" ]; then
  echo "cluster.sh: only $idle of $1 workers became IDLE in 120 s; logs in $work" >&2
  exit 1
fi

ctl() { "$bin/pipemarectl" --coordinator "$addr" "$@"; }

# run_job SPEC STATUS_JSON: submits SPEC, waits until the job ends, leaves
# its final status in STATUS_JSON and prints the job id.
run_job() {
  local id
  id=$(ctl submit "$1" --output json | python3 -c 'import json,sys; print(json.load(sys.stdin)["id"])') || true
  if [ -z "$id" ]; then
    echo "run_job: the coordinator did not accept $1 (its reason is above)" >&2
    return 1
  fi
  # One watcher that sleeps until the job ends (pipemarectl watch), then its
  # final status. A loop that ran pipemarectl and python3 every half second
  # took a quarter of a 2-core host's CPU from the pipeline it measured
  # (perf, bench/overhead.sh at 8 KiB: python3 is a pyenv shell shim here).
  while true; do
    ctl watch "$id" >/dev/null 2>&1 || sleep 0.5
    ctl status "$id" --output json >"$2" || return 1
    case $(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["state"])' "$2") in
      SUCCEEDED | FAILED | CANCELLED) break ;;
    esac
  done
  echo "$id"
}

# mlp_layers P WIDTH: "[784, WIDTH x (P-1), 10]", an MNIST MLP of P units.
mlp_layers() {
  local s="784"
  for _ in $(seq $(($1 - 1))); do s="$s, $2"; done
  echo "[$s, 10]"
}

# stage_metrics JOB_ID NAMES FILE: every worker's samples of the metrics whose
# names match the regular expression NAMES, for the job, into FILE.
stage_metrics() {
  : >"$3"
  for target in $(ctl workers --output json | python3 -c '
import json, sys
for w in json.load(sys.stdin).get("workers", []):
    if w.get("metrics_address"): print(w["metrics_address"])'); do
    curl -s "http://$target/metrics" | grep -E "^($2)\{.*job_id=\"$1\"" >>"$3" || true
  done
}

# stage_compute_metrics JOB_ID FILE: the forward, backward and weight
# gradient (zero_bubble's W) seconds histograms' _sum and _count lines.
stage_compute_metrics() {
  stage_metrics "$1" "pipemare_stage_(forward|backward|weight_gradient)_seconds_(sum|count)" "$2"
}

# reset_peak_rss: starts every worker's peak resident set (VmHWM) afresh
# (Linux: 5 to /proc/PID/clear_refs), so the next job's peak is its own.
reset_peak_rss() {
  for pid in "${worker_pids[@]}"; do echo 5 >"/proc/$pid/clear_refs" 2>/dev/null || true; done
}

# rss_kib FIELD: each worker's VmHWM (peak) or VmRSS (now) in KiB,
# space-separated, in worker order.
rss_kib() {
  local out=""
  for pid in "${worker_pids[@]}"; do
    out="$out $(awk "/^$1/ {print \$2}" "/proc/$pid/status" 2>/dev/null || echo 0)"
  done
  echo "$out"
}
