#!/usr/bin/env bash
# The OpenAI-compatible HTTP front door against the gRPC API it calls (docs/benchmarks.md, "HTTP
# vs gRPC"): one `infinigen serve` (SmolLM2-135M-Instruct, CPU, q8 weights, bf16 K/V, policy
# full) with both listeners, then `infinigen load` over each in turn, the same load (STREAMS
# streams of random 32-token prompts, 32 sampled tokens each, EOS ignored, SECONDS each), twice in
# alternating order: requests/s, tokens/s, time to first token and between tokens (p50 / p99) as
# the client sees them.
#
# usage: scripts/bench/http_vs_grpc.sh [streams=16] [seconds=20] [threads=2]
set -euo pipefail
cd "$(dirname "$0")/../.."
MODEL="${MODEL:-$(scripts/setup.sh)}"  # MODEL=tests/fixtures/hf/llama31_gqa: the front door alone
STREAMS="${1:-16}" SECONDS_EACH="${2:-20}" THREADS="${3:-2}"
BIN=build/bin
LOGS="$(mktemp -d)"
PID=""
cleanup() { [[ -n "$PID" ]] && kill "$PID" 2>/dev/null; wait 2>/dev/null || true; }
trap cleanup EXIT
PORT=$((40000 + RANDOM % 10000)) HTTP=$((50000 + RANDOM % 10000))
$BIN/infinigen serve --model "$MODEL" --listen "127.0.0.1:$PORT" --http-listen "127.0.0.1:$HTTP" \
  --policy full --cpu-weights q8 --cpu-kv bf16 --threads "$THREADS" > "$LOGS/serve.log" 2>&1 &
PID=$!
for _ in $(seq 1 600); do grep -q "serving" "$LOGS/serve.log" && break; sleep 0.1; done

run() {  # api, server: one row
  $BIN/infinigen load --api "$1" --server "$2" --streams "$STREAMS" --seconds "$SECONDS_EACH" \
    --prompt-tokens 32 --max-tokens 32 --temperature 0.7 --json "$LOGS/load.json" > /dev/null
  python3 - "$1" "$LOGS/load.json" <<'PY'
import json, sys
j = json.load(open(sys.argv[2]))
print(f"| {sys.argv[1]} | {j['requests_per_second']:.2f} | {j['tokens_per_second']:.1f} | "
      f"{j['ttft_p50_ms']:.1f} / {j['ttft_p99_ms']:.1f} | "
      f"{j['token_gap_p50_ms']:.1f} / {j['token_gap_p99_ms']:.1f} | {j['errors']} |")
PY
}
echo "| API | requests/s | tokens/s | TTFT p50 / p99 (ms) | between tokens p50 / p99 (ms) | errors |"
echo "|---|---:|---:|---:|---:|---:|"
run public "127.0.0.1:$PORT"
run openai "127.0.0.1:$HTTP"
run openai "127.0.0.1:$HTTP"
run public "127.0.0.1:$PORT"
