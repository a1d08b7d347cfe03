#!/usr/bin/env bash
# The test command: installs what is missing, builds everything, runs every test (CTest labels:
# unit, integration, slow; gpu tests skip without a GPU). Extra arguments go to ctest, e.g.
# `scripts/test.sh -L unit`.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh >/dev/null
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build build
ctest --test-dir build --output-on-failure --timeout 900 -j "$(nproc)" "$@"
