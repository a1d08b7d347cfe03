#!/usr/bin/env bash
# The GPU job, one command on a GPU machine: builds the GPU targets (unless BIN names a folder
# that has them, e.g. one packed by scripts/gpu/pack.sh), runs the gpu tests, the decode
# benchmark and the transformers peer, and prints the tables last. Results under OUT (out/gpu).
#   scripts/gpu/run.sh [gpu_decode_bench flags...]
set -uo pipefail
cd "$(dirname "$0")/../.."
BIN=${BIN:-build/bin}
OUT=${OUT:-out/gpu}
mkdir -p "$OUT"
if [ ! -x "$BIN/gpu_decode_bench" ]; then
  cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release -DINFINIGEN_WITH_SERVICES=OFF &&
    cmake --build build --target cuda_backend_test cuda_kernels_test cuda_model_test \
      gpu_decode_bench || exit 1
fi
nvidia-smi -L | tee "$OUT/device.txt"
status=0
for t in cuda_backend_test cuda_kernels_test cuda_model_test; do
  "$BIN/$t" --gtest_brief=1 2>&1 | tee -a "$OUT/tests.log" | tail -3 || status=1
done
"$BIN/gpu_decode_bench" "$@" 2>&1 | tee "$OUT/bench.md" || status=1
python3 scripts/gpu/hf_peer.py 2>&1 | grep -v Warning | tee "$OUT/hf.md" || status=1
echo
grep -E "PASSED|FAILED" "$OUT/tests.log"
grep -E "^device|^gather" "$OUT/bench.md"
sed -n '/^| context/,$p' "$OUT/bench.md"
sed -n '/^Hugging Face/,$p' "$OUT/hf.md"
exit $status
