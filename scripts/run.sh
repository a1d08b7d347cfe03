#!/usr/bin/env bash
# The main job: installs what is missing, builds, starts the all-in-one server (`infinigen serve`:
# router, worker and KV store in one process) with the real SmolLM2-135M-Instruct model on the
# CPU, and generates through the public API with the CLI client, streaming the text to the
# terminal, with InfiniGen on (its sidecar is prepared once), q4_1 weights and bf16 K/V; the last
# line says which policy and storage ran and the K/V bytes the decode steps fetched. Extra
# arguments go to `infinigen client` (e.g. --temperature 0.8 --seed 7); INFINIGEN_SERVE_FLAGS to
# the server (e.g. "--cpu-weights f32 --cpu-kv f32" for exact storage, "--policy full");
# INFINIGEN_PORT picks the port.
set -euo pipefail
cd "$(dirname "$0")/.."
MODEL="$(scripts/setup.sh)"
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build build --target infinigen >/dev/null
# InfiniGen's sidecar (skew and partial channels, ~10 s of calibration on Pride and Prejudice),
# prepared once and cached beside the model: with it `--policy auto` serves InfiniGen.
if [ ! -s "$MODEL.infinigen.safetensors" ]; then
  echo "run: preparing the InfiniGen sidecar once ($MODEL.infinigen.safetensors)" >&2
  build/bin/infinigen prepare --model "$MODEL" --cpu-weights q8 \
    --out "$MODEL.infinigen.safetensors.part" >&2
  mv "$MODEL.infinigen.safetensors.part" "$MODEL.infinigen.safetensors"
fi
PORT="${INFINIGEN_PORT:-50551}"
LOG="$(mktemp -t infinigen-serve.XXXXXX.log)"
# shellcheck disable=SC2086
build/bin/infinigen serve --model "$MODEL" --listen "127.0.0.1:$PORT" ${INFINIGEN_SERVE_FLAGS:-} \
  >"$LOG" 2>&1 &
SERVER=$!
trap 'kill -TERM $SERVER 2>/dev/null; wait $SERVER 2>/dev/null || true' EXIT
if ! build/bin/infinigen client --server "127.0.0.1:$PORT" --wait-seconds 120 \
  --prompt "Photosynthesis is the process by which" --max-tokens 48 "$@"; then
  echo "--- server log ($LOG) ---" >&2
  cat "$LOG" >&2
  exit 1
fi
