#!/usr/bin/env bash
# The build stage of every service image (router/Dockerfile, kv_store/Dockerfile,
# gpu_worker/Dockerfile), run from the repository root on Debian 12 or Ubuntu 24.04 (the CUDA
# images): installs the build's packages, builds the given CMake targets (Release, no tests or
# benchmarks), copies the binaries to OUT/bin and writes OUT/runtime-packages, the packages the
# runtime stage installs (scripts/docker/runtime_packages.sh).
# Usage: scripts/docker/build.sh OUT TARGET...   Extra CMake arguments: $CMAKE_ARGS.
set -euo pipefail
if [ "$#" -lt 2 ]; then
  echo "usage: $0 OUT TARGET..." >&2
  exit 2
fi
out="$1"
shift
cd "$(dirname "$0")/../.."

BUILD_PACKAGES=(
  build-essential cmake ninja-build pkg-config
  libabsl-dev libopenblas-openmp-dev nlohmann-json3-dev
  libgrpc++-dev libprotobuf-dev protobuf-compiler protobuf-compiler-grpc
  libucx-dev prometheus-cpp-dev libboost-dev
)
scripts/install_packages.sh "${BUILD_PACKAGES[@]}"

build="${BUILD_DIR:-/tmp/infinigen-image-build}"
# shellcheck disable=SC2086  # CMAKE_ARGS is a list of arguments
cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DINFINIGEN_BUILD_TESTS=OFF \
  -DINFINIGEN_BUILD_BENCHMARKS=OFF -DINFINIGEN_WITH_SERVICES=ON ${CMAKE_ARGS:-}
cmake --build "$build" --target "$@"
mkdir -p "$out/bin"
binaries=()
for t in "$@"; do
  cp "$build/bin/$t" "$out/bin/"
  binaries+=("$out/bin/$t")
done
# The CUDA backend plugin (built with the binaries when nvcc is found; they load it from ../lib
# for --device cuda). OUT/lib exists either way, for the runtime stage's COPY.
mkdir -p "$out/lib"
if [ -f "$build/bin/libinfinigen_cuda.so" ]; then
  cp "$build/bin/libinfinigen_cuda.so" "$out/lib/"
  binaries+=("$out/lib/libinfinigen_cuda.so")
fi
scripts/docker/runtime_packages.sh "${binaries[@]}" >"$out/runtime-packages"
echo "built ${binaries[*]}; runtime packages: $(tr '\n' ' ' <"$out/runtime-packages")"
