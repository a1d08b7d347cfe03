#!/usr/bin/env bash
# InfiniGen against dense attention through the path a user runs on one machine (docs/
# benchmarks.md, "Decode step on the CPU"): `infinigen serve` (router, worker and KV store in one
# process, CPU, q8 weights unless WEIGHTS says otherwise) started once per policy, and
# `infinigen load` through its public API with one stream of random prompt ids of each length
# (greedy, EOS ignored). Reported: the time between tokens (TPOT) p50 / p99 as the client sees
# it, in interleaved rounds so that both policies share the VM's state; the ratio is InfiniGen's
# p50 over dense's in the same round.
# The InfiniGen sidecar next to the model is made first if missing (`infinigen prepare`).
# KV=f32|bf16 picks the K/V storage of both policies (default: bf16, serve's default); with
# KV_BASELINE=f32 a third case, dense over float32 K/V, runs in each round too (the ratio stays
# InfiniGen over dense with the same K/V storage).
#
# usage: [KV=bf16] [KV_BASELINE=f32] [WEIGHTS=q8|q4_1|bf16|f32]
#          scripts/bench/infinigen_vs_dense_serve.sh
#            [prompt_tokens="4096 8000"] [rounds=2] [new_tokens=32] [threads=2]
set -euo pipefail
cd "$(dirname "$0")/../.."
MODEL="$(scripts/setup.sh)"
PROMPTS="${1:-4096 8000}" ROUNDS="${2:-2}" NEW="${3:-32}" THREADS="${4:-2}"
BIN=build/bin
[[ -s "$MODEL.infinigen.safetensors" ]] || $BIN/infinigen prepare --model "$MODEL" --cpu-weights q8 >&2
LOGS="$(mktemp -d)"
PID=""
cleanup() { [[ -n "$PID" ]] && kill "$PID" 2>/dev/null; wait 2>/dev/null || true; }
trap cleanup EXIT

wait_for() {  # log file, pattern
  for _ in $(seq 1 600); do grep -q "$2" "$1" 2>/dev/null && return 0; sleep 0.1; done
  echo "timed out waiting for '$2' in $1" >&2; cat "$1" >&2; return 1
}

KV="${KV:-bf16}" KV_BASELINE="${KV_BASELINE:-}" WEIGHTS="${WEIGHTS:-q8}"
# One case: serve with `policy` over `kv` K/V, one stream of `prompt`-token requests for 20 s at most; prints
# "p50 p99" in ms.
run_case() {
  local policy="$1" prompt="$2" kv="$3" port=$((55000 + RANDOM % 1000))
  $BIN/infinigen serve --model "$MODEL" --listen "127.0.0.1:$port" --policy "$policy" \
    --cpu-weights "$WEIGHTS" --cpu-kv "$kv" --threads "$THREADS" --kv-capacity-mb 4096 \
    --max-running 4 --prefill-budget 1024 > "$LOGS/serve.log" 2>&1 &
  PID=$!
  wait_for "$LOGS/serve.log" "serving"
  $BIN/infinigen load --server "127.0.0.1:$port" --streams 1 --seconds 1 \
    --prompt-tokens "$prompt" --max-tokens "$NEW" --json "$LOGS/load.json" > /dev/null
  cleanup
  PID=""
  python3 - "$LOGS/load.json" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
print(f'{d["token_gap_p50_ms"]:.1f} {d["token_gap_p99_ms"]:.1f}')
PY
}

if [[ -n "$KV_BASELINE" ]]; then
  echo "| prompt tokens | round | dense, $KV_BASELINE K/V: TPOT p50 / p99 (ms) | dense, $KV K/V | InfiniGen, $KV K/V | InfiniGen / dense (p50, $KV K/V) | InfiniGen $KV / dense $KV_BASELINE |"
  echo "|---:|---:|---|---|---|---:|---:|"
else
  echo "| prompt tokens | round | dense TPOT p50 / p99 (ms), $KV K/V | InfiniGen TPOT p50 / p99 (ms) | InfiniGen / dense (p50) |"
  echo "|---:|---:|---|---|---:|"
fi
for prompt in $PROMPTS; do
  for round in $(seq 1 "$ROUNDS"); do
    [[ -n "$KV_BASELINE" ]] && read -r b50 b99 < <(run_case full "$prompt" "$KV_BASELINE")
    read -r d50 d99 < <(run_case full "$prompt" "$KV")
    read -r i50 i99 < <(run_case infinigen "$prompt" "$KV")
    ratio=$(python3 -c "print(f'{$i50 / $d50:.2f}')")
    if [[ -n "$KV_BASELINE" ]]; then
      base=$(python3 -c "print(f'{$i50 / $b50:.2f}')")
      echo "| $prompt | $round | $b50 / $b99 | $d50 / $d99 | $i50 / $i99 | ${ratio}x | ${base}x |"
    else
      echo "| $prompt | $round | $d50 / $d99 | $i50 / $i99 | ${ratio}x |"
    fi
  done
done
