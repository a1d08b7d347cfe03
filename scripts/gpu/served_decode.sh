#!/usr/bin/env bash
# The served decode path on a GPU (docs/benchmarks.md): the worker's own engine (BatchEngine and
# DecodeStep over StoreKvCache and an in-process KV store in host RAM, as `infinigen serve` and
# infinigen-worker run it) with random Llama-3.1-8B-shaped weights (no checkpoint of that shape
# can be had here), InfiniGen against a full fetch of every row (`full` over the store) against
# all K/V resident on the GPU, per context and batch. One markdown table, last.
#   BIN=build/bin scripts/gpu/served_decode.sh [contexts="8192 32768"] [batches="1 8 16"]
#       [new_tokens=16] [config=scripts/gpu/llama31_8b.json]
# Streams are submitted at once and prefilled one per step while the others decode, so each asks
# for new_tokens + batch - 1 tokens: new_tokens - 1 decode-only steps then have every stream in
# them, and the profile (DecodeStep's) counts those alone.
# CASES="8192:1 32768:1 ..." runs those context:batch pairs in that order instead of every pair
# (context:batch:mode,mode... runs those modes for that pair, instead of MODES);
# DEADLINE (epoch seconds) skips the cases that would start after it and stops one at it; CASE_TIMEOUT (s) bounds one
# worker_bench run; KV_MB sets the store's host RAM (default: the case's K/V at Llama-3.1-8B's
# 128 KiB per token, plus a quarter). MODES (default "infinigen full resident"; also
# infinigen-copy, full-copy): over the store the GPU reads the rows from its registered memory
# (--kv-device-gather, the worker's default); -copy = the store copies them into staging that is
# then copied to the device (what a remote transport does); infinigen keeps its dense layers' K/V
# on the GPU as the worker does (--kv_resident_dense_layers), infinigen-dense-fetched reads them
# from the store every step as before; infinigen keeps each sequence's last prefetched rows on
# the GPU as the worker does (--kv-row-reuse), infinigen-noreuse moves every prefetched row;
# infinigen plans those rows on the GPU as the worker does (--kv-device-plan: no wait between
# layers), infinigen-hostplan on the host (a wait a layer); any mode with "+tiles" appended runs the prefill's
# attention on the tiled CUDA-core kernel instead of cuBLAS GEMMs (the default since lease F;
# CudaBackendOptions::gemm_causal_attention), "+gemm" through the GEMMs. A second
# table says where each case's decode steps spent their host time (DecodeStep's profile); its
# rows are also appended to PROFILE_OUT as each case ends. A third gives each case's time to first
# token (every stream submitted at once: the prefills queue). A fourth gives the KV bytes each
# case moved over the link and read where the GPU kept them, per generated token.
# CPU check of the same path (a tiny Llama-3.1 shape of 8 layers) on the tests' stand-in of a
# GPU (InfiniGen's rows chosen and planned on the "device", as on a GPU; the times are not a
# GPU's): DEVICE=device-like scripts/gpu/served_decode.sh "1024" "1 4" 8 scripts/gpu/llama31_tiny.json
# (ctest gpu_served_decode_on_the_cpu_stand_in runs its InfiniGen case); DEVICE=cpu for the CPU.
set -uo pipefail
cd "$(dirname "$0")/../.."
BIN=${BIN:-build/bin}
DEVICE=${DEVICE:-cuda}
CONTEXTS=${1:-8192 32768} BATCHES=${2:-1 8 16} NEW=${3:-16} CONFIG=${4:-scripts/gpu/llama31_8b.json}
if [ -z "${CASES:-}" ]; then
  CASES=""
  for ctx in $CONTEXTS; do for batch in $BATCHES; do CASES+="$ctx:$batch "; done; done
fi
profiles=()
ttfts=()
links=()
echo "| context | batch | mode | tokens/s | TPOT p50 (ms) | TPOT p99 (ms) | errors |"
echo "|---:|---:|---|---:|---:|---:|---:|"
for c in $CASES; do
  ctx=${c%%:*} rest=${c#*:}
  batch=${rest%%:*} case_modes=${MODES:-infinigen full resident}
  [ "$rest" != "$batch" ] && case_modes=${rest#*:}
  kv_mb=${KV_MB:-$((ctx * batch / 8 * 5 / 4 + 1024))}
  for mode in ${case_modes//,/ }; do
    limit=${CASE_TIMEOUT:-600}
    if [ -n "${DEADLINE:-}" ]; then  # a case may not run past the deadline either
      left=$((DEADLINE - $(date +%s)))
      if [ "$left" -le 5 ]; then
        echo "| $ctx | $batch | $mode | skipped: out of time | | | |"
        continue
      fi
      [ "$left" -lt "$limit" ] && limit=$left
    fi
    # MODE+tiles: the same with the prefill's attention on the tiled CUDA-core kernel
    # (INFINIGEN_CUDA_CAUSAL=tiles) instead of cuBLAS GEMMs; MODE+gemm: GEMMs (the default).
    run_env=()
    base=${mode%+*}
    [ "$base" != "$mode" ] && run_env=(INFINIGEN_CUDA_CAUSAL=${mode##*+})
    case $base in
      infinigen) flags=(--kv store --policy infinigen) ;;
      infinigen-copy) flags=(--kv store --policy infinigen --kv-device-gather false) ;;
      infinigen-dense-fetched) flags=(--kv store --policy infinigen --kv-resident-layers 0) ;;
      infinigen-noreuse) flags=(--kv store --policy infinigen --kv-row-reuse false) ;;
      infinigen-hostplan) flags=(--kv store --policy infinigen --kv-device-plan false) ;;
      full) flags=(--kv store --policy full) ;;
      full-copy) flags=(--kv store --policy full --kv-device-gather false) ;;
      resident) flags=(--kv resident --policy full) ;;
      *) echo "unknown mode $mode" >&2; exit 2 ;;
    esac
    out=$(timeout "$limit" env ${run_env[@]+"${run_env[@]}"} "$BIN/worker_bench" --random "$CONFIG" --device "$DEVICE" \
      --streams "$batch" --prompt-tokens "$ctx" --new-tokens "$((NEW + batch - 1))" --prefill-budget "$ctx" \
      --kv-capacity-mb "$kv_mb" --label "$mode" "${flags[@]}" 2>&1)
    rc=$?
    row=$(grep '^|' <<< "$out" | tail -1)
    prof=$(grep '^profile |' <<< "$out" | tail -1)
    ttft=$(grep '^ttft |' <<< "$out" | tail -1)
    [ -n "$ttft" ] && ttfts+=("| $ctx ${ttft#ttft }")
    link=$(grep '^link |' <<< "$out" | tail -1)
    [ -n "$link" ] && links+=("| $ctx ${link#link }")
    if [ -n "$prof" ]; then
      profiles+=("| $ctx ${prof#profile }")
      # as it comes too, so that a run cut short keeps what it measured
      [ -n "${PROFILE_OUT:-}" ] && echo "| $ctx ${prof#profile }" >> "$PROFILE_OUT"
    fi
    if [ -z "$row" ]; then
      echo "| $ctx | $batch | $mode | failed (rc $rc): $(tail -1 <<< "$out" | tr '|' '/') | | | |"
      continue
    fi
    # "| label | streams | tok/s | p50 | p99 | errors |" -> with the context in front
    echo "| $ctx | ${row#| }" | sed "s/| $mode | $batch |/| $batch | $mode |/"
  done
done
echo
echo "Decode steps' host time per step (ms) and backend calls per layer (syncs, copies) or step (allocations):"
echo "| context | mode | batch | steps | their mean batch | step | speculate | preselect | prefetch | append | select | fetch | of which transport wait | attend | rest (layers) | syncs/layer | to host/layer | to device/layer | allocs/step |"
echo "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
for p in "${profiles[@]}"; do echo "$p"; done
echo
echo "Time to first token (s), every stream submitted at once (the last waits for all prefills):"
echo "| context | mode | batch | TTFT p50 | TTFT max |"
echo "|---:|---|---:|---:|---:|"
for t in "${ttfts[@]}"; do echo "$t"; done
echo
echo "KV bytes per generated token (MiB): moved over the link, read where the GPU kept them (row reuse):"
echo "| context | mode | batch | moved | kept | kept fraction |"
echo "|---:|---|---:|---:|---:|---:|"
for l in "${links[@]+"${links[@]}"}"; do echo "$l"; done
