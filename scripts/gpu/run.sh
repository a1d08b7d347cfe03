#!/usr/bin/env bash
# The GPU job, one command on a GPU machine: the gpu tests, the served decode path
# (scripts/gpu/served_decode.sh: the product's engine over the KV store, random
# Llama-3.1-8B-shaped weights) and the transformers peer; the served table prints last. Results
# under OUT. GPU machines here have no gRPC, absl or GoogleTest, so build here and pack:
#   scripts/gpu/pack.sh .gpu build/bin/{cuda_backend_test,cuda_kernels_test,cuda_model_test,\
#     worker_gpu_test,worker_bench,kv_device_gather_bench,libinfinigen_cuda.so}
# (writes .gpu.tgz; carry it: the script unpacks it)
# or point BIN at a folder with the binaries; with neither it builds what it can (no services).
#   scripts/gpu/run.sh
# BUDGET (s, default 540) bounds the whole job: served cases that would start later are skipped.
# CASES and NEW (16) pick the served runs (MODES their modes, see served_decode.sh). By default
# #22's targets come first, since a lease seldom has time for every case: InfiniGen against a
# full fetch at 32K at batches 1, 8 and 16, and against all-resident at batch 1 (32K, then 8K);
# the 8K batches after. HF_SHAPES picks the peer's shapes; it runs only on the time the served
# cases left ("none": no peer).
set -uo pipefail
cd "$(dirname "$0")/../.."
start=$(date +%s)
OUT=${OUT:-out/gpu}
mkdir -p "$OUT"
if [ -f .gpu.tgz ]; then
  mkdir -p /tmp/gpu && tar -xzf .gpu.tgz -C /tmp/gpu
  BIN=/tmp/gpu/.gpu/bin
  export LD_LIBRARY_PATH=/tmp/gpu/.gpu/lib:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
fi
BIN=${BIN:-build/bin}
if [ ! -x "$BIN/cuda_model_test" ]; then
  cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release -DINFINIGEN_WITH_SERVICES=OFF &&
    cmake --build build --target cuda_backend_test cuda_kernels_test cuda_model_test || exit 1
fi
# Tests find fixtures and sibling binaries through these (their compiled-in paths are this
# machine's only when they were built here).
export INFINIGEN_SOURCE_DIR=$PWD INFINIGEN_BINARY_DIR=$(dirname "$BIN")
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/device.txt"
status=0
for t in cuda_backend_test cuda_kernels_test cuda_model_test worker_gpu_test; do
  [ -x "$BIN/$t" ] || continue
  echo "== $t" >> "$OUT/tests.log"
  timeout 120 "$BIN/$t" --gtest_brief=1 >> "$OUT/tests.log" 2>&1 || status=1
done
# The gather of chosen rows from the store's arena against a pinned copy (#22: >= 80%).
if [ -x "$BIN/kv_device_gather_bench" ]; then
  for batch in 1 8; do
    timeout 60 "$BIN/kv_device_gather_bench" --device cuda --tokens 32768 --batch $batch \
      >> "$OUT/gather.md" 2>&1 || status=1
  done
fi
reserve=15  # seconds kept for the tables
if [ -x "$BIN/worker_bench" ]; then
  DEADLINE=$((start + ${BUDGET:-540} - reserve)) CASE_TIMEOUT=${CASE_TIMEOUT:-150} \
    CASES=${CASES:-32768:1 32768:8:infinigen,full 8192:1 32768:16:infinigen,full \
      8192:8:infinigen,full 8192:16:infinigen,full} BIN=$BIN \
    PROFILE_OUT=$OUT/profile.md \
    scripts/gpu/served_decode.sh "" "" "${NEW:-16}" 2>&1 | tee "$OUT/served.md" || status=1
else
  echo "no $BIN/worker_bench: the served path was not measured (pack it, see above)" |
    tee "$OUT/served.md"
fi
left=$((start + ${BUDGET:-540} - $(date +%s) - 10))
if [ "$left" -gt 30 ] && [ "${HF_SHAPES:-}" != none ]; then
  timeout "$left" env PYTHONUNBUFFERED=1 python3 scripts/gpu/hf_peer.py \
    --shapes "${HF_SHAPES:-8192x1,32768x1,8192x8}" 2>&1 | grep -v Warning | tee "$OUT/hf.md"
fi
echo
cat "$OUT/device.txt"
grep -E "^\[  (PASSED|FAILED) |^== |tests, listed below" "$OUT/tests.log"
sed -n '/^Hugging Face/,$p' "$OUT/hf.md" 2>/dev/null
echo "gather of chosen rows from the store's arena vs a pinned copy (kv_device_gather_bench):"
cat "$OUT/gather.md" 2>/dev/null
echo "served decode path (worker engine + KV store, random Llama-3.1-8B weights):"
cat "$OUT/served.md"
exit $status
