#!/usr/bin/env bash
# A conversation's second turn against a cold request of the same prompt (docs/benchmarks.md,
# "Conversations"): `infinigen serve` (router, worker and in-process KV store; CPU, q8 weights,
# bf16 K/V, policy full), then through its public API (`infinigen client`):
#   turn 1: PROMPT random token ids, session s, 16 greedy tokens;
#   turn 2: turn 1's prompt + its answer + 32 new ids, session s: takes the session's KV over
#           and prefills only what is new;
#   cold:   the same prompt as turn 2 under another session: prefills all of it.
# Reported: time to first token of each and cold / turn 2, with the cached tokens usage reports.
#
# usage: scripts/bench/conversation_turns.sh [prompt_tokens="1024 4096"] [threads=2]
set -euo pipefail
cd "$(dirname "$0")/../.."
MODEL="$(scripts/setup.sh)"
PROMPTS="${1:-1024 4096}" THREADS="${2:-2}"
BIN=build/bin
LOGS="$(mktemp -d)"
PID=""
cleanup() { [[ -n "$PID" ]] && kill "$PID" 2>/dev/null; wait 2>/dev/null || true; }
trap cleanup EXIT
PORT=$((40000 + RANDOM % 10000))
$BIN/infinigen serve --model "$MODEL" --listen "127.0.0.1:$PORT" --policy full --cpu-weights q8 \
  --cpu-kv bf16 --threads "$THREADS" --kv-capacity-mb 4096 > "$LOGS/serve.log" 2>&1 &
PID=$!
for _ in $(seq 1 600); do grep -q "serving" "$LOGS/serve.log" && break; sleep 0.1; done

ask() {  # ids, session: prints "ids|ttft|cached" (ids comma-separated)
  $BIN/infinigen client --server "127.0.0.1:$PORT" --prompt-ids "$1" --session "$2" \
    --max-tokens 16 --temperature 0 --ids 2> "$LOGS/err" > "$LOGS/out"
  python3 - "$LOGS/out" "$LOGS/err" <<'PY'
import re, sys
ids = open(sys.argv[1]).read().strip().strip("[]").replace(" ", "")
err = open(sys.argv[2]).read()
ttft = re.search(r"time to first token ([0-9.]+) s", err).group(1)
cached = re.search(r"\((\d+) cached\)", err).group(1)
print(f"{ids}|{ttft}|{cached}")
PY
}
random_ids() { python3 -c "import random; r=random.Random($2); print(','.join(str(r.randrange(1, 49000)) for _ in range($1)))"; }

echo "| prompt tokens (turn 2) | turn 2: TTFT (s), cached tokens | cold: TTFT (s), cached tokens | cold / turn 2 |"
echo "|---:|---|---|---:|"
for prompt in $PROMPTS; do
  first=$(random_ids "$prompt" "$prompt")
  IFS='|' read -r answer t1 c1 < <(ask "$first" "conv-$prompt")
  second="$first,$answer,$(random_ids 32 $((prompt + 1)))"
  IFS='|' read -r _ t2 c2 < <(ask "$second" "conv-$prompt")
  IFS='|' read -r _ tc cc < <(ask "$second" "cold-$prompt")
  n=$(( prompt + 16 + 32 ))
  python3 -c "print(f'| $n | $t2, $c2 | $tc, $cc | {$tc / $t2:.1f}x |')"
done
