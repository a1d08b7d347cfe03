#!/usr/bin/env bash
# The UCX data plane of the KV store against ucx_perftest on the same UCX transports, at the
# per-layer gather sizes of kv_transport_bench (0.5-4 MiB). Our connections ask for peer failure
# detection, under which UCX 1.13 selects network transports only (TCP here): the comparison runs
# perftest with UCX_TLS=tcp, with endpoints made as ours are (`-e`: peer error handling, which
# also changes the protocols UCX picks) and as perftest makes them by default, and with every
# transport (shared memory) for reference.
#
# usage: [ROUNDS=3] scripts/bench/kv_transport_vs_ucx_perftest.sh [iterations]   (after a build)
# Prints a markdown table. Everything runs on 127.0.0.1 (UCX_NET_DEVICES=lo).
set -euo pipefail
cd "$(dirname "$0")/../.."
ITER="${1:-200}"
BENCH="${BENCH:-build/bin/kv_transport_bench}"
command -v ucx_perftest >/dev/null || { echo "ucx_perftest not found (apt-get install ucx-utils)" >&2; exit 2; }
[[ -x "$BENCH" ]] || { echo "$BENCH not built (scripts/build.sh)" >&2; exit 2; }
export UCX_NET_DEVICES=lo
SIZES=(524288 1048576 2097152 4194304)

# perftest TEST SIZE TLS -> the final line's fields: iterations, lat p50, lat avg, lat overall,
# bw avg (MiB/s), bw overall, msg/s avg, msg/s overall. Latency tests report one-way latency.
# A fourth argument (-e) makes endpoints with peer error handling, as our data plane does.
perftest() {
  local test="$1" size="$2" tls="$3" mode="${4:-}" port=$((20000 + RANDOM % 20000))
  UCX_TLS="$tls" timeout 120 ucx_perftest -p "$port" -t "$test" -s "$size" -n "$ITER" $mode -f \
    >/dev/null 2>&1 &
  local server=$!
  sleep 0.7
  UCX_TLS="$tls" timeout 120 ucx_perftest 127.0.0.1 -p "$port" -t "$test" -s "$size" \
    -n "$ITER" $mode -f 2>/dev/null | awk 'NF >= 8 && $1 ~ /^[0-9]+$/ {line = $0} END {print line}'
  wait "$server" || true
}

# The VM this runs on is noisy: ROUNDS rounds (default 3), each running ours and then perftest at
# every size, and the median of the rounds per column, so that a disturbed minute hits both sides.
ROUNDS="${ROUNDS:-3}"
median() { sort -g | awk '{v[NR] = $1} END {print (NR % 2) ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2}'; }
declare -A P50 GBPS BWE BWT LATE BWA
for ((r = 0; r < ROUNDS; r++)); do
  ours="$("$BENCH" --iterations "$ITER" --transports ucx | grep '^{"transport": "ucx"')"
  i=0
  for size in "${SIZES[@]}"; do
    line="$(sed -n "$((i + 1))p" <<<"$ours")"
    i=$((i + 1))
    P50[$size]+="$(sed -E 's/.*"p50_us": ([0-9.]+).*/\1/' <<<"$line") "
    GBPS[$size]+="$(sed -E 's/.*"gb_per_s": ([0-9.]+).*/\1/' <<<"$line") "
    BWE[$size]+="$(perftest ucp_am_bw "$size" tcp -e | awk '{print $6 * 1.048576 / 1000}') "
    BWT[$size]+="$(perftest ucp_am_bw "$size" tcp | awk '{print $6 * 1.048576 / 1000}') "
    LATE[$size]+="$(perftest ucp_am_lat "$size" tcp -e | awk '{print $2}') "
    BWA[$size]+="$(perftest ucp_am_bw "$size" all | awk '{print $6 * 1.048576 / 1000}') "
  done
done
echo "Medians of $ROUNDS rounds, $ITER iterations each. perftest over TCP with peer error handling (-e, as ours) and without (its default)."
echo "| gather MiB | ours p50 us | ours GB/s | am_bw -e GB/s | ours / am_bw -e | am_bw default GB/s | ours / am_bw default | am_lat -e one-way us | ours / am_lat -e (time) | shm am_bw GB/s |"
echo "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
for size in "${SIZES[@]}"; do
  col() { local -n arr="$1"; tr ' ' '\n' <<<"${arr[$size]}" | grep . | median; }
  p50="$(col P50)" gbps="$(col GBPS)" bw_e="$(col BWE)" bw_tcp="$(col BWT)" lat_e="$(col LATE)"
  bw_all="$(col BWA)"
  awk -v s="$size" -v p="$p50" -v g="$gbps" -v e="$bw_e" -v b="$bw_tcp" -v l="$lat_e" \
    -v a="$bw_all" 'BEGIN {printf "| %.1f | %.0f | %.2f | %.2f | %.2fx | %.2f | %.2fx | %.0f | %.2fx | %.2f |\n",
            s / 1048576, p, g, e, g / e, b, g / b, l, p / l, a}'
done
