#!/usr/bin/env python3
"""n samples of one prompt through the product path: `infinigen serve` (all-in-one: router,
worker, KV store) over its OpenAI-compatible HTTP port. In interleaved rounds, the same prompt
as one request with n samples (one prefill, its KV copied in the store for the other samples)
and as n concurrent single requests with seeds seed .. seed + n - 1 (what a client does without
n, and what the HTTP door did before n reached the gRPC API). Reports the median wall time of
each to the last token, their ratio, and checks that both give the same texts.

Usage: scripts/bench/n_samples.py --bin build/bin/infinigen --model M.gguf
       [--n 4] [--prompt-words 700] [--max-tokens 16] [--rounds 5] [-- serve flags...]
Standard library only.
"""
import argparse
import statistics
import sys
import threading
import time

from serve_http import Serve, post


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--prompt-words", type=int, default=700)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("serve_flags", nargs="*")
    a = ap.parse_args()

    with Serve(a.bin, a.model, a.serve_flags, "n-samples-serve-") as http_port:
        words = ("the quick brown fox jumps over the lazy dog while the river runs to the sea "
                 "and the mountains keep their snow").split()
        prompt = " ".join(words[i % len(words)] for i in range(a.prompt_words))
        body = {"prompt": prompt, "max_tokens": a.max_tokens, "temperature": 0.8,
                "ignore_eos": True, "seed": 1234}
        usage = post(http_port, {**body, "max_tokens": 1})["usage"]  # warm-up

        def together():
            r = post(http_port, {**body, "n": a.n})
            return [c["text"] for c in sorted(r["choices"], key=lambda c: c["index"])], r["usage"]

        def apart():
            texts = [None] * a.n

            def one(i):
                texts[i] = post(http_port, {**body, "seed": body["seed"] + i})["choices"][0]["text"]

            threads = [threading.Thread(target=one, args=(i,)) for i in range(a.n)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            return texts

        times = {"n": [], "apart": []}
        for _ in range(a.rounds):
            t0 = time.perf_counter()
            shared, shared_usage = together()
            times["n"].append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            separate = apart()
            times["apart"].append(time.perf_counter() - t0)
            if shared != separate:
                sys.exit(f"n = {a.n} gave other texts than {a.n} single requests:\n"
                         f"{shared}\n{separate}")
        n_med, apart_med = statistics.median(times["n"]), statistics.median(times["apart"])
        print(f"prompt {usage['prompt_tokens']} tokens, {a.max_tokens} new tokens per sample, "
              f"{a.rounds} interleaved rounds; texts equal")
        print(f"| way | n | median s | rounds (s) |")
        print(f"|---|---:|---:|---|")
        print(f"| one request, n = {a.n} (shared prefill) | {a.n} | {n_med:.3f} | "
              f"{', '.join(f'{t:.2f}' for t in times['n'])} |")
        print(f"| {a.n} concurrent requests | {a.n} | {apart_med:.3f} | "
              f"{', '.join(f'{t:.2f}' for t in times['apart'])} |")
        print(f"shared prefill: {apart_med / n_med:.2f}x faster; completion tokens "
              f"{shared_usage['completion_tokens']}, cached prompt tokens reported "
              f"{shared_usage['prompt_tokens_details']['cached_tokens']} (choice 0's)")


if __name__ == "__main__":
    main()
