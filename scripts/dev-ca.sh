#!/usr/bin/env bash
# A development cluster CA, the coordinator's and each worker's certificate,
# and two client tokens (admin: submit, viewer: read), for trying Pipemare's
# mutual TLS and tokens on a cluster (docs/security.md). Not a production CA:
# its key sits beside the certificates. Runs `pipemarectl dev-ca`:
#   scripts/dev-ca.sh --out pki --coordinator-host coord.example --worker-host 10.0.0.11 \
#     --worker-host 10.0.0.12,gpu-2.example [--days 30]
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
ctl=${PIPEMARECTL:-$root/build/bin/pipemarectl}
if [ ! -x "$ctl" ]; then
  ctl=$(command -v pipemarectl || true)
fi
if [ -z "$ctl" ]; then
  echo "dev-ca.sh: pipemarectl not found: build first (scripts/dev.sh build) or set PIPEMARECTL" >&2
  exit 2
fi
exec "$ctl" dev-ca "$@"
