#!/usr/bin/env bash
# The test command: installs what is missing, builds everything, runs the bounded fuzz targets
# (scripts/fuzz.sh: tokenizers 60 s, the other parsers 30 s each), the concurrency-heavy suites
# under ASan + UBSan and under TSan (scripts/sanitize.sh) and then every test (CTest labels: unit, integration,
# slow; gpu tests skip without a GPU). Extra arguments go to ctest, e.g. `scripts/test.sh -L
# unit` (which also skips the fuzz and sanitizer runs).
set -euo pipefail
cd "$(dirname "$0")/.."
# Each stage says how long it took (CI has 90 minutes on 2 cores; on the slowest VM seen, an AMD
# EPYC, 2026-11-29: build 10, fuzz 6, address 20, thread 11, ctest 16; about 63 in all).
stage() {  # name, command...
  local name="$1" start=$SECONDS
  shift
  if ! "$@"; then
    echo "test.sh: $name FAILED after $((SECONDS - start)) s" >&2
    exit 1
  fi
  echo "test.sh: $name took $((SECONDS - start)) s" >&2
}
stage setup scripts/setup.sh >/dev/null
stage configure cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release >/dev/null
stage build cmake --build build
if [ "$#" -eq 0 ]; then
  stage fuzz scripts/fuzz.sh 60
  stage address scripts/sanitize.sh address
  stage thread scripts/sanitize.sh thread
fi
stage ctest ctest --test-dir build --output-on-failure --timeout 900 -j "$(nproc)" "$@"
