#!/usr/bin/env bash
# The GPU acceptance run ("On the GPU"; docs/deploy.md, "Building for GPUs"), on a GPU host that
# has PyTorch with CUDA (python3 -c 'import torch') and no network. From the repository root:
#
#   scripts/gpu-check.sh BUNDLE OUT_DIR            # BUNDLE: the folder make-bundle.sh wrote
#                                                  #   (../shared/tools/gpu-host): debs/, mnist/
#   scripts/gpu-check.sh --dry-run BUNDLE OUT_DIR  # on a machine without a GPU: every step up to
#                                                  #   the build, then says what the GPU run does
#
# It unpacks Debian 12's build dependencies into OUT_DIR/prefix (never into /), builds the three
# binaries and the LibTorch tests against the host's PyTorch (its CUDA LibTorch), runs the tests,
# trains examples/mnist_pipemare.yaml on 4 workers sharing the GPU and on 4 CPU workers, trains the
# transformer LM example on the GPU, times the same models in plain PyTorch on the same GPU
# (bench/plain_pytorch.py), and measures per hop and utilization on the virtual device
# (bench/overhead.sh, bench/pipeline.sh). Every step runs even when one before it failed; each
# writes its log to OUT_DIR and a line to OUT_DIR/summary.md, the file to commit and quote.
# Knobs: CXX_STANDARD (17; 20 is tried when 17 does not build), JOBS (nproc), SKIP (steps to skip,
# e.g. "transport lm"), PYTHON (python3).
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
dry=0
if [ "${1:-}" = "--dry-run" ]; then dry=1; shift; fi
if [ $# -ne 2 ]; then
  echo "usage: scripts/gpu-check.sh [--dry-run] BUNDLE OUT_DIR" >&2
  exit 2
fi
bundle=$(cd "$1" && pwd) || exit 2
mkdir -p "$2" && out=$(cd "$2" && pwd) || exit 2
py=${PYTHON:-python3}
jobs=${JOBS:-$(nproc)}
summary=$out/summary.md
prefix=$out/prefix
build=$out/build
start=$(date +%s)

say() { echo "$*" | tee -a "$summary"; }
skip() { case " ${SKIP:-} " in *" $1 "*) return 0 ;; esac; return 1; }
# step NAME COMMAND...: runs it with its output in OUT/NAME.log and a summary line with the time.
step() {
  local name=$1; shift
  local t0=$(date +%s)
  if "$@" >"$out/$name.log" 2>&1; then
    say "- $name: ok ($(( $(date +%s) - t0 )) s)"
    return 0
  fi
  say "- $name: FAILED ($(( $(date +%s) - t0 )) s; last lines of $name.log below)"
  tail -n 15 "$out/$name.log" | sed 's/^/      /' | tee -a "$summary"
  return 1
}

: >"$summary"
say "# scripts/gpu-check.sh on $(hostname), $(date -u +%Y-%m-%dT%H:%MZ)"
say ""
say "- commit: $(git -C "$root" rev-parse --short HEAD 2>/dev/null || echo unknown)$(git -C "$root" diff --quiet 2>/dev/null || echo ' (with local changes)')"
say "- cpus: $(nproc); gpu: $(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null | head -1 || echo none)"
say "- pytorch: $($py -c 'import torch; print(torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())' 2>&1 | tail -1)"
torch_prefix=$($py -c 'import torch; print(torch.utils.cmake_prefix_path)' 2>/dev/null)
torch_lib=$($py -c 'import torch, os; print(os.path.join(os.path.dirname(torch.__file__), "lib"))' 2>/dev/null)
if [ -z "$torch_prefix" ]; then
  say "- no PyTorch for $py: nothing to build against"
  exit 1
fi
say ""
say "## Steps"

# 1. Debian's build dependencies in a prefix of their own.
unpack() {
  rm -rf "$prefix" && mkdir -p "$prefix"
  for deb in "$bundle"/debs/*.deb; do dpkg -x "$deb" "$prefix" || return 1; done
  # Absolute symlinks (libz.so -> /lib/...) point into the prefix instead.
  find "$prefix" -type l | while read -r link; do
    target=$(readlink "$link")
    case $target in /*) ln -sfn "$prefix$target" "$link" ;; esac
  done
  # The prefix's tools find the prefix's libraries.
  for tool in protoc grpc_cpp_plugin pkgconf; do
    [ -e "$prefix/usr/bin/$tool" ] || continue
    mv "$prefix/usr/bin/$tool" "$prefix/usr/bin/$tool.real"
    printf '#!/bin/sh\nLD_LIBRARY_PATH=%s exec %s "$@"\n' \
      "$prefix/usr/lib/x86_64-linux-gnu:$prefix/lib/x86_64-linux-gnu" \
      "$prefix/usr/bin/$tool.real" >"$prefix/usr/bin/$tool"
    chmod +x "$prefix/usr/bin/$tool"
  done
  # MNIST as the examples read it (data/mnist; the idx loader reads .gz).
  mkdir -p "$root/data/mnist"
  cp -n "$bundle"/mnist/*.gz "$root/data/mnist/" 2>/dev/null || true
  ls "$root/data/mnist"
}
step unpack unpack

export LD_LIBRARY_PATH="$prefix/usr/lib/x86_64-linux-gnu:$prefix/lib/x86_64-linux-gnu:$torch_lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export PKG_CONFIG_LIBDIR="$prefix/usr/lib/x86_64-linux-gnu/pkgconfig:$prefix/usr/share/pkgconfig"
export PKG_CONFIG_SYSROOT_DIR="$prefix"
export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0}

# 2. Configure and build against the host's LibTorch. Gloo: off (PyTorch's wheel bundles its own,
# not Debian's libgloo; workers refuse gloo jobs saying so).
configure_and_build() {
  local standard=$1
  cmake -S "$root" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release \
    -DCMAKE_CXX_STANDARD="$standard" \
    -DCMAKE_PREFIX_PATH="$torch_prefix;$prefix/usr;$prefix/usr/lib/x86_64-linux-gnu/cmake" \
    -DCMAKE_CXX_FLAGS="-I$prefix/usr/include -I$prefix/usr/include/x86_64-linux-gnu" \
    -DProtobuf_PROTOC_EXECUTABLE="$prefix/usr/bin/protoc" \
    -DPKG_CONFIG_EXECUTABLE="$prefix/usr/bin/pkgconf" \
    -DOPENSSL_ROOT_DIR="$prefix/usr" -DZLIB_ROOT="$prefix/usr" \
    -DCMAKE_GTEST_DISCOVER_TESTS_DISCOVERY_MODE=PRE_TEST \
    -DCMAKE_CUDA_ARCHITECTURES=90 -DUSE_SYSTEM_NVTX=ON -DPIPEMARE_GLOO=OFF \
    -DPROMTOOL=/bin/true -DKUBECTL=/bin/true -DNODE=/bin/true -DNPM=/bin/true \
    -DYAMLLINT=/bin/true -DDOCKER_COMPOSE=/bin/true &&
    if [ $dry -eq 1 ]; then
      cmake --build "$build" -j "$jobs" --target pipemarectl
    else
      cmake --build "$build" -j "$jobs" --target pipemare-coordinator pipemare-worker pipemarectl \
        pipeline_torch_test
    fi
}
build_ok=0
if [ $dry -eq 1 ]; then
  # No GPU here: configure for real, build only the client (no LibTorch), then stop.
  step configure_dry configure_and_build "${CXX_STANDARD:-17}" && build_ok=1
else
  if step build configure_and_build "${CXX_STANDARD:-17}"; then
    build_ok=1
  elif [ -z "${CXX_STANDARD:-}" ]; then
    rm -rf "$build"
    step build_cxx20 configure_and_build 20 && build_ok=1
  fi
fi
bin=$build/bin
if [ $dry -eq 1 ]; then
  say ""
  say "Dry run: on a GPU host it goes on with: cuda_device_check, unit_tests (pipeline_torch_test;"
  say "the *Cuda* tests run there), mnist_cuda and mnist_cpu (pipemarectl local"
  say "examples/mnist_pipemare.yaml --device cuda|cpu), lm_cuda, plain_pytorch_mlp and"
  say "plain_pytorch_lm (bench/plain_pytorch.py), transport (bench/overhead.sh at 1 MiB and 8 KiB,"
  say "bench/pipeline.sh P = 8, 16), then the table below."
  exit $(( build_ok == 1 ? 0 : 1 ))
fi
[ $build_ok -eq 1 ] || { say "- the build failed: nothing else can run"; exit 1; }

# 3. The worker refuses a device it cannot use, at once; the tests (CUDA variants included).
refuses_bad_device() {  # exit 2 at once, naming the flag
  "$bin/pipemare-worker" --coordinator 127.0.0.1:1 --insecure --device cuda:99 --metrics-listen ""
  [ $? -eq 2 ]
}
step device_refused bash -c "$(declare -f refuses_bad_device); bin='$bin' refuses_bad_device" &&
  grep -q -- "--device cuda:99" "$out/device_refused.log"
step unit_tests "$bin/pipeline_torch_test"

# 4. MNIST on 4 workers sharing the GPU, and on 4 CPU workers; the LM on the GPU.
local_json() {  # NAME SPEC DEVICE: the final JobStatus as JSON in OUT/NAME.json
  local name=$1 spec=$2 device=$3
  (cd "$root" && "$bin/pipemarectl" --output json local "$spec" --insecure --device "$device" \
    >"$out/$name.json")
}
skip mnist || step mnist_cuda local_json mnist_cuda examples/mnist_pipemare.yaml cuda
skip mnist || step mnist_cpu local_json mnist_cpu examples/mnist_pipemare.yaml cpu
lm_spec=$out/transformer_lm.yaml
sed "s#/usr/share/games/fortunes/cookie#$prefix/usr/share/games/fortunes/cookie#" \
  "$root/examples/transformer_lm_fortunes.yaml" >"$lm_spec"
skip lm || step lm_cuda local_json lm_cuda "$lm_spec" cuda

# 5. The same models in plain single-process PyTorch on the same GPU.
skip plain || step plain_pytorch_mlp sh -c "$py '$root/bench/plain_pytorch.py' mlp \
  --layers 784,512,512,256,10 --microbatch 64 --device cuda >'$out/plain_mlp.json'"
skip plain || step plain_pytorch_lm sh -c "$py '$root/bench/plain_pytorch.py' lm --depth 4 \
  --width 128 --heads 4 --context 64 --microbatch 8 --device cuda >'$out/plain_lm.json'"

# 6. Transport on this host's cores: per hop at 1 MiB and 8 KiB, utilization at P = 8 and 16.
if ! skip transport; then
  step hop_1mib env BIN_DIR="$bin" "$root/bench/overhead.sh" "$out/hop_1mib"
  step hop_8kib env BIN_DIR="$bin" WIDTH=256 MICROBATCH=8 "$root/bench/overhead.sh" "$out/hop_8kib"
  step utilization env BIN_DIR="$bin" PS="8 16" NS=8 SCHEDULES=pipemare \
    "$root/bench/pipeline.sh" "$out/utilization"
fi

# 7. The table.
say ""
say "## Results"
$py - "$out" >>"$summary" 2>&1 <<'PY'
import glob, json, os, re, sys
out = sys.argv[1]
def load(name):
    try:
        return json.load(open(os.path.join(out, name)))
    except Exception:
        return None
def acc(j):
    return j and j.get("metrics", {}).get("testAccuracy", j.get("metrics", {}).get("test_accuracy"))
def sps(j):
    return j and j.get("metrics", {}).get("samplesPerSecond", j.get("metrics", {}).get("samples_per_second"))
cuda, cpu, lm = load("mnist_cuda.json"), load("mnist_cpu.json"), load("lm_cuda.json")
pm, pl = load("plain_mlp.json"), load("plain_lm.json")
print("| run | state | test accuracy | samples/s | plain PyTorch samples/s | ratio |")
print("|---|---|---|---|---|---|")
for name, j, plain in (("MNIST, 4 workers on cuda", cuda, pm), ("MNIST, 4 workers on cpu", cpu, None),
                       ("transformer LM, 6 workers on cuda", lm, pl)):
    if j is None:
        print("| %s | no result | | | | |" % name)
        continue
    s, p = sps(j), plain and plain.get("samples_per_second")
    print("| %s | %s | %s | %s | %s | %s |" % (
        name, j.get("state"), "%.4f" % acc(j) if acc(j) is not None else "-",
        "%.0f" % s if s else "-", "%.0f" % p if p else "-", "%.2fx" % (s / p) if s and p else "-"))
if cuda and cpu and acc(cuda) is not None and acc(cpu) is not None:
    d = 100 * (acc(cuda) - acc(cpu))
    print("\nMNIST cuda - cpu: %+.2f points (goal: within 0.3)" % d)
for name in ("hop_1mib", "hop_8kib"):
    log = os.path.join(out, name + ".log")
    if os.path.exists(log):
        m = re.findall(r"per hop: (\d+) µs", open(log).read())
        print("\n%s: %s" % (name, ("%s µs per hop" % m[-1]) if m else "no figure (see the log)"))
log = os.path.join(out, "utilization.log")
if os.path.exists(log):
    print("\nutilization (bench/pipeline.sh):\n")
    print(open(log).read()[-1500:])
PY
say ""
say "Total: $(( $(date +%s) - start )) s"
