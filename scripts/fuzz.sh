#!/usr/bin/env bash
# Builds the tokenizer fuzz target with clang (libFuzzer + ASan + UBSan) into build-fuzz/ and
# runs it for a bounded time, seeded with the tokenizer fixture strings.
# usage: scripts/fuzz.sh [SECONDS (default 60)]
set -euo pipefail
cd "$(dirname "$0")/.."
SECONDS_LIMIT="${1:-60}"
CXX=clang++-14 cmake -S tests/fuzz -B build-fuzz -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null
cmake --build build-fuzz >/dev/null
mkdir -p build-fuzz/corpus
python3 - <<'PY'
import json, os
for name in os.listdir("tests/fixtures/tokenizers"):
    if not name.endswith(".jsonl") or name.startswith("chat"):
        continue
    for i, line in enumerate(open(os.path.join("tests/fixtures/tokenizers", name))):
        data = bytes.fromhex(json.loads(line)["text_hex"])[:4096]
        with open(f"build-fuzz/corpus/{name}-{i}", "wb") as f:
            f.write(data)
PY
INFINIGEN_TESTDATA="$(cd ../shared/testdata && pwd)" build-fuzz/tokenizer_fuzz \
  -max_total_time="$SECONDS_LIMIT" -max_len=4096 -timeout=10 -rss_limit_mb=4096 \
  -print_final_stats=1 build-fuzz/corpus 2>&1 | tail -n 12
echo "fuzz: ${SECONDS_LIMIT}s of tokenizer fuzzing found no crash"
