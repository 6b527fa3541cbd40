#!/bin/sh
# Prints the Debian packages that hold the shared libraries the given
# binaries load (ldd), one per line: the image's runtime stage installs
# exactly these, so it never drifts from what the build stage linked.
# Usage: docker/runtime-packages.sh BINARY...
set -eu
for lib in $(ldd "$@" | awk '/=> \//{print $3}' | sort -u); do
  real=$(readlink -f "$lib")
  found=""
  # dpkg records /lib or /usr/lib as the package shipped it (usrmerge).
  for p in "$lib" "$real" "${lib#/usr}" "${real#/usr}" "/usr$lib" "/usr$real"; do
    found=$(dpkg -S "$p" 2>/dev/null | head -n 1 | cut -d: -f1) && [ -n "$found" ] && break
  done
  if [ -z "$found" ]; then
    echo "runtime-packages.sh: no Debian package holds $lib" >&2
    exit 1
  fi
  echo "$found"
done | sort -u
