#!/usr/bin/env python3
"""A batch of prompts through the product path: `infinigen serve` (all-in-one: router, worker,
KV store) over its OpenAI-compatible HTTP port, as lm-eval-harness sends them: scored as its
loglikelihood does (`echo: true, max_tokens: 0, logprobs: 1`: each prompt token's logprob, no
token generated), or with --max-tokens N greedy tokens generated (its generate_until). In
interleaved rounds, the same P passages of wikitext-2 as one request per prompt in turn
(lm-eval's batch size 1) and as one request listing all P (batch size P; the server runs its
prompts at once). Reports the median wall time of each, their ratio, and checks that both give
the same logprobs, bit for bit.

Usage: scripts/bench/prompt_batch.py --bin build/bin/infinigen --model M.gguf
       --text ../shared/testdata/corpora/wikitext-2/test.txt
       [--prompts 16] [--prompt-words 150] [--max-tokens 0] [--rounds 3] [-- serve flags...]
Standard library only.
"""
import argparse
import statistics
import time

from serve_http import Serve, post


def passages(path, count, words):
    text = open(path, encoding="utf-8").read().split()
    return [" ".join(text[i * words:(i + 1) * words]) for i in range(count)]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--text", required=True)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--prompt-words", type=int, default=150)
    ap.add_argument("--max-tokens", type=int, default=0)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("serve_flags", nargs="*")
    a = ap.parse_args()
    prompts = passages(a.text, a.prompts, a.prompt_words)
    score = {"max_tokens": a.max_tokens, "echo": a.max_tokens == 0, "logprobs": 1,
             "temperature": 0, "ignore_eos": True}

    with Serve(a.bin, a.model, a.serve_flags, "prompt-batch-serve-") as port:
        post(port, {**score, "prompt": prompts[0]})  # warm-up

        def one_by_one():
            return [post(port, {**score, "prompt": p})["choices"][0] for p in prompts]

        def batched():
            r = post(port, {**score, "prompt": prompts})
            return sorted(r["choices"], key=lambda c: c["index"]), r["usage"]

        times = {"one": [], "batch": []}
        for _ in range(a.rounds):
            t0 = time.perf_counter()
            alone = one_by_one()
            times["one"].append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            together, usage = batched()
            times["batch"].append(time.perf_counter() - t0)
            for i, (x, y) in enumerate(zip(alone, together)):
                if x["logprobs"]["token_logprobs"] != y["logprobs"]["token_logprobs"]:
                    raise SystemExit(f"prompt {i}: the batch scored it otherwise than alone")
        one, batch = statistics.median(times["one"]), statistics.median(times["batch"])
        print(f"{a.prompts} prompts, {usage['prompt_tokens']} prompt tokens in all, "
              f"{a.max_tokens} generated each, {a.rounds} interleaved rounds; every logprob "
              "equal, bit for bit")
        print("| way | median s | (prompt + generated) tokens/s | rounds (s) |")
        print("|---|---:|---:|---|")
        for label, key, med in (("one request per prompt, in turn", "one", one),
                                (f"one request of {a.prompts} prompts", "batch", batch)):
            print(f"| {label} | {med:.3f} | {usage['total_tokens'] / med:.0f} | "
                  f"{', '.join(f'{t:.2f}' for t in times[key])} |")
        print(f"batch: {one / batch:.2f}x faster")


if __name__ == "__main__":
    main()
