#!/usr/bin/env bash
# Resume vs replay after kill -9 (docs/benchmarks.md, "Failover"): a KV store, two workers
# (SmolLM2, q8 weights, CPU, one thread each) and a router, all real processes on 127.0.0.1;
# one stream of a PROMPT-token prompt through the router (`infinigen load`); once the worker
# serving it has generated 8 tokens it is killed with SIGKILL, and the router moves the stream
# to the other worker, which either takes the stream's KV over from the store (resume, the
# default) or recomputes the prompt and the tokens sent (replay: router
# --resume_from_store=false). Reported: the longest gap between two tokens the client saw (the
# kill to the next token, detection included), the prompt tokens the surviving worker
# prefilled, and the ratio replay / resume of the gap.
#
# POLICY=infinigen runs the workers with InfiniGen (the sidecar next to the model; a resume then
# also rebuilds the partial key cache from the stored keys).
#
# usage: [POLICY=full] scripts/bench/resume_vs_replay.sh [prompt_tokens="1024 4096 8000"] [transport=shm]
set -euo pipefail
cd "$(dirname "$0")/../.."
MODEL="$(scripts/setup.sh)"
PROMPTS="${1:-1024 4096 8000}" TRANSPORT="${2:-shm}"
BIN=build/bin
POLICY="${POLICY:-full}"
LOGS="$(mktemp -d)"
PIDS=()
cleanup() {
  for p in "${PIDS[@]}"; do kill -9 "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
  PIDS=()
}
trap cleanup EXIT
port() { echo $((20000 + RANDOM % 20000)); }
wait_for() {  # log file, pattern
  for _ in $(seq 1 1200); do grep -q "$2" "$1" 2>/dev/null && return 0; sleep 0.1; done
  echo "timed out waiting for '$2' in $1" >&2; cat "$1" >&2; return 1
}
metric() {  # port, name: the value, 0 when absent
  curl -s "http://127.0.0.1:$1/metrics" | awk -v n="$2" '$1 == n {print $2; found=1} END {if (!found) print 0}'
}

run_case() {  # prompt tokens, resume (true|false): prints "gap_ms prefilled_by_survivor ttft_ms"
  local prompt="$1" resume="$2"
  local sp=$(port) w0=$(port) w1=$(port) m0=$(port) m1=$(port) rp=$(port)
  local ucx=()
  [[ "$TRANSPORT" == ucx ]] && ucx=(--ucx_port "$(port)")
  $BIN/infinigen-kvstore --listen "127.0.0.1:$sp" --capacity_mb 2048 --huge_pages=false \
    "${ucx[@]}" > "$LOGS/store.log" 2>&1 &
  PIDS+=($!)
  wait_for "$LOGS/store.log" "serving"
  local wpids=()
  for i in 0 1; do
    local wp=$([[ $i == 0 ]] && echo "$w0" || echo "$w1") mp=$([[ $i == 0 ]] && echo "$m0" || echo "$m1")
    $BIN/infinigen-worker --model "$MODEL" --listen "127.0.0.1:$wp" --metrics_port "$mp" \
      --cpu_weights q8 --cpu_kv bf16 --threads 1 --policy "$POLICY" --kv_transport "$TRANSPORT" \
      --kv_store "127.0.0.1:$sp" --prefill_budget 1024 > "$LOGS/w$i.log" 2>&1 &
    PIDS+=($!)
    wpids+=($!)
  done
  wait_for "$LOGS/w0.log" "serving"
  wait_for "$LOGS/w1.log" "serving"
  $BIN/infinigen-router --listen "127.0.0.1:$rp" --workers "127.0.0.1:$w0,127.0.0.1:$w1" \
    --health_interval_ms 200 --max_prompt_tokens 8192 --resume_from_store="$resume" \
    > "$LOGS/router.log" 2>&1 &
  PIDS+=($!)
  wait_for "$LOGS/router.log" "serving"
  $BIN/infinigen load --server "127.0.0.1:$rp" --streams 1 --seconds 1 --prompt-tokens "$prompt" \
    --max-tokens 32 --timeout 600 --json "$LOGS/load.json" > "$LOGS/load.log" 2>&1 &
  local load=$!
  # The worker serving the stream, once it has generated 8 tokens, dies.
  local victim="" survivor_metrics=""
  for _ in $(seq 1 3000); do
    if [[ $(metric "$m0" infinigen_worker_generated_tokens_total) -ge 8 ]] 2>/dev/null; then
      victim=${wpids[0]} survivor_metrics=$m1; break
    fi
    if [[ $(metric "$m1" infinigen_worker_generated_tokens_total) -ge 8 ]] 2>/dev/null; then
      victim=${wpids[1]} survivor_metrics=$m0; break
    fi
    sleep 0.05
  done
  [[ -n "$victim" ]] || { echo "no worker generated tokens" >&2; cat "$LOGS/load.log" >&2; return 1; }
  kill -9 "$victim"
  wait "$load" || true
  local prefilled
  prefilled=$(metric "$survivor_metrics" infinigen_worker_prompt_tokens_total)
  python3 - "$LOGS/load.json" "$prefilled" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
assert d["errors"] == 0 and d["requests_ok"] == 1, d
print(f'{d["token_gap_max_ms"]:.0f} {float(sys.argv[2]):.0f} {d["ttft_p50_ms"]:.0f}')
PY
  cleanup
}

echo "| prompt tokens | resume: kill to next token (ms) | prefilled again | replay: kill to next token (ms) | prefilled again | replay / resume |"
echo "|---:|---:|---:|---:|---:|---:|"
for prompt in $PROMPTS; do
  read -r rg rp _ < <(run_case "$prompt" true)
  read -r pg pp _ < <(run_case "$prompt" false)
  python3 -c "print(f'| $prompt | $rg | $rp | $pg | $pp | {$pg / max($rg, 1):.1f}x |')"
done
