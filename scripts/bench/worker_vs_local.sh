#!/usr/bin/env bash
# Service-path overhead (docs/benchmarks.md, "Worker"): decode tokens/s and p50/p99 time per
# output token at 1, 4 and 16 concurrent streams on SmolLM2 (q8 CPU weights), through
# infinigen-worker + the KV store for each transport, against the local engine (BatchEngine over
# a resident KV cache, in the bench process) in the same run. Every path runs the same KV
# selection policy (default full: dense attention), so every path computes the same thing; the
# worker additionally writes every K/V row to the store and reads the selected rows from it per
# layer and step (in place over in-process and shm, copied over gRPC and UCX). With infinigen
# (the sidecar next to the model), prompts must pass the worker's --min_budget_tokens (256) for
# any layer to be sparse.
#
# TRANSPORTS (default "in-process grpc shm ucx") picks the worker paths; "ucx-grpc-appends" is
# UCX with the store told to take no appends over UCX (--ucx_appends=false: they go over gRPC).
# STREAMS (default 1,4,16) and LOCAL=0 (skip the local engine) narrow the run.
#
# usage: scripts/bench/worker_vs_local.sh [threads=2] [prompt_tokens=128] [new_tokens=64]
#                                         [policy=full]
set -euo pipefail
cd "$(dirname "$0")/../.."
MODEL="$(scripts/setup.sh)"
THREADS="${1:-2}" PROMPT="${2:-128}" NEW="${3:-64}" POLICY="${4:-full}"
BIN=build/bin
export UCX_NET_DEVICES="${UCX_NET_DEVICES:-lo}"
LOGS="$(mktemp -d)"
PIDS=()
cleanup() { for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; }
trap cleanup EXIT
COMMON=(--streams "${STREAMS:-1,4,16}" --prompt-tokens "$PROMPT" --new-tokens "$NEW" --policy "$POLICY")

wait_for() {  # log file, pattern
  for _ in $(seq 1 300); do grep -q "$2" "$1" 2>/dev/null && return 0; sleep 0.1; done
  echo "timed out waiting for '$2' in $1" >&2; cat "$1" >&2; return 1
}

echo "| path | streams | tokens/s | TPOT p50 (ms) | TPOT p99 (ms) | errors |"
echo "|---|---:|---:|---:|---:|---:|"
if [[ ${LOCAL:-1} != 0 ]]; then
  $BIN/worker_bench --local "$MODEL" --threads "$THREADS" --cpu-weights q8 "${COMMON[@]}"
fi

for path in ${TRANSPORTS:-in-process grpc shm ucx}; do
  transport=$path
  [[ $path == ucx-grpc-appends ]] && transport=ucx
  store_port=$((52000 + RANDOM % 1000)) worker_port=$((53000 + RANDOM % 1000))
  ucx_port=$((54000 + RANDOM % 1000))
  if [[ $transport != in-process ]]; then
    [[ $transport == ucx ]] && uflag=(--ucx_port "$ucx_port") || uflag=()
    [[ $path == ucx-grpc-appends ]] && uflag+=(--ucx_appends=false)
    $BIN/infinigen-kvstore --listen "127.0.0.1:$store_port" --capacity_mb 2048 \
      --huge_pages=false "${uflag[@]}" > "$LOGS/store.log" 2>&1 &
    PIDS+=($!)
    wait_for "$LOGS/store.log" "serving on port"
  fi
  $BIN/infinigen-worker --model "$MODEL" --listen "127.0.0.1:$worker_port" \
    --kv_transport "$transport" --kv_store "127.0.0.1:$store_port" --policy "$POLICY" \
    --cpu_weights q8 --threads "$THREADS" --max_running 16 > "$LOGS/worker.log" 2>&1 &
  PIDS+=($!)
  wait_for "$LOGS/worker.log" "serving"
  $BIN/worker_bench --target "127.0.0.1:$worker_port" --label "worker + store ($path)" \
    "${COMMON[@]}"
  cleanup
  PIDS=()
done
