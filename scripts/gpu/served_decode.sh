#!/usr/bin/env bash
# The served decode path on a GPU (docs/benchmarks.md): the worker's own engine (BatchEngine and
# DecodeStep over StoreKvCache and an in-process KV store in host RAM, as `infinigen serve` and
# infinigen-worker run it) with random Llama-3.1-8B-shaped weights (no checkpoint of that shape
# can be had here), InfiniGen against a full fetch of every row (`full` over the store) against
# all K/V resident on the GPU, per context and batch. One markdown table, last.
#   BIN=build/bin scripts/gpu/served_decode.sh [contexts="8192 32768"] [batches="1 8 16"]
#       [new_tokens=16] [config=scripts/gpu/llama31_8b.json]
# CPU check of the same path (tiny shape): DEVICE=cpu scripts/gpu/served_decode.sh "200" "1 2" 4
#   tests/fixtures/hf/llama31_gqa/config.json
set -uo pipefail
cd "$(dirname "$0")/../.."
BIN=${BIN:-build/bin}
DEVICE=${DEVICE:-cuda}
CONTEXTS=${1:-8192 32768} BATCHES=${2:-1 8 16} NEW=${3:-16} CONFIG=${4:-scripts/gpu/llama31_8b.json}
KV_MB=${KV_MB:-98304}  # host RAM for the store: 16 x 32K tokens of Llama-3.1-8B is 64 GiB
echo "| context | batch | mode | tokens/s | TPOT p50 (ms) | TPOT p99 (ms) | errors |"
echo "|---:|---:|---|---:|---:|---:|---:|"
for ctx in $CONTEXTS; do
  for batch in $BATCHES; do
    for mode in infinigen full resident; do
      case $mode in
        infinigen) flags=(--kv store --policy infinigen) ;;
        full) flags=(--kv store --policy full) ;;
        resident) flags=(--kv resident --policy full) ;;
      esac
      row=$("$BIN/worker_bench" --random "$CONFIG" --device "$DEVICE" --streams "$batch" \
        --prompt-tokens "$ctx" --new-tokens "$NEW" --prefill-budget "$ctx" \
        --kv-capacity-mb "$KV_MB" --label "$mode" "${flags[@]}" 2>&1 | grep '^|' | tail -1)
      # "| label | streams | tok/s | p50 | p99 | errors |" -> with the context in front
      echo "| $ctx | ${row#| }" | sed "s/| $mode | $batch |/| $batch | $mode |/"
    done
  done
done
