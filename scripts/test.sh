#!/usr/bin/env bash
# The test command: installs what is missing, builds everything, runs the bounded fuzz targets
# (scripts/fuzz.sh: tokenizers 60 s, the other parsers 30 s each), the concurrency-heavy suites
# under ASan + UBSan and under TSan (scripts/sanitize.sh) and then every test (CTest labels: unit, integration,
# slow; gpu tests skip without a GPU). Extra arguments go to ctest, e.g. `scripts/test.sh -L
# unit` (which also skips the fuzz and sanitizer runs).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh >/dev/null
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build build
if [ "$#" -eq 0 ]; then
  scripts/fuzz.sh 60
  scripts/sanitize.sh
fi
ctest --test-dir build --output-on-failure --timeout 900 -j "$(nproc)" "$@"
