#!/usr/bin/env python3
"""Clang's -Wthread-safety over every source that holds a lock.

The sanitizer builds compile the LibTorch-free code with clang and
-Werror=thread-safety already; this covers the rest (the stage worker, the
stage runtime and machine, the coordinator's rooms), whose LibTorch headers
only the GCC build compiles. It reads the GCC build's compile_commands.json,
keeps each of our sources that locks something (absl::Mutex, ABSL_GUARDED_BY
or ABSL_EXCLUSIVE_LOCKS_REQUIRED in it or its header), and runs clang++
-fsyntax-only on it with the same include paths and definitions.

usage: scripts/thread-safety.py BUILD_DIR [JOBS]; exit status 1 on any finding.
"""
import json
import os
import re
import shlex
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FOLDERS = ("common", "pipeline", "coordinator", "stage_worker", "client")
LOCKS = re.compile(r"absl::Mutex|ABSL_GUARDED_BY|ABSL_EXCLUSIVE_LOCKS_REQUIRED")
# A guard written only as a comment, which nothing checks.
COMMENT_GUARD = re.compile(r"//.*\b(GUARDED_BY|REQUIRES)\b.*\bmu\w*")


def locks_something(path):
    for p in (path, os.path.splitext(path)[0] + ".h"):
        if os.path.exists(p) and LOCKS.search(open(p, encoding="utf-8").read()):
            return True
    return False


def clang_command(entry):
    args = shlex.split(entry["command"])
    out = ["clang++", "-fsyntax-only", "-Wthread-safety", "-Werror=thread-safety",
           "-Wno-unknown-warning-option"]
    skip = False
    for a in args[1:]:
        if skip:
            skip = False
            continue
        if a in ("-o", "-c", "-include"):
            skip = True  # -include: GCC's precompiled LibTorch header
            continue
        if a == "-Winvalid-pch" or a == entry["file"]:
            continue
        out.append(a)
    return out + [entry["file"]]


def check(entry):
    r = subprocess.run(clang_command(entry), cwd=entry["directory"], capture_output=True,
                       text=True)
    return entry["file"], r.returncode, r.stderr


def main():
    build = sys.argv[1]
    jobs = int(sys.argv[2]) if len(sys.argv) > 2 else os.cpu_count()
    entries = json.load(open(os.path.join(build, "compile_commands.json")))
    chosen = []
    for e in entries:
        rel = os.path.relpath(e["file"], ROOT)
        if rel.split(os.sep)[0] in FOLDERS and not rel.endswith("_test.cc") and \
                locks_something(e["file"]):
            chosen.append(e)
    failed = 0
    for folder in FOLDERS:
        for dirpath, _, files in os.walk(os.path.join(ROOT, folder)):
            for name in sorted(files):
                if not name.endswith((".h", ".cc")):
                    continue
                path = os.path.join(dirpath, name)
                for n, line in enumerate(open(path, encoding="utf-8"), 1):
                    if COMMENT_GUARD.search(line):
                        print(f"thread-safety: {os.path.relpath(path, ROOT)}:{n}: a guard in a "
                              f"comment only; write it as ABSL_GUARDED_BY or "
                              f"ABSL_EXCLUSIVE_LOCKS_REQUIRED on an absl::Mutex")
                        failed += 1
    with ThreadPoolExecutor(jobs) as pool:
        for path, rc, err in pool.map(check, chosen):
            print(f"thread-safety: {os.path.relpath(path, ROOT)}: {'ok' if rc == 0 else 'FAILED'}",
                  flush=True)
            if rc != 0:
                failed += 1
                sys.stdout.write(err)
    print(f"thread-safety: {len(chosen)} sources checked, {failed} with findings")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
