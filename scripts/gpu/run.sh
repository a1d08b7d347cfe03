#!/usr/bin/env bash
# The GPU job, one command on a GPU machine: builds the GPU targets (unless BIN names a folder
# that has them, e.g. one packed by scripts/gpu/pack.sh: the served-path benchmark needs gRPC,
# which GPU machines here lack, so pack it: scripts/gpu/pack.sh .gpu build/bin/worker_bench
# build/bin/cuda_*_test build/bin/gpu_decode_bench), runs the gpu tests, the served decode path
# (scripts/gpu/served_decode.sh: the product's engine over the KV store, random
# Llama-3.1-8B-shaped weights), the standalone kernel pipeline (gpu_decode_bench, a component
# benchmark) and the transformers peer, and prints the served table last. Results under OUT.
#   scripts/gpu/run.sh [gpu_decode_bench flags...]
# SERVED="contexts|batches|new_tokens" picks the served cases (default "8192 32768|1 8 16|16").
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
if [ -x "$BIN/worker_bench" ]; then
  IFS='|' read -r contexts batches new <<< "${SERVED:-8192 32768|1 8 16|16}"
  BIN=$BIN scripts/gpu/served_decode.sh "$contexts" "$batches" "$new" 2>&1 |
    tee "$OUT/served.md" || status=1
else
  echo "no $BIN/worker_bench: the served path was not measured (pack it, see above)" |
    tee "$OUT/served.md"
fi
"$BIN/gpu_decode_bench" "$@" 2>&1 | tee "$OUT/bench.md" || status=1
python3 scripts/gpu/hf_peer.py 2>&1 | grep -v Warning | tee "$OUT/hf.md" || status=1
echo
grep -E "PASSED|FAILED" "$OUT/tests.log"
grep -E "^device|^gather" "$OUT/bench.md"
sed -n '/^| context/,$p' "$OUT/bench.md"
sed -n '/^Hugging Face/,$p' "$OUT/hf.md"
echo "served decode path (worker engine + KV store, random Llama-3.1-8B weights):"
cat "$OUT/served.md"
exit $status
