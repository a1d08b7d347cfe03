#!/usr/bin/env bash
# The soak (hardening issue; results in docs/benchmarks.md, "Soak"): a KV store, two workers and a
# router, real processes on 127.0.0.1, under `infinigen load` for MINUTES with a mix of normal,
# cancelled (after a few tokens), deadline-exceeded (10-200 ms deadlines) and malformed (a token
# id outside the vocabulary) requests. Every SAMPLE seconds it records each process's RSS, open
# file descriptors and threads. At the end it reports, and checks:
#   - unexpected errors: 0 (the mix's own CANCELLED / DEADLINE_EXCEEDED / INVALID_ARGUMENT are
#     counted apart);
#   - each process's RSS slope after the warm-up (the first WARMUP_PCT percent of the samples),
#     by least squares: target < 1 MiB/min;
#   - open fds and threads after the warm-up: their range (flat: max - min small and no trend);
#   - the store's bytes in use and sequences after the load: back to their idle values.
# Exit status 1 when a check fails.
#
# usage: [MODEL=path] [TRANSPORT=shm] [SAMPLE=10] [WARMUP_PCT=20] scripts/soak.sh [minutes=30] [streams=8]
#   MODEL defaults to the tiny Llama 3.1 fixture (many short requests: the most churn per minute);
#   MODEL=smollm2 uses the real SmolLM2 (scripts/setup.sh fetches it).
set -euo pipefail
cd "$(dirname "$0")/.."
MINUTES="${1:-30}" STREAMS="${2:-8}"
TRANSPORT="${TRANSPORT:-shm}" SAMPLE="${SAMPLE:-10}" WARMUP_PCT="${WARMUP_PCT:-20}"
MODEL="${MODEL:-tests/fixtures/hf/llama31_gqa}"
[[ "$MODEL" == smollm2 ]] && MODEL="$(scripts/setup.sh)"
BIN=build/bin
for b in infinigen infinigen-kvstore infinigen-worker infinigen-router; do
  [[ -x "$BIN/$b" ]] || { echo "build first: $BIN/$b is missing (cmake --build build)" >&2; exit 2; }
done
OUT="$(mktemp -d /tmp/soak.XXXXXX)"
PIDS=()
cleanup() {
  for p in "${PIDS[@]}"; do kill -9 "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
}
trap cleanup EXIT
port() { echo $((20000 + RANDOM % 12000)); }  # below the ephemeral range
wait_for() {  # log file, pattern
  for _ in $(seq 1 600); do grep -q "$2" "$1" 2>/dev/null && return 0; sleep 0.1; done
  echo "timed out waiting for '$2' in $1" >&2; cat "$1" >&2; exit 1
}
metric() {  # port, name
  curl -s "http://127.0.0.1:$1/metrics" | awk -v n="$2" '$1 == n {print $2; found=1} END {if (!found) print "?"}'
}

SP=$(port) SM=$(port) W0=$(port) W1=$(port) RP=$(port)
$BIN/infinigen-kvstore --listen "127.0.0.1:$SP" --metrics_port "$SM" --capacity_mb 512 \
  --huge_pages=false > "$OUT/store.log" 2>&1 &
STORE=$!; PIDS+=($STORE)
wait_for "$OUT/store.log" "serving"
WORKERS=()
for wp in "$W0" "$W1"; do
  $BIN/infinigen-worker --model "$MODEL" --listen "127.0.0.1:$wp" --threads 1 --policy full \
    --kv_transport "$TRANSPORT" --kv_store "127.0.0.1:$SP" > "$OUT/worker_$wp.log" 2>&1 &
  WORKERS+=($!); PIDS+=($!)
done
for wp in "$W0" "$W1"; do wait_for "$OUT/worker_$wp.log" "serving"; done
$BIN/infinigen-router --listen "127.0.0.1:$RP" --workers "127.0.0.1:$W0,127.0.0.1:$W1" \
  --health_interval_ms 500 > "$OUT/router.log" 2>&1 &
ROUTER=$!; PIDS+=($ROUTER)
wait_for "$OUT/router.log" "serving"

IDLE_BYTES=$(metric "$SM" infinigen_kvstore_bytes_used)
IDLE_SEQS=$(metric "$SM" infinigen_kvstore_sequences)
echo "soak: $MINUTES min, $STREAMS streams, model $MODEL, transport $TRANSPORT; logs in $OUT"
echo "t_s,process,rss_kib,fds,threads" > "$OUT/samples.csv"
sample() {  # seconds since start
  local name pid
  for name in store worker0 worker1 router; do
    case $name in
      store) pid=$STORE ;; worker0) pid=${WORKERS[0]} ;; worker1) pid=${WORKERS[1]} ;; router) pid=$ROUTER ;;
    esac
    [[ -d /proc/$pid ]] || { echo "soak: $name (pid $pid) is gone" >&2; return 1; }
    local rss threads fds
    rss=$(awk '/^VmRSS:/ {print $2}' "/proc/$pid/status")
    threads=$(awk '/^Threads:/ {print $2}' "/proc/$pid/status")
    fds=$(ls "/proc/$pid/fd" | wc -l)
    echo "$1,$name,$rss,$fds,$threads" >> "$OUT/samples.csv"
  done
}

START=$(date +%s)
$BIN/infinigen load --server "127.0.0.1:$RP" --streams "$STREAMS" --seconds $((MINUTES * 60)) \
  --prompt-tokens 48 --max-tokens 32 --temperature 0.7 --timeout 60 \
  --cancel-fraction 0.1 --deadline-fraction 0.1 --malformed-fraction 0.05 \
  --json "$OUT/load.json" > "$OUT/load.log" 2>&1 &
LOAD=$!
while kill -0 "$LOAD" 2>/dev/null; do
  sample $(( $(date +%s) - START ))
  sleep "$SAMPLE"
done
wait "$LOAD" || true
cat "$OUT/load.log"
sleep 2  # closes in flight reach the store
AFTER_BYTES=$(metric "$SM" infinigen_kvstore_bytes_used)
AFTER_SEQS=$(metric "$SM" infinigen_kvstore_sequences)

/usr/bin/python3 - "$OUT" "$WARMUP_PCT" "$IDLE_BYTES" "$AFTER_BYTES" "$IDLE_SEQS" "$AFTER_SEQS" <<'EOF'
import csv, json, sys
out, warmup_pct = sys.argv[1], float(sys.argv[2])
idle_bytes, after_bytes, idle_seqs, after_seqs = sys.argv[3:7]
rows = list(csv.DictReader(open(f"{out}/samples.csv")))
load = json.load(open(f"{out}/load.json"))
fail = []
print("\n| process | samples | RSS after warm-up (MiB) | RSS slope (MiB/min) | fds | threads |")
print("|---|---|---|---|---|---|")
for name in ["store", "worker0", "worker1", "router"]:
    r = [x for x in rows if x["process"] == name]
    r = r[int(len(r) * warmup_pct / 100):]
    if len(r) < 3:
        fail.append(f"{name}: too few samples after the warm-up ({len(r)})"); continue
    t = [float(x["t_s"]) / 60 for x in r]
    m = [float(x["rss_kib"]) / 1024 for x in r]
    tm, mm = sum(t) / len(t), sum(m) / len(m)
    slope = sum((a - tm) * (b - mm) for a, b in zip(t, m)) / max(1e-9, sum((a - tm) ** 2 for a in t))
    fds = [int(x["fds"]) for x in r]; th = [int(x["threads"]) for x in r]
    print(f"| {name} | {len(r)} | {min(m):.1f}-{max(m):.1f} | {slope:+.3f} | {min(fds)}-{max(fds)} | {min(th)}-{max(th)} |")
    if slope >= 1.0: fail.append(f"{name}: RSS grows {slope:.2f} MiB/min after the warm-up")
    if max(fds) - min(fds) > 16: fail.append(f"{name}: open fds range {min(fds)}-{max(fds)}")
    if max(th) - min(th) > 16: fail.append(f"{name}: threads range {min(th)}-{max(th)}")
errors = load.get("errors", 0)
print(f"\nrequests ok: {load['requests_ok']}, tokens: {load['tokens']}, "
      f"expected failures (the mix): {load.get('expected_failures', {})}, unexpected errors: {errors}")
print(f"store bytes in use: idle {idle_bytes}, after the load {after_bytes}; "
      f"sequences: idle {idle_seqs}, after {after_seqs}")
if errors: fail.append(f"{errors} unexpected errors: {load.get('error_codes')}")
if after_bytes != idle_bytes or after_seqs != idle_seqs:
    fail.append("the store did not return to its idle bytes / sequences")
for f in fail: print("FAIL:", f)
print("soak:", "FAILED" if fail else "passed")
sys.exit(1 if fail else 0)
EOF
