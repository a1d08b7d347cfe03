#!/usr/bin/env python3
"""Tokenizer encoding speed next to Hugging Face tokenizers, one core, same text, same run.

Runs build/bin/tokenizer_bench (ours) and Hugging Face `tokenizers` (PyPI) on WikiText-2's test
split with the Llama 3.1 tokenizer. HF is measured two ways: the whole text in one encode() call,
and encode_batch() over its lines (HF's faster path), both pinned to one thread
(RAYON_NUM_THREADS=1, TOKENIZERS_PARALLELISM=false). Prints a markdown table.

usage: scripts/bench/tokenizer_vs_hf.py [--python VENV_PYTHON] [--tokenizer PATH] [--text FILE]
Needs `tokenizers` importable by --python (default: python3).
"""
import argparse
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SHARED = os.path.join(ROOT, "..", "shared", "testdata")

HF_SNIPPET = r"""
import json, sys, time, tokenizers
t = tokenizers.Tokenizer.from_file(sys.argv[1])
text = open(sys.argv[2], encoding="utf-8").read()
lines = text.splitlines(keepends=True)
best_one = best_batch = 1e30
for _ in range(int(sys.argv[3])):
    t0 = time.perf_counter(); n = len(t.encode(text, add_special_tokens=False).ids)
    best_one = min(best_one, time.perf_counter() - t0)
    t0 = time.perf_counter(); t.encode_batch(lines, add_special_tokens=False)
    best_batch = min(best_batch, time.perf_counter() - t0)
b = len(text.encode("utf-8"))
print(json.dumps({"version": tokenizers.__version__, "tokens": n,
                  "mb_per_s_one_call": b / best_one / 1e6, "mb_per_s_batch": b / best_batch / 1e6}))
"""


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--python", default=sys.executable)
    ap.add_argument("--tokenizer", default=os.path.join(SHARED, "tokenizers", "llama3.1"))
    ap.add_argument("--text", default=os.path.join(SHARED, "corpora", "wikitext-2", "test.txt"))
    ap.add_argument("--repetitions", type=int, default=5)
    args = ap.parse_args()
    env = dict(os.environ, RAYON_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    tok_json = args.tokenizer
    if os.path.isdir(tok_json):
        tok_json = os.path.join(tok_json, "tokenizer.json")
    ours = json.loads(subprocess.check_output(
        ["taskset", "-c", "0", os.path.join(ROOT, "build", "bin", "tokenizer_bench"),
         args.tokenizer, args.text, str(args.repetitions)], text=True))
    hf = json.loads(subprocess.check_output(
        ["taskset", "-c", "0", args.python, "-c", HF_SNIPPET, tok_json, args.text,
         str(args.repetitions)], text=True, env=env))
    assert ours["tokens"] == hf["tokens"], (ours["tokens"], hf["tokens"])
    print(f"text: {os.path.basename(args.text)} ({ours['bytes']} bytes, {ours['tokens']} tokens), "
          f"tokenizer: {os.path.basename(os.path.normpath(args.tokenizer))}, one core, "
          f"{time.strftime('%Y-%m-%d')}")
    print()
    print("| engine | MB/s | ours vs it |")
    print("|---|---:|---:|")
    print(f"| infinigen | {ours['mb_per_s']:.2f} | 1.00x |")
    for key, label in (("mb_per_s_one_call", "one encode() call"),
                       ("mb_per_s_batch", "encode_batch() of lines")):
        print(f"| HF tokenizers {hf['version']}, {label} | {hf[key]:.2f} | "
              f"{ours['mb_per_s'] / hf[key]:.2f}x |")


if __name__ == "__main__":
    main()
