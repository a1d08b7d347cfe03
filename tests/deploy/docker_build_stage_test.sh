#!/usr/bin/env bash
# Runs the service images' build stage (scripts/docker/build.sh, what router/Dockerfile and
# kv_store/Dockerfile run on debian:12) on this Debian machine, from a copy of the sources: the
# router and the store build with tests and benchmarks off (unoptimized), start, and the runtime
# package list names what they load. (No container engine runs here; the stages around it are checked by
# check_manifests.py.)
set -euo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
if git -C "$root" rev-parse --is-inside-work-tree >/dev/null 2>&1; then
  git -C "$root" ls-files -z --cached --others --exclude-standard |
    (cd "$root" && xargs -0 cp --parents -t "$work" 2>/dev/null || true)
else  # a source tree without git (an unpacked archive): everything but build trees
  tar -C "$root" --exclude='./build*' --exclude='./.venv' -cf - . | tar -C "$work" -xf -
fi
cd "$work"
# Unoptimized (build type None: no -O): what this checks is the packages, the CMake options and
# what the binaries load, not code generation, and -O3 took 200 s of CI's 2 cores.
CMAKE_ARGS=-DCMAKE_BUILD_TYPE=None BUILD_DIR="$work/build" \
  scripts/docker/build.sh "$work/out" infinigen-router infinigen-kvstore
# Both start and take their flags (as the images' CMD give them).
"$work/out/bin/infinigen-router" --listen=0.0.0.0:50051 --metrics_port=9090 \
  --workers=dns:///infinigen-worker:50071 --check_flags
"$work/out/bin/infinigen-kvstore" --listen=0.0.0.0:50061 --metrics_port=9092 --check_flags
for p in libgrpc++1.51 libprotobuf32 libabsl20220623 libucx0; do
  grep -qx "$p" "$work/out/runtime-packages" ||
    { echo "FAIL: $p is not in runtime-packages: $(cat "$work/out/runtime-packages")" >&2; exit 1; }
done
echo "PASS: built $(ls "$work/out/bin"), runtime packages: $(tr '\n' ' ' <"$work/out/runtime-packages")"
