#!/usr/bin/env bash
# The concurrency-heavy suites under AddressSanitizer + UndefinedBehaviorSanitizer (a separate
# build, build-asan/: g++ -fsanitize=address,undefined, no CUDA, no benchmarks): the batch engine,
# the store cache over the KV store, the KV transports (in-process, gRPC, shm, UCX) and the HTTP
# front door against a sanitized `infinigen serve` (its processes are sanitized too). Any report
# (a memory error, undefined behavior, a leak at exit) fails the run. ~13 minutes to build on 2
# cores, a minute to run.
# usage: scripts/sanitize.sh
set -euo pipefail
cd "$(dirname "$0")/.."
TARGETS=(batch_engine_test store_kv_cache_test kv_transport_test openai_http_test)
cmake -S . -B build-asan -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DINFINIGEN_SANITIZE=ON \
  -DINFINIGEN_WITH_CUDA=OFF -DINFINIGEN_BUILD_BENCHMARKS=OFF >/dev/null
cmake --build build-asan --target "${TARGETS[@]}" infinigen >/dev/null
export ASAN_OPTIONS=detect_leaks=1:halt_on_error=1
export UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1
for t in "${TARGETS[@]}"; do
  if ! build-asan/bin/"$t" --gtest_brief=1 > "build-asan/$t.log" 2>&1; then
    tail -n 60 "build-asan/$t.log"
    echo "sanitize: $t FAILED (log: build-asan/$t.log)" >&2
    exit 1
  fi
  echo "sanitize: $t: $(grep -o '[0-9]* tests\?' "build-asan/$t.log" | tail -1) passed, no report"
done
