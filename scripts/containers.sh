#!/usr/bin/env bash
# Pipemare's containers, built and run for real on a machine without a Docker
# engine or a registry: podman (root, runc) builds the images and serves the
# Docker API that docker-compose drives.
#   scripts/containers.sh base     Debian 12 base image from debootstrap, imported
#                                  as localhost/pipemare-base:bookworm (kept if present)
#   scripts/containers.sh images   base, then the Pipemare and Prometheus images
#                                  (docker/), and their sizes
#   scripts/containers.sh test     images, then deploy/docker-compose.yml up (all but
#                                  Grafana), examples/mnist_pipemare.yaml submitted from
#                                  this host trains to SUCCEEDED, Prometheus reports
#                                  every target up, a killed worker is seen LOST; down
# Needs root, podman, runc, debootstrap, docker-compose (scripts/dev.sh deps).
# PIPEMARECTL (default build/bin/pipemarectl) is the client used from the host.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
export CONTAINERS_CONF="$root/deploy/podman/containers.conf"
base_image=localhost/pipemare-base:bookworm
ctl=${PIPEMARECTL:-$root/build/bin/pipemarectl}
project=pipemare-ci

say() { echo "containers.sh: $*" >&2; }
fail() { say "FAIL: $*"; exit 1; }

base() {
  if podman image exists "$base_image"; then
    say "$base_image present (podman rmi it to rebuild)"
    return
  fi
  local dir
  dir=$(mktemp -d)
  say "debootstrap --variant=minbase bookworm (Debian's archive)"
  debootstrap --variant=minbase bookworm "$dir/rootfs" http://deb.debian.org/debian >"$dir/log" 2>&1 ||
    { tail -20 "$dir/log" >&2; fail "debootstrap failed"; }
  # The security and updates suites, as in Debian's own images.
  cat >"$dir/rootfs/etc/apt/sources.list" <<'LIST'
deb http://deb.debian.org/debian bookworm main
deb http://deb.debian.org/debian bookworm-updates main
deb http://deb.debian.org/debian-security bookworm-security main
LIST
  rm -rf "$dir/rootfs/var/cache/apt/archives/"*.deb "$dir/rootfs/var/lib/apt/lists/"*
  tar -C "$dir/rootfs" -c . | podman import --change 'CMD ["/bin/bash"]' - "$base_image" >/dev/null
  rm -rf "$dir"
  say "imported $base_image"
}

size_of() { podman image inspect --format '{{.Size}}' "$1"; }

images() {
  base
  local args=(--pull=never --network host --format docker --build-arg "BASE=$base_image"
    --build-arg "JOBS=$(nproc)")
  say "building pipemare-build (docker/Dockerfile, stage build)"
  podman build "${args[@]}" --target build -f "$root/docker/Dockerfile" -t pipemare-build:latest "$root"
  say "building pipemare (docker/Dockerfile)"
  podman build "${args[@]}" -f "$root/docker/Dockerfile" -t pipemare:latest "$root"
  say "building pipemare-prometheus (docker/prometheus.Dockerfile)"
  podman build "${args[@]}" -f "$root/docker/prometheus.Dockerfile" -t pipemare-prometheus:latest "$root"
  local build_size runtime_size
  build_size=$(size_of localhost/pipemare-build:latest)
  runtime_size=$(size_of localhost/pipemare:latest)
  awk -v r="$runtime_size" -v b="$build_size" -v p="$(size_of localhost/pipemare-prometheus:latest)" 'BEGIN {
    printf "image sizes: pipemare %d MB (runtime), pipemare-build %d MB (build stage), runtime/build %.2f; pipemare-prometheus %d MB\n", r / 1e6, b / 1e6, r / b, p / 1e6 }'
  # The image runs as the unprivileged user it declares, with the three binaries.
  [ "$(podman image inspect --format '{{.Config.User}}' localhost/pipemare:latest)" = "10001:10001" ] ||
    fail "the pipemare image does not run as 10001:10001"
  podman run --rm localhost/pipemare:latest sh -c \
    'id -u && pipemare-coordinator --help >/dev/null && pipemare-worker --help >/dev/null && pipemarectl --help >/dev/null' |
    grep -qx 10001 || fail "the image's binaries do not start as uid 10001"
}

# Runs docker-compose against podman's Docker API socket.
compose() { docker-compose -p "$project" -f "$root/deploy/docker-compose.yml" "$@"; }

test_compose() {
  images
  tmp=$(mktemp -d)  # global: the EXIT trap reads it
  podman system service --time=0 "unix://$tmp/podman.sock" >"$tmp/service.log" 2>&1 &
  service_pid=$!
  export DOCKER_HOST="unix://$tmp/podman.sock"
  cleanup() {
    compose down -v --remove-orphans >/dev/null 2>&1 || true
    kill "$service_pid" 2>/dev/null || true
    wait "$service_pid" 2>/dev/null || true
    rm -rf "$tmp"
  }
  trap cleanup EXIT
  for _ in $(seq 50); do [ -S "$tmp/podman.sock" ] && break; sleep 0.2; done

  # Certificates and tokens (compose secrets): workers are reached by their
  # service names, the coordinator by its name from the workers and by
  # localhost from this host. The containers run as uid 10001.
  "$ctl" dev-ca --out "$tmp/pki" --coordinator-host coordinator --coordinator-host localhost \
    --coordinator-host 127.0.0.1 --worker-host worker-0,worker-1,worker-2,worker-3 >/dev/null
  chown 10001:10001 "$tmp/pki/"*.key "$tmp/pki/tokens"
  export PIPEMARE_PKI_DIR="$tmp/pki" PIPEMARE_DATA_DIR="$root/data"
  export PIPEMARE_IMAGE=localhost/pipemare:latest PIPEMARE_PROMETHEUS_IMAGE=localhost/pipemare-prometheus:latest
  [ -f "$root/data/mnist/train-images-idx3-ubyte" ] || [ -f "$root/data/mnist/train-images-idx3-ubyte.gz" ] ||
    "$root/scripts/fetch-mnist.sh" "$root/data/mnist"

  local services=(coordinator worker-0 worker-1 worker-2 worker-3 prometheus)
  say "docker-compose up ${services[*]} (Grafana is not run here: no image)"
  compose up -d --no-build "${services[@]}"
  local client=("$ctl" --coordinator localhost:7070 --tls-ca "$tmp/pki/ca.pem" --token-file "$tmp/pki/submit.token")

  say "waiting for four workers to register"
  local idle=0
  for _ in $(seq 120); do
    idle=$("${client[@]}" -o json workers 2>/dev/null | python3 -c '
import json, sys
print(sum(w["state"] == "IDLE" for w in json.load(sys.stdin).get("workers", [])))' 2>/dev/null || echo 0)
    [ "$idle" -ge 4 ] && break
    sleep 1
  done
  [ "$idle" -ge 4 ] || { compose logs --no-color | tail -50 >&2; fail "$idle of 4 workers registered"; }
  "${client[@]}" workers

  say "docker healthchecks"
  for s in "${services[@]:0:5}"; do
    local id status=""
    id=$(compose ps -q "$s")
    for _ in $(seq 60); do
      status=$(podman inspect --format '{{.State.Health.Status}}' "$id" 2>/dev/null || true)
      [ "$status" = healthy ] && break
      podman healthcheck run "$id" >/dev/null 2>&1 || true
      sleep 1
    done
    [ "$status" = healthy ] || fail "$s is $status, not healthy"
  done

  say "pipemarectl submit examples/mnist_pipemare.yaml --wait (from this host, into the containers)"
  (cd "$root" && "${client[@]}" submit examples/mnist_pipemare.yaml --wait) ||
    { compose logs --no-color | tail -80 >&2; fail "the example did not reach SUCCEEDED"; }

  say "Prometheus inside the stack: every target up"
  local targets up
  for _ in $(seq 30); do
    targets=$(curl -fsS http://127.0.0.1:9090/api/v1/targets || true)
    up=$(echo "$targets" | python3 -c '
import json, sys
active = json.load(sys.stdin)["data"]["activeTargets"]
print(sum(t["health"] == "up" for t in active), len(active))' 2>/dev/null || echo "0 0")
    [ "$up" = "5 5" ] && break
    sleep 2
  done
  [ "$up" = "5 5" ] || fail "Prometheus targets up/all: $up; $targets"
  say "Prometheus: 5 of 5 targets up"

  say "kill worker-3: the coordinator must see it LOST"
  compose kill worker-3 >/dev/null
  local lost=""
  for _ in $(seq 30); do
    lost=$("${client[@]}" workers 2>/dev/null | grep 'worker-3' || true)
    echo "$lost" | grep -q LOST && break
    sleep 1
  done
  echo "$lost" | grep -q LOST || fail "the coordinator does not report worker-3 LOST: $lost"
  say "coordinator: $lost"
  say "PASS"
}

case "${1:-}" in
  base) base ;;
  images) images ;;
  test) test_compose ;;
  *)
    echo "usage: scripts/containers.sh base|images|test" >&2
    exit 2
    ;;
esac
