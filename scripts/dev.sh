#!/usr/bin/env bash
# Pipemare's one entry point for a fresh Debian 12 machine.
#   scripts/dev.sh example   install and build only what it runs (the three binaries), train
#                            examples/mnist_pipemare.yaml across local worker processes
#                            (pipemarectl local)
#   scripts/dev.sh test      install, build, run every test (ctest), clang's thread-safety
#                            analysis, then the sanitizer builds' tests and fuzz targets
#                            (sanitize, tsan)
#   scripts/dev.sh sanitize  clang ASan+UBSan build of the LibTorch-free code (BUILD_DIR-sanitize):
#                            its unit tests and each libFuzzer target for FUZZ_SECONDS (60)
#   scripts/dev.sh tsan      clang ThreadSanitizer build of the LibTorch-free code
#                            (BUILD_DIR-tsan) and its unit tests
#   scripts/dev.sh deps|build
# BUILD_DIR (default build) and JOBS (default nproc) may be set.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
build=${BUILD_DIR:-"$root/build"}
jobs=${JOBS:-$(nproc)}

# Debian packages the build and the run need. libopenblas0-openmp replaces
# the reference BLAS Debian's LibTorch would otherwise use (6x faster here).
# zlib1g-dev reads gzipped idx datasets; dataset-fashion-mnist is Fashion-MNIST
# (/usr/share/datasets/fashion-mnist) for examples/fashion_mnist_pipemare.yaml
# and the end-to-end tests; fortunes is a plain-text corpus for data.type text
# (/usr/share/games/fortunes/cookie, 245 kB of ASCII) for the examples and
# pipeline/core/data_test.cc. python3-torch and python3-numpy load exported models
# in plain PyTorch (examples/export_eval.py, tests/checkpoint_test.cc).
# libsqlite3-dev holds the coordinator's state (--state-dir/state.db);
# sqlite3 is its shell, for reading that file by hand. podman (with runc,
# catatonit, the CNI plugins and dnsname), debootstrap and docker-compose
# build and run the images for real (scripts/containers.sh, ctest label
# containers); yamllint checks deploy/.
# What the three binaries need to build and run (the main job installs only these):
run_packages=(cmake ninja-build g++ ccache pkg-config curl ca-certificates
  libgrpc++-dev protobuf-compiler-grpc libprotobuf-dev protobuf-compiler libabsl-dev
  libtorch-dev libopenblas0-openmp prometheus-cpp-dev
  libyaml-cpp-dev libcli11-dev libspdlog-dev nlohmann-json3-dev libcurl4-openssl-dev
  libcpp-httplib-dev zlib1g-dev libsqlite3-dev libgloo-dev)
# and what the tests, benchmarks and the sanitizer build add:
test_packages=(libgtest-dev libgmock-dev sqlite3
  prometheus dataset-fashion-mnist fortunes python3-torch python3-numpy
  clang libclang-rt-14-dev npm
  podman runc catatonit debootstrap docker-compose containernetworking-plugins
  golang-github-containernetworking-plugin-dnsname iptables curl xz-utils yamllint)

# deps [run]: installs what is missing of run_packages (and test_packages unless "run").
deps() {
  local packages=("${run_packages[@]}")
  [ "${1:-}" = run ] || packages+=("${test_packages[@]}")
  local missing=()
  for p in "${packages[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
  done
  # The deploy checks' npm may come with a Node.js that is not Debian's.
  if [ "${1:-}" != run ] && command -v npm >/dev/null 2>&1; then
    local keep=()
    for p in "${missing[@]}"; do [ "$p" = npm ] || keep+=("$p"); done
    missing=("${keep[@]}")
  fi
  if [ ${#missing[@]} -gt 0 ]; then
    local sudo=""
    [ "$(id -u)" -ne 0 ] && sudo="sudo"
    echo "installing: ${missing[*]}" >&2
    $sudo apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
  fi
  "$root/scripts/fetch-mnist.sh" "$root/data/mnist"
}

build() {
  cmake -S "$root" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
    -DPIPEMARE_BUILD_TESTS=ON >/dev/null
  cmake --build "$build" -j "$jobs"
}

# Only the three binaries the main job runs (no tests, benchmarks or their
# packages), compiled for a short wait: -O1 and no debug information take a
# third off the build (docs/benchmarks.md), and the training's arithmetic is
# LibTorch's and BLAS's, compiled by Debian. `build` (and `test`) compile
# RelWithDebInfo (-O2 -g) in the same folder.
build_binaries() {
  cmake -S "$root" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Quick -DCMAKE_CXX_FLAGS_QUICK="-O1 -DNDEBUG" \
    -DPIPEMARE_BUILD_TESTS=OFF >/dev/null
  cmake --build "$build" -j "$jobs" --target pipemarectl pipemare-coordinator pipemare-worker
}

sanitize() {
  local dir="$build-sanitize"
  CC=clang CXX=clang++ cmake -S "$root" -B "$dir" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
    -DPIPEMARE_SANITIZE_FUZZ=ON -DPIPEMARE_FUZZ_SECONDS="${FUZZ_SECONDS:-60}" >/dev/null
  cmake --build "$dir" -j "$jobs"
  (cd "$dir" && ASAN_OPTIONS=detect_leaks=1 UBSAN_OPTIONS=print_stacktrace=1 \
    ctest --output-on-failure --timeout 900)
}

# clang's -Wthread-safety over the GCC build's sources that lock something
# (the clang builds below check the LibTorch-free rest as they compile).
thread_safety() {
  python3 "$root/scripts/thread-safety.py" "$build" "$jobs"
}

# abseil's sources of the installed libabsl-dev, from Debian's archive and
# checked against the SHA-256 in the archive's source index: the TSan build compiles their
# mutex.cc with TSan (CMakeLists.txt says why). Prints the folder.
absl_source() {
  local version dir tarball sum
  version=$(dpkg-query -W -f='${source:Upstream-Version}' libabsl-dev)
  dir="$build-absl-$version"
  if [ ! -f "$dir/absl/synchronization/mutex.cc" ]; then
    tarball="abseil_$version.orig.tar.gz"
    curl -fsSL "http://deb.debian.org/debian/pool/main/a/abseil/$tarball" -o "$dir.tar.gz"
    sum=$(curl -fsSL http://deb.debian.org/debian/dists/bookworm/main/source/Sources.xz | xz -d |
      awk -v f="$tarball" '$3 == f && length($1) == 64 {print $1; exit}')
    echo "$sum  $dir.tar.gz" | sha256sum -c --quiet - >&2
    mkdir -p "$dir"
    tar -xzf "$dir.tar.gz" -C "$dir" --strip-components=1
    rm "$dir.tar.gz"
  fi
  echo "$dir"
}

tsan() {
  local dir="$build-tsan" absl
  absl=$(absl_source)
  CC=clang CXX=clang++ cmake -S "$root" -B "$dir" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
    -DPIPEMARE_TSAN=ON -DPIPEMARE_ABSL_SOURCE="$absl" >/dev/null
  cmake --build "$dir" -j "$jobs"
  (cd "$dir" && TSAN_OPTIONS="halt_on_error=1 second_deadlock_stack=1" \
    ctest --output-on-failure --timeout 900)
}

case "${1:-}" in
  deps) deps ;;
  build) deps; build ;;
  example)
    deps run; build_binaries
    cd "$root"
    exec "$build/bin/pipemarectl" local examples/mnist_pipemare.yaml "${@:2}"
    ;;
  test)
    deps; build
    (cd "$build" && ctest --output-on-failure --timeout 900 "${@:2}")
    thread_safety
    sanitize
    tsan
    ;;
  sanitize) deps; sanitize ;;
  tsan) deps; tsan ;;
  *)
    echo "usage: scripts/dev.sh example|test|sanitize|tsan|deps|build" >&2
    exit 2
    ;;
esac
