#!/usr/bin/env bash
# Builds the fuzz targets with clang (libFuzzer + ASan + UBSan, which aborts on any report) into
# build-fuzz/ and runs each for a bounded time: the tokenizers (seeded with the tokenizer fixture
# strings) for SECONDS; for SECONDS / 2 each the GGUF, safetensors (and sharded-index) and .npy
# readers (seeded with real files: the fixtures' shards, index and arrays, the head of the
# SmolLM2 GGUF, and a tiny GGUF written here), the KV store's request validation (programs of Open / Append / Gather / Close
# calls with arbitrary arguments) and the UCX gather request codec (a parse must re-encode to
# the same bytes), and the tokenizer file loaders (tokenizer.json, tokenizer.model, vocab.json +
# merges.txt; seeded with small tokenizers cut from the real ones) and chat template rendering of
# arbitrary conversations, the InfiniGen sidecar reader (seeded with valid sidecars written
# here), the public GenerateRequest as bytes through the router's checks, and the
# OpenAI-compatible API's request bodies and response JSON. The targets run side by side, one
# per core. Any crash, sanitizer report, leak or timeout fails the run.
# usage: scripts/fuzz.sh [SECONDS (default 60)]
set -euo pipefail
cd "$(dirname "$0")/.."
SECONDS_LIMIT="${1:-60}"
FILE_SECONDS=$(( (SECONDS_LIMIT + 1) / 2 ))
CXX=clang++-14 cmake -S tests/fuzz -B build-fuzz -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null
if ! cmake --build build-fuzz > build-fuzz/build.log 2>&1; then  # ninja writes errors to stdout
  grep -E -A12 '^FAILED|error:' build-fuzz/build.log | head -n 80
  echo "fuzz: building FAILED (log: build-fuzz/build.log)" >&2
  exit 1
fi
rm -rf build-fuzz/corpus build-fuzz/corpus-*
mkdir -p build-fuzz/corpus build-fuzz/corpus-gguf build-fuzz/corpus-safetensors build-fuzz/corpus-npy \
  build-fuzz/corpus-kv-store build-fuzz/corpus-gather-wire
python3 - <<'PY'
import json, os, struct
for name in os.listdir("tests/fixtures/tokenizers"):
    if not name.endswith(".jsonl") or name.startswith("chat"):
        continue
    for i, line in enumerate(open(os.path.join("tests/fixtures/tokenizers", name))):
        data = bytes.fromhex(json.loads(line)["text_hex"])[:4096]
        with open(f"build-fuzz/corpus/{name}-{i}", "wb") as f:
            f.write(data)

# A tiny valid GGUF v3: llama metadata and three tensors (F32, F16, Q8_0), 32-byte aligned.
def gguf_string(s):
    b = s.encode()
    return struct.pack("<Q", len(b)) + b
kv = [("general.architecture", 8, gguf_string("llama")),
      ("llama.block_count", 4, struct.pack("<I", 1)),
      ("llama.embedding_length", 4, struct.pack("<I", 32)),
      ("llama.attention.head_count", 4, struct.pack("<I", 4)),
      ("llama.context_length", 4, struct.pack("<I", 128)),
      ("llama.feed_forward_length", 4, struct.pack("<I", 64)),
      ("llama.attention.head_count_kv", 4, struct.pack("<I", 2)),
      ("llama.attention.layer_norm_rms_epsilon", 6, struct.pack("<f", 1e-5)),
      ("llama.rope.freq_base", 6, struct.pack("<f", 10000.0)),
      ("tokenizer.ggml.tokens", 9, struct.pack("<IQ", 8, 2) + gguf_string("a") + gguf_string("b"))]
tensors = [("token_embd.weight", [32, 2], 0, 2 * 32 * 4),   # ggml dims innermost first
           ("output_norm.weight", [32], 1, 32 * 2),
           ("blk.0.attn_q.weight", [32, 1], 8, 34)]
out = b"GGUF" + struct.pack("<IQQ", 3, len(tensors), len(kv))
for key, vtype, value in kv:
    out += gguf_string(key) + struct.pack("<I", vtype) + value
offset, data = 0, b""
for name, dims, ttype, nbytes in tensors:
    out += gguf_string(name) + struct.pack("<I", len(dims)) + b"".join(struct.pack("<Q", d) for d in dims)
    out += struct.pack("<IQ", ttype, offset)
    chunk = bytes((i * 7) % 251 for i in range(nbytes))
    pad = (-len(chunk)) % 32
    data += chunk + b"\0" * pad
    offset += nbytes + pad
out += b"\0" * ((-len(out)) % 32) + data
open("build-fuzz/corpus-gguf/tiny.gguf", "wb").write(out)
# One tensor of each block format (tests/fixtures/quants), K-quants included.
import glob, shutil
for path in sorted(glob.glob("tests/fixtures/quants/*.gguf")):
    shutil.copy(path, "build-fuzz/corpus-gguf/" + os.path.basename(path))

# A tiny safetensors file, and the fixtures' own shards and arrays.
header = json.dumps({"__metadata__": {"format": "pt"},
                     "a": {"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 24]},
                     "b": {"dtype": "BF16", "shape": [4], "data_offsets": [24, 32]}}).encode()
open("build-fuzz/corpus-safetensors/tiny.safetensors", "wb").write(
    struct.pack("<Q", len(header)) + header + bytes(range(32)))
import glob, shutil
for path in sorted(glob.glob("tests/fixtures/hf/*/*.safetensors")):
    if os.path.getsize(path) <= 65536:
        shutil.copy(path, "build-fuzz/corpus-safetensors/" + path.replace("/", "_"))
# Small tokenizers cut from the real ones (kind byte first, see tokenizer_files_fuzz.cc): the
# first 400 vocabulary entries of Llama 3.1 and Mistral with the merges among them, GPT-2's as
# vocab.json + NUL + merges.txt, and the head of Llama 2's tokenizer.model.
os.makedirs("build-fuzz/corpus-tokenizer-files", exist_ok=True)
root = os.environ.get("INFINIGEN_TESTDATA", "../shared/testdata") + "/tokenizers"
def cut_json(path, keep=400):
    tj = json.load(open(path))
    vocab = {t: i for t, i in tj["model"]["vocab"].items() if i < keep}
    merges = []
    for m in tj["model"].get("merges", [])[:20000]:
        a, b = m.split(" ", 1) if isinstance(m, str) else m
        if a in vocab and b in vocab and a + b in vocab:
            merges.append(m)
    tj["model"]["vocab"], tj["model"]["merges"] = vocab, merges[:300]
    tj["added_tokens"] = [dict(t, id=keep + k) for k, t in enumerate(tj.get("added_tokens", [])[:4])]
    tj["post_processor"] = None
    return json.dumps(tj).encode()
for name in ("llama3.1", "mistral-7b"):
    path = f"{root}/{name}/tokenizer.json"
    if os.path.exists(path):
        open(f"build-fuzz/corpus-tokenizer-files/{name}.json", "wb").write(b"\0" + cut_json(path))
if os.path.exists(f"{root}/gpt2/vocab.json"):
    vocab = {t: i for t, i in json.load(open(f"{root}/gpt2/vocab.json")).items() if i < 400}
    merges = [l for i, l in enumerate(open(f"{root}/gpt2/merges.txt").read().split("\n")[:3000])
              if (i == 0 and l.startswith("#version")) or
              (len(l.split(" ")) == 2 and all(x in vocab for x in l.split(" ")) and
               "".join(l.split(" ")) in vocab)]
    open("build-fuzz/corpus-tokenizer-files/gpt2", "wb").write(
        b"\2" + json.dumps(vocab).encode() + b"\0" + "\n".join(merges[:300]).encode())
if os.path.exists(f"{root}/llama2-spm/tokenizer.model"):
    open("build-fuzz/corpus-tokenizer-files/llama2.model", "wb").write(
        b"\1" + open(f"{root}/llama2-spm/tokenizer.model", "rb").read()[:60000])

# Conversations for the chat templates: a first line (tried as a Jinja template), then
# role / content pairs separated by NUL bytes.
os.makedirs("build-fuzz/corpus-chat", exist_ok=True)
for i, conv in enumerate([["user", "Hello!"],
                          ["system", "Be brief.", "user", "Hi", "assistant", "Hello.", "user", "Why?"],
                          ["user", " caf\u00e9 \u20ac ", "assistant", ""]]):
    with open(f"build-fuzz/corpus-chat/conversation-{i}", "wb") as f:
        f.write(b"{{ messages }}\n" + "\0".join(conv).encode())

# Valid UCX gather requests: u32 items, then per item u64 seq, i32 layer, i64 count, i64 n, n x i32.
def gather_item(seq, layer, count, slots):
    return struct.pack("<QiqQ", seq, layer, count, len(slots)) + struct.pack(f"<{len(slots)}i", *slots)
for i, items in enumerate([[], [(1, 0, 2, [0, 1, 2, 3])], [(7, 3, 0, []), (2, 1, 1, [5, 9])]]):
    with open(f"build-fuzz/corpus-gather-wire/request-{i}", "wb") as f:
        f.write(struct.pack("<I", len(items)) + b"".join(gather_item(*it) for it in items))
# Valid InfiniGen sidecars of sidecar_fuzz.cc's model (2 layers, 2 KV heads of 8 channels): a
# skewed one (4 channels) and a RoPE-pair one (channels 0, 1 and their partners 4, 5).
os.makedirs("build-fuzz/corpus-sidecar", exist_ok=True)
def sidecar(skewed, channels):
    meta = {"format": "infinigen-sidecar", "version": "1", "ratio": "0.5", "partial_dim": "4",
            "skewed": "true" if skewed else "false", "rope_pairs": "false" if skewed else "true",
            "channel_rule": "sum", "model_fingerprint": "fuzz-model", "calibration_hash": "0",
            "calibration_tokens": "96", "num_layers": "2", "num_kv_heads": "2", "head_dim": "8"}
    header, data = {"__metadata__": meta}, b""
    for l in range(2):
        skew = [1.0 if i == j else 0.0 for g in range(2) for i in range(8) for j in range(8)]
        for name, shape, values in ((f"layers.{l}.skew", [2, 8, 8], skew),
                                    (f"layers.{l}.channels", [2, 4], [float(c) for c in channels * 2])):
            blob = struct.pack(f"<{len(values)}f", *values)
            header[name] = {"dtype": "F32", "shape": shape,
                            "data_offsets": [len(data), len(data) + len(blob)]}
            data += blob
    h = json.dumps(header).encode()
    return struct.pack("<Q", len(h)) + h + data
open("build-fuzz/corpus-sidecar/skewed.safetensors", "wb").write(sidecar(True, [3, 0, 7, 5]))
open("build-fuzz/corpus-sidecar/rope-pairs.safetensors", "wb").write(sidecar(False, [0, 1, 4, 5]))
# Public GenerateRequests on the wire (generation.proto): text, token ids, chat messages (one
# with invalid UTF-8 in a content), with request ids, stopping and selection fields.
os.makedirs("build-fuzz/corpus-generate", exist_ok=True)
def varint(v):
    out = b""
    while True:
        b, v = v & 0x7F, v >> 7
        out += bytes([b | (0x80 if v else 0)])
        if not v:
            return out
def field(number, payload):  # length-delimited
    return varint(number << 3 | 2) + varint(len(payload)) + payload
def int_field(number, value):
    return varint(number << 3) + varint(value)
def chat(*pairs):
    return b"".join(field(1, field(1, r) + field(2, c)) for r, c in pairs)
stopping = field(6, int_field(1, 16) + field(2, varint(2) + varint(7)))
for i, req in enumerate([
        field(1, b"req-1") + field(2, "Hello, caf\u00e9".encode()) + stopping,
        field(3, field(1, b"".join(varint(t) for t in (1, 15043, 29892, 3186)))),
        field(4, chat((b"system", b"Be brief."), (b"user", b"Hi")))
        + field(7, field(1, b"infinigen")) + field(10, b"session-9"),
        field(4, chat((b"user", b"bad \xff\xfe bytes")))]):
    open(f"build-fuzz/corpus-generate/request-{i}", "wb").write(req)
for path in sorted(glob.glob("tests/fixtures/*/*.npy") + glob.glob("tests/fixtures/hf/*/*.npy")):
    if os.path.getsize(path) <= 65536:
        shutil.copy(path, "build-fuzz/corpus-npy/" + path.replace("/", "_"))
PY
# The head of the real SmolLM2 GGUF (its metadata and tensor table), when setup.sh fetched it.
SMOLLM2="${INFINIGEN_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/infinigen}/models/SmolLM2-135M-Instruct.Q4_1.gguf"
[[ -f "$SMOLLM2" ]] && head -c 65536 "$SMOLLM2" > build-fuzz/corpus-gguf/smollm2-head.gguf

run() {  # target, seconds, corpus, extra flags...
  local target="$1" seconds="$2" corpus="$3"
  shift 3
  if ! "build-fuzz/$target" -max_total_time="$seconds" -timeout=10 -rss_limit_mb=4096 \
      -print_final_stats=1 "$@" "$corpus" > "build-fuzz/$target.log" 2>&1; then
    tail -n 60 "build-fuzz/$target.log"
    echo "fuzz: $target FAILED (log: build-fuzz/$target.log)" >&2
    return 1
  fi
  echo "fuzz: $target: $(grep -o 'stat::number_of_executed_units: *[0-9]*' "build-fuzz/$target.log" |
    grep -o '[0-9]*$') executions in ${seconds}s, no crash"
}
# The targets run side by side, one per core (each fuzzer is one process on one core).
pids=()
spawn() {  # as run, in the background once fewer than nproc are running
  while (( $(jobs -rp | wc -l) >= $(nproc) )); do sleep 1; done
  run "$@" &
  pids+=("$!")
}
INFINIGEN_TESTDATA="$(cd ../shared/testdata && pwd)" spawn tokenizer_fuzz "$SECONDS_LIMIT" \
  build-fuzz/corpus -max_len=4096
spawn gguf_fuzz "$FILE_SECONDS" build-fuzz/corpus-gguf -max_len=65536
spawn safetensors_fuzz "$FILE_SECONDS" build-fuzz/corpus-safetensors -max_len=65536
# A sharded checkpoint's index: the fixtures' real one and small variants.
mkdir -p build-fuzz/corpus-safetensors-index
cp tests/fixtures/hf/llama2_mha/model.safetensors.index.json build-fuzz/corpus-safetensors-index/real.json
printf '{"metadata":{"total_size":8},"weight_map":{"a":"m-1.safetensors","b":"m-2.safetensors"}}' \
  > build-fuzz/corpus-safetensors-index/two.json
printf '{"weight_map":{"a":"../x","b":3,"c":"","d":"m\\u0000/y"}}' \
  > build-fuzz/corpus-safetensors-index/bad.json
spawn safetensors_index_fuzz "$FILE_SECONDS" build-fuzz/corpus-safetensors-index -max_len=65536
spawn npy_fuzz "$FILE_SECONDS" build-fuzz/corpus-npy -max_len=4096
spawn kv_store_fuzz "$FILE_SECONDS" build-fuzz/corpus-kv-store -max_len=4096
spawn gather_wire_fuzz "$FILE_SECONDS" build-fuzz/corpus-gather-wire -max_len=4096
spawn sidecar_fuzz "$FILE_SECONDS" build-fuzz/corpus-sidecar -max_len=8192
spawn generate_request_fuzz "$FILE_SECONDS" build-fuzz/corpus-generate -max_len=4096
INFINIGEN_TESTDATA="$(cd ../shared/testdata && pwd)" spawn tokenizer_files_fuzz "$FILE_SECONDS" \
  build-fuzz/corpus-tokenizer-files -max_len=65536
spawn chat_template_fuzz "$FILE_SECONDS" build-fuzz/corpus-chat -max_len=4096
# The OpenAI-compatible API's bodies: seeded with requests as clients send them (endpoint byte
# first), with the API's field names as a dictionary.
mkdir -p build-fuzz/corpus-openai
printf '\x00{"model":"m","prompt":"Hi","max_tokens":5,"logprobs":2,"stop":["a"],"logit_bias":{"5":1.5},"stream":true,"stream_options":{"include_usage":true}}' \
  > build-fuzz/corpus-openai/completion
printf '\x00{"prompt":[[1,2,3]],"seed":-5,"temperature":0.5,"top_k":4,"min_tokens":2,"ignore_eos":true}' \
  > build-fuzz/corpus-openai/ids
printf '\x01{"messages":[{"role":"developer","content":[{"type":"text","text":"x"}]},{"role":"user","content":"y"}],"logprobs":true,"top_logprobs":3,"max_completion_tokens":9,"n":1}' \
  > build-fuzz/corpus-openai/chat
printf '\x02{"tokens":[1,2,3],"model":"m"}' > build-fuzz/corpus-openai/detokenize
printf '\x00{"prompt":"Hi","return_token_strs":true,"add_special_tokens":false}' \
  > build-fuzz/corpus-openai/tokenize
spawn openai_request_fuzz "$FILE_SECONDS" build-fuzz/corpus-openai -max_len=4096 \
  -dict=tests/fuzz/openai.dict
failed=0
for pid in "${pids[@]}"; do
  wait "$pid" || failed=1
done
exit "$failed"
