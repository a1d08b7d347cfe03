#!/usr/bin/env python3
"""The outside peer of the served decode path (scripts/gpu/served_decode.sh, worker_bench):
Hugging Face transformers `generate` at the same Llama-3.1-8B shape (random bf16 weights from the config: no weights can be downloaded), all K/V on
the GPU (transformers' default cache), sdpa attention. Decode tokens/s = batch x new tokens /
(time of generate(1 + new) - time of generate(1)), i.e. without the prefill.

  python3 scripts/gpu/hf_peer.py [--layers 32] [--shapes 8192x1,8192x8,32768x1] [--new 16]
"""
import argparse
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--shapes", default="8192x1,8192x8,32768x1")
    ap.add_argument("--new", type=int, default=16)
    args = ap.parse_args()
    cfg = LlamaConfig(
        hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
        num_hidden_layers=args.layers, vocab_size=128256, max_position_embeddings=131072,
        rope_theta=500000.0,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
        attn_implementation="sdpa")
    torch.set_default_dtype(torch.bfloat16)
    with torch.device("cuda"):
        model = LlamaForCausalLM(cfg)
    model.eval()
    rows = []
    for shape in args.shapes.split(","):
        ctx, batch = (int(x) for x in shape.split("x"))
        ids = torch.randint(0, cfg.vocab_size, (batch, ctx), device="cuda")
        mask = torch.ones_like(ids)

        def run(new):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            with torch.no_grad():
                model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new,
                               min_new_tokens=new, do_sample=False, pad_token_id=0)
            torch.cuda.synchronize()
            return time.perf_counter() - t0

        try:
            run(2)  # warm-up
            prefill = min(run(1) for _ in range(2))
            total = run(1 + args.new)
            tps = batch * args.new / (total - prefill)
            rows.append(f"| {ctx} | {batch} | transformers {__import__('transformers').__version__} "
                        f"generate | {1000 * (total - prefill) / args.new:.1f} | {tps:.1f} |")
        except torch.cuda.OutOfMemoryError:
            rows.append(f"| {ctx} | {batch} | transformers generate | out of GPU memory | - |")
        del ids, mask
        torch.cuda.empty_cache()
        print(rows[-1], flush=True)
    print(f"\nHugging Face peer, {args.layers} layers, {torch.cuda.get_device_name()}:")
    print("| context | batch | system | step ms | tokens/s |\n|---|---|---|---|---|")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
