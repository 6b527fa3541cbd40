#!/usr/bin/env bash
# Installs the checks' npm packages (package-lock.json: kubernetes-models,
# @kubernetes-models/prometheus-operator, js-yaml) into tests/deploy/node_modules
# with `npm ci`, unless they are already installed from this very lock file.
# The ctest fixture k8s.npm_ci runs it before the checks. Needs the npm
# registry (or npm's cache) the first time.
#   tests/deploy/npm-ci.sh [NPM]
set -euo pipefail
npm=${1:-npm}
here=$(cd "$(dirname "$0")" && pwd)
stamp=$here/node_modules/.pipemare-package-lock.json
# One install at a time (ctest -j, several build directories).
exec 9>"${TMPDIR:-/tmp}/pipemare-k8s-npm-ci.lock"
flock 9
if [ -f "$stamp" ] && cmp -s "$here/package-lock.json" "$stamp"; then
  exit 0
fi
cd "$here"
"$npm" ci --no-audit --no-fund --loglevel=error
cp package-lock.json "$stamp"
echo "npm ci: tests/deploy/node_modules installed" >&2
