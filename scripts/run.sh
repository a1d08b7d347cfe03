#!/usr/bin/env bash
# The main job: installs what is missing, builds the CLI, and generates a continuation with the
# real SmolLM2-135M-Instruct model on the CPU. Extra arguments go to `infinigen generate`.
set -euo pipefail
cd "$(dirname "$0")/.."
MODEL="$(scripts/setup.sh)"
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build build --target infinigen >/dev/null
exec build/bin/infinigen generate --model "$MODEL" \
  --prompt "Photosynthesis is the process by which" --max-tokens 48 "$@"
