#!/usr/bin/env bash
# The KV pool's accuracy (docs/accuracy.md, "KV pool"): SmolLM2-135M (CPU, q8 weights) on
# WikiText-2, one 2K window whose last 1536 tokens are decoded one at a time and scored, each
# sequence keeping at most half of its 2048 tokens (a share of 1024: eviction starts after 512
# decoded tokens), dense and InfiniGen at a 20% budget, counter / fifo / lru eviction, over the KV
# store as the worker runs it (--kv-store), next to the same runs without a pool. Writes a
# markdown table and JSON per run into OUT_DIR (default build/kv_pool) and the tables to stdout.
# About 15 minutes on 2 cores.
set -euo pipefail
cd "$(dirname "$0")/../.."
MODEL="$(scripts/setup.sh)"
OUT="${1:-build/kv_pool}"
mkdir -p "$OUT"
BIN=build/bin/infinigen
WIKI=../shared/testdata/corpora/wikitext-2/test.txt
COMMON=(--model "$MODEL" --cpu-weights q8)
SIDECAR="$OUT/tuned.safetensors"
[[ -s "$SIDECAR" ]] || $BIN prepare "${COMMON[@]}" --ratio 0.4 --channel-rule product \
  --out "$SIDECAR" >&2
RUN=("${COMMON[@]}" --sidecar "$SIDECAR" --corpus "$WIKI" --context 2048 --eval-tokens 1536
     --policies full,infinigen --budgets 0.2 --alphas 10 --no-recall --kv-store)
run() {  # name, then flags
  local name="$1"; shift
  [[ -s "$OUT/$name.md" ]] || $BIN eval "${RUN[@]}" "$@" --json "$OUT/$name.json" > "$OUT/$name.md"
  echo "### $name"
  cat "$OUT/$name.md"
}
run no_pool
for eviction in counter fifo lru; do
  run "pool_0.5_$eviction" --kv-pool 0.5 --eviction "$eviction"
done
