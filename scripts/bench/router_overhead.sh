#!/usr/bin/env bash
# Router overhead per token: the same bounded load (`infinigen load`) straight to a worker and
# through infinigen-router in front of it, at 1, 16 and 64 streams, then the most concurrent
# streams the router holds with zero errors. The tiny Llama 3.1 fixture keeps the model's own
# time per token near 1 ms so the router's share is visible. Prints a markdown table.
# Usage: scripts/bench/router_overhead.sh [seconds per run (10)] [held streams list ("256 512")]
set -euo pipefail
cd "$(dirname "$0")/../.."
SECONDS_PER_RUN="${1:-10}"
HELD="${2:-256 512}"
BIN=build/bin
OUT="$(mktemp -d)"
MODEL=tests/fixtures/hf/llama31_gqa
WPORT=50591
RPORT=50592
$BIN/infinigen-worker --model $MODEL --listen 127.0.0.1:$WPORT --policy full --threads 1 \
  --max_running 64 --max_queued 4096 >"$OUT/worker.log" 2>&1 &
WORKER=$!
$BIN/infinigen-router --listen 127.0.0.1:$RPORT --workers 127.0.0.1:$WPORT \
  --max_streams 4096 --max_queued 4096 >"$OUT/router.log" 2>&1 &
ROUTER=$!
trap 'kill $WORKER $ROUTER 2>/dev/null || true' EXIT
load() {  # api port streams name
  $BIN/infinigen load --api "$1" --server "127.0.0.1:$2" --wait-seconds 30 --streams "$3" \
    --seconds "$SECONDS_PER_RUN" --prompt-tokens 32 --max-tokens 64 --json "$OUT/$4.json" \
    >/dev/null
}
field() { python3 -c "import json,sys; print(round(json.load(open('$1'))['$2'], 3))"; }
echo "| streams | direct gap p50 / p99 (ms) | router gap p50 / p99 (ms) | added p50 / p99 (ms) | direct / router tokens/s | errors |"
echo "|---|---|---|---|---|---|"
for n in 1 16 64; do
  load worker $WPORT "$n" "direct_$n"
  load public $RPORT "$n" "router_$n"
  d50=$(field "$OUT/direct_$n.json" token_gap_p50_ms); d99=$(field "$OUT/direct_$n.json" token_gap_p99_ms)
  r50=$(field "$OUT/router_$n.json" token_gap_p50_ms); r99=$(field "$OUT/router_$n.json" token_gap_p99_ms)
  dt=$(field "$OUT/direct_$n.json" tokens_per_second); rt=$(field "$OUT/router_$n.json" tokens_per_second)
  e=$(( $(field "$OUT/direct_$n.json" errors) + $(field "$OUT/router_$n.json" errors) ))
  a50=$(python3 -c "print(round($r50 - $d50, 3))"); a99=$(python3 -c "print(round($r99 - $d99, 3))")
  echo "| $n | $d50 / $d99 | $r50 / $r99 | $a50 / $a99 | $dt / $rt | $e |"
done
echo
echo "| streams held through the router | requests ok | tokens/s | errors | ttft p99 (ms) |"
echo "|---|---|---|---|---|"
for n in $HELD; do
  load public $RPORT "$n" "held_$n"
  echo "| $n | $(field "$OUT/held_$n.json" requests_ok) | $(field "$OUT/held_$n.json" tokens_per_second) | $(field "$OUT/held_$n.json" errors) | $(field "$OUT/held_$n.json" ttft_p99_ms) |"
done
