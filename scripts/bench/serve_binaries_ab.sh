#!/usr/bin/env bash
# Two builds of `infinigen` compared through the path a user runs (docs/benchmarks.md): for each
# binary in turn, `infinigen serve` on the CPU (SERVE_FLAGS, default q4_1 weights, dense
# attention) and `infinigen load` through its public API (LOAD_FLAGS, default 16 streams of
# 512-token random prompts, 128 tokens each, for 40 s), in alternating rounds so that both share
# the VM's state. Prints each run's summary line (requests, tokens/s, errors) and its TTFT and
# TPOT percentiles.
#
# Build the "before" binary first, e.g.: git stash; cmake --build build --target infinigen;
# cp build/bin/infinigen /tmp/infinigen.before; git stash pop; cmake --build build.
#
# usage: [SERVE_FLAGS="..."] [LOAD_FLAGS="..."] scripts/bench/serve_binaries_ab.sh
#          BEFORE_BINARY AFTER_BINARY [rounds=2]
set -euo pipefail
cd "$(dirname "$0")/../.."
[[ $# -ge 2 ]] || { sed -n '2,13p' "$0" >&2; exit 2; }
BEFORE="$1" AFTER="$2" ROUNDS="${3:-2}"
MODEL="$(scripts/setup.sh)"
SERVE_FLAGS="${SERVE_FLAGS:---cpu-weights q4_1 --policy full --threads 2}"
LOAD_FLAGS="${LOAD_FLAGS:---streams 16 --seconds 40 --prompt-tokens 512 --max-tokens 128}"
LOGS="$(mktemp -d)"
PID=""
cleanup() { [[ -n "$PID" ]] && kill "$PID" 2>/dev/null; wait 2>/dev/null || true; }
trap cleanup EXIT

for round in $(seq 1 "$ROUNDS"); do
  for which in before after; do
    bin="$BEFORE"
    [[ "$which" == after ]] && bin="$AFTER"
    port=$((56000 + RANDOM % 1000))
    # shellcheck disable=SC2086  # the flags are words
    "$bin" serve --model "$MODEL" --listen "127.0.0.1:$port" $SERVE_FLAGS > "$LOGS/serve.log" 2>&1 &
    PID=$!
    # shellcheck disable=SC2086
    build/bin/infinigen load --server "127.0.0.1:$port" --wait-seconds 120 $LOAD_FLAGS \
      > "$LOGS/load.txt" 2>&1 || true
    kill "$PID"
    wait "$PID" 2>/dev/null || true
    PID=""
    echo "== $which ($bin), round $round"
    cat "$LOGS/load.txt"
  done
done
