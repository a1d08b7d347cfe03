#!/usr/bin/env python3
"""WikiText-2 perplexity of each CPU weight format next to transformers on the same GGUF.

transformers loads the GGUF (it dequantizes every tensor with the `gguf` package) and scores the
first N WikiText-2 test tokens as one window: mean NLL of tokens 1..N-1, no BOS, the method of
tests/fixtures/smollm2/reference.json. Our side is `infinigen eval --policies full --context N
--eval-tokens N-1`: the same window and the same scored tokens, decoded one token at a time
through the served decode path, once per `--cpu-weights` format. Prints a markdown table.

Needs torch, transformers and gguf (PyPI), e.g. in a venv:
  python3 -m venv ~/.cache/infinigen/hf-venv
  ~/.cache/infinigen/hf-venv/bin/pip install torch transformers gguf sentencepiece

usage: scripts/bench/perplexity_vs_transformers.py --model GGUF [--formats f32,q8,q4_1]
       [--tokens 4096] [--threads 2]
"""
import argparse
import json
import math
import os
import platform
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def transformers_perplexity(gguf_path, text, n):
    import gguf
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = os.path.split(os.path.abspath(gguf_path))
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32,
                                                 attn_implementation="eager").eval()
    # A GGUF without output.weight ties the output to the embedding (transformers 4.46 does not).
    names = {t.name for t in gguf.GGUFReader(gguf_path).tensors}
    if "output.weight" not in names:
        model.lm_head.weight = model.model.embed_tokens.weight
    ids = tok(text[:40000], add_special_tokens=False).input_ids[:n]
    assert len(ids) == n, len(ids)
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0]
        nll = torch.nn.functional.cross_entropy(logits[:-1], torch.tensor(ids[1:]))
    return float(torch.exp(nll)), ids


def our_perplexity(binary, gguf_path, corpus, fmt, n, threads):
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        subprocess.run([binary, "eval", "--model", gguf_path, "--corpus", corpus,
                        "--policies", "full", "--context", str(n), "--eval-tokens", str(n - 1),
                        "--no-recall", "--cpu-weights", fmt, "--threads", str(threads),
                        "--json", out.name], check=True, stdout=subprocess.DEVNULL)
        rows = json.load(open(out.name))
    rows = rows["results"] if isinstance(rows, dict) else rows
    return rows[0]["perplexity"]


def cpu_model():
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.machine()


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="GGUF file")
    ap.add_argument("--formats", default="f32,q8,q4_1", help="our --cpu-weights to run")
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--corpus", default=os.path.join(os.path.dirname(ROOT), "shared", "testdata",
                                                     "corpora", "wikitext-2", "test.txt"))
    ap.add_argument("--infinigen", default=os.path.join(ROOT, "build", "bin", "infinigen"))
    args = ap.parse_args()
    import torch
    torch.set_num_threads(args.threads)
    with open(args.corpus, encoding="utf-8") as f:
        text = f.read()
    ref, _ = transformers_perplexity(args.model, text, args.tokens)
    print(f"model {os.path.basename(args.model)}, first {args.tokens} WikiText-2 test tokens, "
          f"{cpu_model()}, {args.threads} threads")
    print("| engine | perplexity | vs transformers |")
    print("|---|---:|---:|")
    print(f"| transformers (gguf dequantized, float32) | {ref:.4f} | 1.0000x |")
    for fmt in args.formats.split(","):
        ppl = our_perplexity(args.infinigen, args.model, args.corpus, fmt, args.tokens,
                             args.threads)
        print(f"| infinigen {fmt} | {ppl:.4f} | {ppl / ref:.4f}x |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
