#!/usr/bin/env python3
"""The tables of docs/accuracy.md from the JSON files scripts/eval/accuracy.sh writes.

usage: scripts/eval/accuracy_report.py OUT_DIR   (standard library only)

Ratios are against the `full` row of the same corpus and context. Columns a run did not
measure (greedy agreement, passkey) print as "-".
"""
import json
import os
import sys

# Which runs generated greedy continuations (accuracy.sh passes --generate-tokens to these).
GREEDY_RUNS = {"wiki2k_baselines", "wiki2k_infinigen_paper", "wiki2k_infinigen_tuned",
               "wiki2k_infinigen_overall20"}


def load(out, name):
    path = os.path.join(out, name + ".json")
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def rows(out, name):
    doc = load(out, name)
    return [] if doc is None else [(name, r) for r in doc["results"]]


def full_ppl(out, baseline):
    for _, r in rows(out, baseline):
        if r["policy"] == "full":
            return r["perplexity"]
    return None


def label(name, r):
    if r["policy"] != "infinigen":
        return r["policy"]
    if "paper" in name:
        return "infinigen, paper defaults (r 0.2, sum, α 5)"
    return "infinigen, ours (26 ch., product, α 10)"


def table(out, names, baseline, greedy=False, passkey=False):
    full = full_ppl(out, baseline)
    head = ["policy", "budget", "perplexity", "vs full", "KV read, sparse layers",
            "KV read, all layers", "attention-mass recall"]
    if greedy:
        head += ["greedy agreement (128)", "identical prefix"]
    if passkey:
        head += ["passkey"]
    print("| " + " | ".join(head) + " |")
    print("|" + "|".join(["---"] + ["---:"] * (len(head) - 1)) + "|")
    all_rows = [x for n in names for x in rows(out, n)]
    order = {"full": 0, "window": 1, "h2o": 2, "oracle": 3, "infinigen": 4}
    all_rows.sort(key=lambda nr: (order[nr[1]["policy"]], "paper" not in nr[0],
                                  nr[1]["budget"]))
    for name, r in all_rows:
        cells = [label(name, r), "-" if r["policy"] == "full" else "%.2f" % r["budget"],
                 "%.3f" % r["perplexity"],
                 "%.3fx" % (r["perplexity"] / full) if full else "-",
                 "%.3f" % r["kv_read_fraction_sparse_layers"], "%.3f" % r["kv_read_fraction"],
                 "%.3f" % r["attention_mass_recall"]]
        if greedy:
            g = name in GREEDY_RUNS
            cells += ["%.3f" % r["greedy_agreement"] if g else "-",
                      str(r["greedy_identical_prefix"]) if g else "-"]
        if passkey:
            cells += ["%d/%d" % (r["passkey_found"], r["passkey_total"])
                      if r["passkey_total"] else "-"]
        print("| " + " | ".join(cells) + " |")
    print()


def ablation(out, entries, baseline):
    full = full_ppl(out, baseline)
    print("| setting | perplexity | vs full | KV read, sparse layers | KV read, all layers | "
          "attention-mass recall |")
    print("|---|---:|---:|---:|---:|---:|")
    for text, name in entries:
        for _, r in rows(out, name):
            if abs(r["budget"] - 0.2) > 1e-9:
                continue
            print("| %s | %.3f | %.3fx | %.3f | %.3f | %.3f |" % (
                text, r["perplexity"], r["perplexity"] / full,
                r["kv_read_fraction_sparse_layers"], r["kv_read_fraction"],
                r["attention_mass_recall"]))
    print()


def alpha_sweep(out, baseline):
    full = full_ppl(out, baseline)
    print("| α | perplexity | vs full | KV read, sparse layers | attention-mass recall |")
    print("|---:|---:|---:|---:|---:|")
    for _, r in rows(out, "wiki2k_alpha_sweep"):
        print("| %g | %.3f | %.3fx | %.3f | %.3f |" % (
            r["alpha"], r["perplexity"], r["perplexity"] / full,
            r["kv_read_fraction_sparse_layers"], r["attention_mass_recall"]))
    print()


def main():
    out = sys.argv[1] if len(sys.argv) > 1 else "build/accuracy"
    print("### WikiText-2 test, 2K context\n")
    table(out, ["wiki2k_baselines", "wiki2k_infinigen_paper", "wiki2k_infinigen_tuned",
                "wiki2k_infinigen_overall20"], "wiki2k_baselines", greedy=True)
    for ctx in (2048, 4096, 8192):
        if load(out, "book%d_baselines" % ctx) is None:
            continue
        print("### Persuasion (Jane Austen), %dK context\n" % (ctx // 1024))
        table(out, ["book%d_baselines" % ctx, "book%d_infinigen" % ctx],
              "book%d_baselines" % ctx, passkey=True)
    print("### Ablations (WikiText-2, 2K, budget 0.20, α 10)\n")
    ablation(out, [
        ("r 0.2 (13 channels), sum rule, skewed (the paper's partial setup)",
         "wiki2k_ablation_paper"),
        ("r 0.2, sum rule, not skewed", "wiki2k_ablation_noskew"),
        ("r 0.4 (26 channels), sum rule, skewed", "wiki2k_ablation_tuned_sum"),
        ("r 0.4, product rule, skewed (ours)", "wiki2k_infinigen_tuned"),
        ("r 0.4, product rule, not skewed", "wiki2k_ablation_tuned_noskew"),
        ("ours, speculation from layer i's own norm output", "wiki2k_speculation_this"),
        ("ours, speculation from the true query (upper bound)", "wiki2k_speculation_actual"),
        ("ours, 1 dense layer", "wiki2k_dense_layers_1"),
        ("ours, 4 dense layers", "wiki2k_dense_layers_4"),
    ], "wiki2k_baselines")
    print("### α sweep (WikiText-2, 2K, no budget cap: α alone decides)\n")
    alpha_sweep(out, "wiki2k_baselines")


if __name__ == "__main__":
    main()
