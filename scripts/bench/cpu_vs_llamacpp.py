#!/usr/bin/env python3
"""CPU throughput of the engine next to llama.cpp on the same GGUF, in one run.

Builds llama.cpp's llama-bench outside the repository (source: the llama.cpp tree vendored in
the PyPI sdist of llama-cpp-python, fetched with pip into the cache; nothing is committed),
then alternates llama-bench and `infinigen bench` runs with the same thread count and test
shapes (pp = prefill of N random tokens, tg = N single-token decode steps, both from an empty
cache, or after --depth tokens already in it: llama-bench's -d) and prints a markdown table with
the ratios. Our K/V storage is --kv (default bf16, serve's default: the bytes of llama.cpp's
default f16 cache); llama.cpp runs with --flash-attn (default 0: on this 2-core Xeon its
non-flash path is the faster one at depth 8000, 2026-12-07). Peak RSS is each process's
maximum resident set size as the kernel reports it (wait4 rusage).

usage: scripts/bench/cpu_vs_llamacpp.py [--model GGUF] [--threads 2] [--rounds 3]
       [--peer 0.3.36] [--formats f32,bf16,q8,q4_1] [--pp 512] [--tg 128] [--depth 0]
       [--kv bf16] [--flash-attn 0] [--repetitions 3]

A peer built by an earlier version of this script (with AMX) stays in the cache: delete its
folder under ~/.cache/infinigen/peers to rebuild it.
"""
import argparse
import json
import os
import platform
import subprocess
import sys
import tarfile
import time

# The peer: the llama.cpp tree vendored in this llama-cpp-python sdist (--peer picks another;
# 0.3.16 vendors llama.cpp build 4227c9b).
LLAMA_CPP_PYTHON = "0.3.36"
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def cache_dir():
    base = os.environ.get("INFINIGEN_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "infinigen")
    return base


def run_with_rss(cmd):
    pid = os.fork()
    if pid == 0:
        fd = os.open(os.devnull, os.O_WRONLY)
        out_path = f"/tmp/infinigen_bench_{os.getpid()}.out"
        out = os.open(out_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(out, 1)
        os.dup2(fd, 2)
        try:
            os.execv(cmd[0], cmd)
        finally:
            os._exit(127)
    _, status, usage = os.wait4(pid, 0)
    out_path = f"/tmp/infinigen_bench_{pid}.out"
    with open(out_path) as f:
        out = f.read()
    os.remove(out_path)
    if os.waitstatus_to_exitcode(status) != 0:
        sys.exit(f"{' '.join(cmd)} failed with status {status}")
    return out, usage.ru_maxrss / 1024.0


def build_llama_cpp(version):
    root = os.path.join(cache_dir(), "peers", f"llama-cpp-python-{version}")
    binary = os.path.join(root, "vendor", "llama.cpp", "build", "bin", "llama-bench")
    if os.path.exists(binary):
        return binary
    os.makedirs(os.path.dirname(root), exist_ok=True)
    pip = os.path.join(cache_dir(), "venv", "bin", "pip")
    if not os.path.exists(pip):
        subprocess.check_call([sys.executable, "-m", "venv", os.path.join(cache_dir(), "venv")])
    dl = os.path.join(cache_dir(), "peers", "downloads")
    subprocess.check_call([pip, "download", "--quiet", "--no-deps", "--no-binary", ":all:",
                           "-d", dl, f"llama-cpp-python=={version}"])
    with tarfile.open(os.path.join(dl, f"llama_cpp_python-{version}.tar.gz")) as t:
        t.extractall(os.path.dirname(root))
    os.rename(os.path.join(os.path.dirname(root), f"llama_cpp_python-{version}"), root)
    src = os.path.join(root, "vendor", "llama.cpp")
    # Native, but without AMX: -march=native turns on llama.cpp's AMX kernels where the CPU
    # lists AMX, and on the project's Xeon VM their first ldtilecfg dies with SIGILL (the guest
    # may not use the tiles), so a user there builds without them too.
    no_amx = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
    subprocess.check_call(["cmake", "-S", src, "-B", os.path.join(src, "build"), "-G", "Ninja",
                           "-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON", "-DLLAMA_CURL=OFF",
                           "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_SERVER=OFF",
                           f"-DCMAKE_C_FLAGS={no_amx}", f"-DCMAKE_CXX_FLAGS={no_amx}"],
                          stdout=subprocess.DEVNULL)
    subprocess.check_call(["ninja", "-C", os.path.join(src, "build"), "llama-bench"],
                          stdout=subprocess.DEVNULL)
    return binary


def llama_bench(binary, model, threads, pp, tg, depth, flash_attn, reps):
    out, rss = run_with_rss([binary, "-m", model, "-t", str(threads), "-p", str(pp), "-n",
                             str(tg), "-d", str(depth), "-fa", str(flash_attn), "-r", str(reps),
                             "-o", "json"])
    rows = json.loads(out)
    result = {"peak_rss_mib": rss, "prefill_tokens_per_s": 0.0, "decode_tokens_per_s": 0.0}
    for r in rows:
        key = "prefill_tokens_per_s" if r["n_prompt"] > 0 else "decode_tokens_per_s"
        result[key] = r["avg_ts"]
    return result


def ours(model, threads, pp, tg, depth, weights, kv, reps):
    out, rss = run_with_rss([os.path.join(ROOT, "build", "bin", "infinigen"), "bench",
                             "--model", model, "--threads", str(threads), "--prompt-tokens",
                             str(pp), "--gen-tokens", str(tg), "--depth", str(depth),
                             "--cpu-weights", weights, "--cpu-kv", kv, "--repetitions",
                             str(reps)])
    result = json.loads(out)
    result["peak_rss_mib"] = rss
    return result


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=os.path.join(cache_dir(), "models",
                                                    "SmolLM2-135M-Instruct.Q4_1.gguf"))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--pp", type=int, default=512)
    ap.add_argument("--tg", type=int, default=128)
    ap.add_argument("--peer", default=LLAMA_CPP_PYTHON, help="llama-cpp-python sdist version")
    ap.add_argument("--formats", default="f32,bf16,q8,q4_1", help="our --cpu-weights to run")
    ap.add_argument("--depth", type=int, default=0, help="tokens in the cache before each test")
    ap.add_argument("--kv", default="bf16", help="our --cpu-kv")
    ap.add_argument("--flash-attn", default="0", help="llama-bench's -fa")
    ap.add_argument("--repetitions", type=int, default=3,
                    help="repetitions of each test within one run (a long --depth: 1)")
    args = ap.parse_args()
    binary = build_llama_cpp(args.peer)
    results = {"llama.cpp": []}
    formats = args.formats.split(",")
    for f in formats:
        results[f"infinigen {f}"] = []
    for _ in range(args.rounds):  # interleaved, so that drift hits every engine alike
        results["llama.cpp"].append(llama_bench(binary, args.model, args.threads, args.pp, args.tg,
                                                args.depth, args.flash_attn, args.repetitions))
        for f in formats:
            results[f"infinigen {f}"].append(ours(args.model, args.threads, args.pp, args.tg,
                                                  args.depth, f, args.kv, args.repetitions))

    def best(rows, key):
        return max(r[key] for r in rows)

    peer = results["llama.cpp"]
    peer_pp, peer_tg = best(peer, "prefill_tokens_per_s"), best(peer, "decode_tokens_per_s")
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo")
                if line.startswith("model name")), platform.processor())
    print(f"machine: {cpu}, {os.cpu_count()} cores, {platform.platform()}")
    print(f"peer: llama.cpp vendored in llama-cpp-python {args.peer}, -fa {args.flash_attn}")
    at = f" @ depth {args.depth}" if args.depth else ""
    print(f"model: {os.path.basename(args.model)}, threads {args.threads}, "
          f"pp{args.pp} / tg{args.tg}{at}, our K/V {args.kv}, best of {args.rounds} rounds, "
          f"{time.strftime('%Y-%m-%d')}")
    print()
    print(f"| engine | prefill tok/s (pp{args.pp}{at}) | decode tok/s (tg{args.tg}{at}) | "
          "peak RSS MiB | prefill vs llama.cpp | decode vs llama.cpp |")
    print("|---|---:|---:|---:|---:|---:|")

    def ratio(x, peer_x):
        return f"{x / peer_x:.2f}x" if peer_x > 0 else "n/a"

    for name, rows in results.items():
        pp, tg = best(rows, "prefill_tokens_per_s"), best(rows, "decode_tokens_per_s")
        rss = min(r["peak_rss_mib"] for r in rows)
        print(f"| {name} | {pp:.1f} | {tg:.1f} | {rss:.0f} | {ratio(pp, peer_pp)} | "
              f"{ratio(tg, peer_tg)} |")


if __name__ == "__main__":
    main()
