#!/usr/bin/env bash
# The accuracy matrix of docs/accuracy.md on SmolLM2-135M (CPU, q8 weights): every policy at
# ~10% and ~20% KV budgets on WikiText-2 and on a public-domain book at 2K/4K/8K context, the
# skew ablation and an alpha sweep. Writes JSON per run into OUT_DIR (default build/accuracy) and
# the markdown tables to stdout. About an hour on 2 cores.
set -euo pipefail
cd "$(dirname "$0")/../.."
MODEL="$(scripts/setup.sh)"
OUT="${1:-build/accuracy}"
mkdir -p "$OUT"
BIN=build/bin/infinigen
WIKI=../shared/testdata/corpora/wikitext-2/test.txt
BOOKS="$(dirname "$(dirname "$MODEL")")/books"
COMMON=(--model "$MODEL" --cpu-weights q8)

# Sidecars: the paper's defaults (r = 0.2, sum rule) and ours for head_dim 64 (r = 0.4, product).
$BIN prepare "${COMMON[@]}" --ratio 0.2 --out "$OUT/paper.safetensors" >&2
$BIN prepare "${COMMON[@]}" --ratio 0.4 --channel-rule product --out "$OUT/tuned.safetensors" >&2
$BIN prepare "${COMMON[@]}" --ratio 0.2 --no-skew --out "$OUT/noskew.safetensors" >&2

run() {  # name, then eval flags
  local name="$1"; shift
  echo "### $name"
  $BIN eval "${COMMON[@]}" --json "$OUT/$name.json" "$@"
  echo
}

run wiki2k_baselines --corpus "$WIKI" --context 2048 --eval-tokens 256 --windows 2 \
  --policies full,h2o,window,oracle --budgets 0.1,0.2 --generate-tokens 128
run wiki2k_infinigen_paper --corpus "$WIKI" --context 2048 --eval-tokens 256 --windows 2 \
  --policies infinigen --budgets 0.1,0.2 --alphas 5 --sidecar "$OUT/paper.safetensors" \
  --generate-tokens 128
run wiki2k_infinigen_tuned --corpus "$WIKI" --context 2048 --eval-tokens 256 --windows 2 \
  --policies infinigen --budgets 0.1,0.2 --alphas 10 --sidecar "$OUT/tuned.safetensors" \
  --generate-tokens 128
run wiki2k_skew_ablation --corpus "$WIKI" --context 2048 --eval-tokens 256 --windows 2 \
  --policies infinigen --budgets 0.2 --alphas 10 --sidecar "$OUT/noskew.safetensors"
run wiki2k_alpha_sweep --corpus "$WIKI" --context 2048 --eval-tokens 256 --windows 2 \
  --policies infinigen --budgets 1.0 --alphas 4,6,8,10,12 --sidecar "$OUT/tuned.safetensors"
for ctx in 2048 4096 8192; do
  run "book${ctx}_baselines" --corpus "$BOOKS/persuasion.txt" --context "$ctx" --eval-tokens 256 \
    --policies full,h2o,window,oracle --budgets 0.1,0.2 --passkey-depths 0.1,0.5,0.9
  run "book${ctx}_infinigen" --corpus "$BOOKS/persuasion.txt" --context "$ctx" --eval-tokens 256 \
    --policies infinigen --budgets 0.1,0.2 --alphas 10 --sidecar "$OUT/tuned.safetensors" \
    --passkey-depths 0.1,0.5,0.9
done
