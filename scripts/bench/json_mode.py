#!/usr/bin/env python3
"""What OpenAI's JSON mode costs a token, through the product path: `infinigen serve`
(all-in-one) over its OpenAI-compatible HTTP port. In interleaved rounds, one streamed chat
completion asking for a JSON list, with `response_format: {"type": "json_object"}` (the worker
masks every token) and without (`ignore_eos`, the same number of tokens); each round's time per
output token is the gap from the first token to the last over the tokens between. Reports the
median of each and their ratio, and checks that every JSON answer is one whole object.

Usage: scripts/bench/json_mode.py --bin build/bin/infinigen --model M.gguf [--rounds 5]
       [--max-tokens 200] [-- serve flags...]
Standard library only.
"""
import argparse
import json
import statistics
import time
import urllib.request

from serve_http import Serve


def stream(port, body):
    """(seconds per output token after the first, tokens, text, finish reason)"""
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions",
                                 data=json.dumps({**body, "stream": True,
                                                  "stream_options": {"include_usage": True}})
                                 .encode(), headers={"Content-Type": "application/json"})
    first = last = None
    text, finish, tokens = "", None, 0
    with urllib.request.urlopen(req, timeout=600) as r:
        for line in r:
            line = line.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            for c in chunk["choices"]:
                if c["delta"].get("content"):
                    now = time.perf_counter()
                    first = first or now
                    last = now
                    text += c["delta"]["content"]
                finish = c.get("finish_reason") or finish
    return (last - first) / max(tokens - 1, 1), tokens, text, finish


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--max-tokens", type=int, default=200)
    ap.add_argument("serve_flags", nargs="*")
    a = ap.parse_args()
    messages = [{"role": "user", "content": "Write a JSON object with a field animals: a list of "
                 "40 animals, each with name, legs and habitat."}]
    body = {"messages": messages, "max_tokens": a.max_tokens, "temperature": 0}
    with Serve(a.bin, a.model, a.serve_flags, "json-mode-serve-") as port:
        stream(port, body)  # warm-up (and the vocabulary's bytes, read once)
        stream(port, {**body, "response_format": {"type": "json_object"}})
        tpot = {"json": [], "text": []}
        tokens = {}
        for _ in range(a.rounds):
            s, n, text, finish = stream(port, {**body,
                                               "response_format": {"type": "json_object"}})
            if finish != "stop" or not isinstance(json.loads(text), dict):
                raise SystemExit(f"JSON mode did not answer one whole object ({finish}): "
                                 f"{text!r}")
            tpot["json"].append(s)
            tokens["json"] = n
            s, n, _, _ = stream(port, {**body, "max_tokens": n, "ignore_eos": True})
            tpot["text"].append(s)
            tokens["text"] = n
        print(f"{a.rounds} interleaved rounds, greedy; every JSON answer a whole object")
        print("| response_format | output tokens | TPOT p50 (ms) | rounds (ms) |")
        print("|---|---:|---:|---|")
        for key, label in (("text", "text"), ("json", "json_object")):
            print(f"| {label} | {tokens[key]} | {1e3 * statistics.median(tpot[key]):.2f} | "
                  f"{', '.join(f'{1e3 * t:.2f}' for t in tpot[key])} |")
        print(f"json_object / text: "
              f"{statistics.median(tpot['json']) / statistics.median(tpot['text']):.3f}x")


if __name__ == "__main__":
    main()
