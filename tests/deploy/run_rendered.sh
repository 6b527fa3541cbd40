#!/usr/bin/env bash
# Runs the rendered CPU overlay (deploy/k8s/overlays/cpu) as local processes,
# as a cluster would run its pods, and trains a short job on it:
#   - each pod in a network namespace of its own (`ip netns`, veth pairs on a
#     bridge, 10.78.0.x/24), the Services' and pods' DNS names in its
#     /etc/hosts (/etc/netns/NS/hosts, which `ip netns exec` mounts there);
#   - each container started by tests/deploy/pods.mjs's launcher with the
#     manifest's command, args (with $(VAR) expanded) and env (downward API:
#     POD_NAME pipemare-worker-N, POD_NAMESPACE pipemare, POD_IP the
#     namespace's address), in a private mount namespace (`unshare --mount`)
#     with its volumes bound at the manifest's mountPaths: the Secrets from
#     `pipemarectl dev-ca` run as deploy/k8s/README.md says, the data claim a
#     directory holding MNIST (data/mnist), the state claim, emptyDirs; / made
#     read-only (readOnlyRootFilesystem) and the program run as uid/gid 10001
#     with fsGroup 10001, no new privileges, no capabilities;
#   - every probe asked as the kubelet would (`pipemarectl health ADDRESS
#     --service S` on the port the manifest names, within the startup
#     probe's budget), every metrics port scraped;
#   - from a client namespace (a pod in the cluster: the coordinator's
#     certificate names pipemare-coordinator, not an address), the workers
#     listed with their advertised DNS names and the example spec from the
#     ConfigMap, cut short, submitted with --wait: it must SUCCEED, with its
#     checkpoint on the shared data claim;
#   - SIGTERM to every pod at once: each must exit within its
#     terminationGracePeriodSeconds.
# Usage (root, iproute2, util-linux, curl; ctest k8s.run_rendered):
#   tests/deploy/run_rendered.sh BIN_DIR     (pipemare-coordinator, pipemare-worker, pipemarectl)
# Exits 77 (skipped) without root or the tools. PIPEMARE_K8S_KEEP=1 keeps the
# work directory; PIPEMARE_K8S_OVERLAY=DIR runs another kustomization (one
# with the same names: it is how a broken copy was checked to fail). Mount points missing on this host (/data, /etc/pipemare,
# /var/lib/pipemare) are made empty for the run and removed after it.
# shellcheck disable=SC2154  # the plan's arrays come from the generated plan.sh
set -euo pipefail
bin=$(cd "${1:?usage: run_rendered.sh BIN_DIR}" && pwd)
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
kubectl=${KUBECTL:-kubectl}
node=${NODE:-node}
subnet=10.78.0

if [ "$(id -u)" -ne 0 ]; then
  echo "SKIP: needs root (network and mount namespaces)"
  exit 77
fi
for tool in ip unshare setpriv flock curl "$kubectl" "$node"; do
  command -v "$tool" >/dev/null || { echo "SKIP: no $tool"; exit 77; }
done
for program in pipemare-coordinator pipemare-worker pipemarectl; do
  [ -x "$bin/$program" ] || { echo "FAIL: no $bin/$program" >&2; exit 1; }
done
[ -s "$root/data/mnist/train-images-idx3-ubyte" ] || "$root/scripts/fetch-mnist.sh" "$root/data/mnist"

# One run at a time on a host: the mount points are shared.
exec 8>/run/pipemare-k8s-run-rendered.lock
flock -w 900 8

work=$(mktemp -d /var/tmp/pipemare-k8s.XXXXXX)
chmod 755 "$work"
tag=pmk$$
bridge=${tag}br
client_ns=${tag}-client
client_ip=$subnet.200
namespaces=()
created=()
started=()
status=1

fail() {
  echo "FAIL: $*" >&2
  exit 1
}
say() { echo "[$(date +%T)] $*"; }

cleanup() {
  local id pid
  for id in "${started[@]}"; do
    pid=$(cat "$work/$id.pid" 2>/dev/null || true)
    if [ -n "$pid" ] && [ ! -e "$work/$id.exit" ]; then kill -KILL "$pid" 2>/dev/null || true; fi
  done
  for id in "${started[@]}"; do
    for _ in $(seq 50); do [ -e "$work/$id.exit" ] && break; sleep 0.1; done
  done
  if [ "$status" -ne 0 ]; then
    for log in "$work"/logs/*.log; do
      [ -e "$log" ] || continue
      echo "--- $(basename "$log") (last 30 lines)"
      tail -n 30 "$log"
    done
  fi
  for ns in "${namespaces[@]}"; do
    ip netns del "$ns" 2>/dev/null || true
    rm -rf "/etc/netns/$ns"
  done
  ip link del "$bridge" 2>/dev/null || true
  local i
  for ((i = ${#created[@]} - 1; i >= 0; i--)); do rmdir "${created[$i]}" 2>/dev/null || true; done
  if [ "${PIPEMARE_K8S_KEEP:-0}" = 1 ]; then
    echo "kept $work"
  else
    rm -rf "$work"
  fi
}
trap cleanup EXIT
trap 'exit 1' INT TERM

# 1. The manifests, the certificates, the pods' volumes and launchers.
overlay=${PIPEMARE_K8S_OVERLAY:-$root/deploy/k8s/overlays/cpu}
say "rendering $overlay"
"$kubectl" kustomize "$overlay" > "$work/rendered.yaml"
# deploy/k8s/README.md's dev-ca command (namespace pipemare).
"$bin/pipemarectl" dev-ca --out "$work/pki" --coordinator-host pipemare-coordinator \
  --coordinator-host pipemare-coordinator.pipemare.svc \
  --worker-host '*.pipemare-worker.pipemare.svc' > /dev/null
chmod 755 "$work/pki"
# The image's binaries, where the pods' user (uid 10001) can reach them: the
# build directory may sit under a directory only root may enter (a CI clone
# in mktemp -d's 0700 directory).
mkdir -m 755 "$work/image-bin"
cp "$bin/pipemare-coordinator" "$bin/pipemare-worker" "$bin/pipemarectl" "$work/image-bin/"
"$node" "$here/pods.mjs" --rendered "$work/rendered.yaml" --work "$work" --subnet "$subnet" \
  --bin-dir "$work/image-bin" --netns-prefix "$tag-" \
  --secret "pipemare-tls=$work/pki" --secret "pipemare-tokens=$work/pki" \
  --seed "pipemare-data/mnist=$root/data/mnist"
# Declares pods, pod_ip, pod_netns, pod_grace, pod_init, pod_main,
# mountpoints, probes, metrics, coordinator_address.
# shellcheck source=/dev/null
source "$work/plan.sh"
[ -n "$coordinator_address" ] || fail "no worker has --coordinator"
mkdir -p "$work/logs"

# 2. The network: a bridge (the host at .254), one namespace per pod, one
# for the client.
ip link add "$bridge" type bridge
ip addr add "$subnet.254/24" dev "$bridge"
ip link set "$bridge" up
add_host() {  # NAMESPACE ADDRESS INDEX
  local ns=$1 address=$2 i=$3
  ip netns add "$ns"
  namespaces+=("$ns")
  mkdir -p "/etc/netns/$ns"
  cp "$work/hosts" "/etc/netns/$ns/hosts"
  ip link add "${tag}h$i" type veth peer name "${tag}n$i"
  ip link set "${tag}n$i" netns "$ns"
  ip link set "${tag}h$i" master "$bridge"
  ip link set "${tag}h$i" up
  ip -n "$ns" addr add "$address/24" dev "${tag}n$i"
  ip -n "$ns" link set "${tag}n$i" up
  ip -n "$ns" link set lo up
}
i=0
for pod in "${pods[@]}"; do
  add_host "${pod_netns[$pod]}" "${pod_ip[$pod]}" "$i"
  i=$((i + 1))
done
add_host "$client_ns" "$client_ip" c

# 3. Mount points this host lacks, made for the run (and removed after it).
for mountpoint in "${mountpoints[@]}"; do
  [ -d "$mountpoint" ] && continue
  missing=$mountpoint
  while [ ! -e "$(dirname "$missing")" ]; do missing=$(dirname "$missing"); done
  mkdir -p "$mountpoint"
  # Remember every level made, outermost first.
  level=$mountpoint
  levels=()
  while :; do
    levels=("$level" "${levels[@]}")
    [ "$level" = "$missing" ] && break
    level=$(dirname "$level")
  done
  created+=("${levels[@]}")
done

# 4. The pods: init containers in order, to completion; then the containers.
start() {  # ID NAMESPACE LAUNCHER
  local id=$1 ns=$2 launcher=$3
  started+=("$id")
  (
    ip netns exec "$ns" unshare --mount --propagation private "$launcher" > "$work/logs/$id.log" 2>&1 &
    echo $! > "$work/$id.pid"
    set +e
    wait $!
    echo $? > "$work/$id.exit"
  ) 2>> "$work/logs/$id.log" &
  for _ in $(seq 50); do [ -s "$work/$id.pid" ] && break; sleep 0.05; done
}
declare -A started_at
for pod in "${pods[@]}"; do
  for launcher in ${pod_init[$pod]}; do
    id="$pod.$(basename "$launcher" .sh)"
    start "$id" "${pod_netns[$pod]}" "$launcher"
    for _ in $(seq 600); do [ -e "$work/$id.exit" ] && break; sleep 0.5; done
    [ "$(cat "$work/$id.exit" 2>/dev/null)" = 0 ] || fail "init container $id did not complete"
  done
  for launcher in ${pod_main[$pod]}; do
    id="$pod.$(basename "$launcher" .sh)"
    start "$id" "${pod_netns[$pod]}" "$launcher"
    started_at[$id]=$SECONDS
  done
  say "started $pod (${pod_ip[$pod]}, namespace ${pod_netns[$pod]})"
done

alive() {  # fails naming the first container that has exited
  local id
  for id in "${started[@]}"; do
    [ -e "$work/$id.exit" ] && fail "$id exited ($(cat "$work/$id.exit")) while the pods should run"
  done
  return 0
}
health() {  # ADDRESS SERVICE
  "$bin/pipemarectl" health "$1" --service "$2" --timeout 2 > /dev/null 2>&1
}

# 5. Probes, as the kubelet asks them: startup within its budget, then
# liveness, then readiness (a worker is ready once registered).
for kind in startupProbe livenessProbe readinessProbe; do
  for probe in "${probes[@]}"; do
    IFS='|' read -r pod container probe_kind address service budget <<< "$probe"
    [ "$probe_kind" = "$kind" ] || continue
    id="$pod.$container"
    [ "$kind" = readinessProbe ] && budget=120
    until health "$address" "$service"; do
      alive
      (( SECONDS - ${started_at[$id]} <= budget )) || fail "$id: $kind (grpc $address, service '$service') not SERVING within ${budget}s"
      sleep 1
    done
    say "$id: $kind grpc $address service '$service': SERVING after $((SECONDS - ${started_at[$id]}))s"
  done
done

# 6. Metrics on every port named metrics.
for m in "${metrics[@]}"; do
  IFS='|' read -r pod address <<< "$m"
  curl -sf --max-time 5 "http://$address/metrics" | grep -q '^pipemare_' || fail "$pod: no pipemare_ metrics at http://$address/metrics"
  say "$pod: metrics at http://$address/metrics"
done

# 7. A client inside the cluster: the workers and a short job.
ctl=(ip netns exec "$client_ns" "$bin/pipemarectl" --coordinator "$coordinator_address"
  --tls-ca "$work/pki/ca.pem" --token-file "$work/pki/submit.token")
listed=$(timeout 30 "${ctl[@]}" workers)
echo "$listed"
workers=0
for pod in "${pods[@]}"; do
  case $pod in
    pipemare-worker-*)
      workers=$((workers + 1))
      grep -q "$pod.pipemare-worker.pipemare.svc:7071" <<< "$listed" || fail "$pod is not listed at its DNS name"
      ;;
  esac
done
[ "$workers" -gt 0 ] || fail "no worker pods"
say "submitting $work/spec.yaml (the ConfigMap's example, cut short)"
submit=$(timeout 600 "${ctl[@]}" submit "$work/spec.yaml" --wait 2>&1) || {
  echo "$submit"
  fail "the job did not succeed"
}
echo "$submit" | tail -n 5
grep -q SUCCEEDED <<< "$submit" || fail "the job did not end SUCCEEDED"
manifests=$(find "$work/claims/pipemare-data/checkpoints" -name manifest.json 2>/dev/null | wc -l)
[ "$manifests" -gt 0 ] || fail "no committed checkpoint under the data claim's checkpoints/"
say "checkpoint committed on the shared data claim ($manifests manifest(s))"
[ -n "$(find "$work/claims/state-pipemare-coordinator-0" -mindepth 1 -print -quit)" ] || fail "nothing in the coordinator's state claim"
alive

# 8. Termination: SIGTERM to every pod at once, as a namespace deletion does;
# each must be gone within its terminationGracePeriodSeconds.
t0=$SECONDS
for pod in "${pods[@]}"; do
  for launcher in ${pod_main[$pod]}; do
    kill -TERM "$(cat "$work/$pod.$(basename "$launcher" .sh).pid")"
  done
done
for pod in "${pods[@]}"; do
  for launcher in ${pod_main[$pod]}; do
    id="$pod.$(basename "$launcher" .sh)"
    until [ -e "$work/$id.exit" ]; do
      (( SECONDS - t0 <= ${pod_grace[$pod]} )) || fail "$id still runs ${pod_grace[$pod]}s after SIGTERM (terminationGracePeriodSeconds)"
      sleep 0.2
    done
    say "$id: exited $(cat "$work/$id.exit") within $((SECONDS - t0))s of SIGTERM (grace ${pod_grace[$pod]}s)"
  done
done
status=0
say "PASS: the rendered CPU overlay ran, trained and stopped in time"
