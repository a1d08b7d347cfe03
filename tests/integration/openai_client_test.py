#!/usr/bin/env python3
"""The official `openai` Python client (PyPI; scripts/setup.sh installs it into the project's
venv) against a real server of SmolLM2-135M-Instruct: chat and text completions, whole and
streamed (the streamed deltas equal the whole answer), usage with cached tokens, logprobs, stop
strings, a seed that reproduces a sampled answer, n = 3 choices, the model list, and the errors
the client raises for 400, 401 and 404.

--topology serve: one `infinigen serve --http-listen` (router, worker and KV store in one
process). --topology split: `infinigen-kvstore`, two `infinigen-worker`s on it and
`infinigen-router --http-listen` in front, as separate processes; there also a client that hangs
up mid-stream frees its request on the worker (the workers' own metrics say so), a worker that
crashes (SIGKILL) under a streamed answer hands it to the other one, which resumes from the KV
store and streams exactly the text of an uninterrupted run (the router's metrics count one
failover and one resume), and with every worker gone the door answers 503 (the client's
InternalServerError) with Retry-After.

Usage: openai_client_test.py --bin-dir build/bin [--topology serve|split]. Exit 77 (skipped)
without the model.
"""
import argparse
import ast
import json
import math
import os
import struct
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

SKIP = 77
KEY = "sk-openai-client-test"


def cache_dir():
    return os.environ.get("INFINIGEN_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "infinigen")


def reexec_in_venv():
    try:
        import openai  # noqa: F401
        return
    except ImportError:
        pass
    python = os.path.join(cache_dir(), "venv", "bin", "python")
    if os.path.exists(python) and os.path.realpath(sys.executable) != os.path.realpath(python):
        os.execv(python, [python] + sys.argv)
    sys.exit("the openai client is not installed: run scripts/setup.sh")


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Processes:
    """Child processes sharing one log file; stopped (and the log shown on failure) at exit."""

    def __init__(self):
        self.log = tempfile.NamedTemporaryFile("w+", suffix=".log", delete=False)
        self.children = {}

    def start(self, name, argv):
        self.children[name] = subprocess.Popen(argv, stdout=self.log, stderr=subprocess.STDOUT)

    def stop(self, name):
        child = self.children.pop(name)
        child.terminate()
        child.wait(timeout=30)

    def crash(self, name):
        """SIGKILL: the process ends at once, mid-request, as a failed machine would."""
        child = self.children.pop(name)
        child.kill()
        child.wait(timeout=30)

    def dead(self):
        return [n for n, c in self.children.items() if c.poll() is not None]

    def text(self):
        self.log.seek(0)
        return self.log.read()

    def stop_all(self):
        for name in list(self.children):
            self.stop(name)
        os.unlink(self.log.name)


def metric(port, name):
    """A worker's metric (the sum of its samples) from its Prometheus endpoint."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        body = r.read().decode()
    return sum(float(line.split()[-1]) for line in body.splitlines()
               if line.startswith(name + " ") or line.startswith(name + "{"))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin-dir", required=True)
    ap.add_argument("--topology", choices=["serve", "split"], default="serve")
    args = ap.parse_args()
    model_path = os.environ.get("INFINIGEN_SMOLLM2_GGUF") or os.path.join(
        cache_dir(), "models", "SmolLM2-135M-Instruct.Q4_1.gguf")
    if not os.path.exists(model_path):
        print(f"skipped: no {model_path} (scripts/setup.sh fetches it)")
        return SKIP
    reexec_in_venv()
    import openai

    keys = tempfile.NamedTemporaryFile("w", suffix=".keys", delete=False)
    keys.write(KEY + "\n")
    keys.close()
    procs = Processes()
    grpc_port, http_port = free_port(), free_port()
    bin_ = lambda name: os.path.join(args.bin_dir, name)  # noqa: E731
    worker_metrics = []
    router_metrics = free_port()
    if args.topology == "serve":
        procs.start("serve", [bin_("infinigen"), "serve", f"--model={model_path}",
                              f"--listen=127.0.0.1:{grpc_port}",
                              f"--http-listen=127.0.0.1:{http_port}",
                              f"--api-keys-file={keys.name}", "--threads=1"])
    else:
        store = free_port()
        procs.start("kvstore", [bin_("infinigen-kvstore"), f"--listen=127.0.0.1:{store}",
                                "--capacity_mb=256", "--huge_pages=false"])
        workers = []
        for i in range(2):
            port, metrics = free_port(), free_port()
            workers.append(f"127.0.0.1:{port}")
            worker_metrics.append(metrics)
            procs.start(f"worker{i}", [bin_("infinigen-worker"), f"--model={model_path}",
                                       f"--listen=127.0.0.1:{port}", "--threads=1",
                                       "--kv_transport=grpc", f"--kv_store=127.0.0.1:{store}",
                                       f"--metrics-port={metrics}"])
        procs.start("router", [bin_("infinigen-router"), f"--listen=127.0.0.1:{grpc_port}",
                               f"--workers={','.join(workers)}",
                               f"--http-listen=127.0.0.1:{http_port}",
                               f"--api-keys-file={keys.name}", "--health-interval-ms=200",
                               f"--metrics-port={router_metrics}"])
    try:
        base = f"http://127.0.0.1:{http_port}/v1"
        client = openai.OpenAI(base_url=base, api_key=KEY, max_retries=0, timeout=120)
        deadline = time.time() + 120
        while True:
            try:
                models = client.models.list()
                # The router answers before its workers are healthy: wait for a served request.
                client.completions.create(model=models.data[0].id, prompt="Hi", max_tokens=1)
                break
            except (openai.APIConnectionError, openai.InternalServerError):
                if time.time() > deadline or procs.dead():
                    sys.exit(f"{args.topology} did not start ({procs.dead()} exited):\n" +
                             procs.text())
                time.sleep(0.2)
        model = models.data[0].id
        if worker_metrics:  # both workers up (a session sticks to one), then the router's checks
            for port in worker_metrics:
                while True:
                    try:
                        metric(port, "infinigen_worker_running_requests")
                        break
                    except OSError:
                        assert time.time() < deadline, procs.text()
                        time.sleep(0.2)
            time.sleep(1.0)
        print("model:", model, "topology:", args.topology)
        check_api(openai, client, base, model)
        # What the served processes store weights and K/V in (serve's defaults, the worker's).
        formats = ["q4_1", "bf16"] if args.topology == "serve" else ["f32", "f32"]
        check_grpc_logprobs_equal_the_logits_command(args.bin_dir, grpc_port, model_path, formats)
        if args.topology == "split":
            check_disconnect_frees_the_worker(client, model, worker_metrics)
            check_failover_mid_stream(client, model, worker_metrics, router_metrics, procs)
            check_no_worker_is_503(openai, client, model, procs)
        print("openai client: every check passed")
        return 0
    except BaseException:
        print(procs.text()[-8000:])
        raise
    finally:
        procs.stop_all()
        os.unlink(keys.name)


def read_npy_f32(path):
    """A float32 .npy file as (shape, flat list) (numpy is not needed)."""
    with open(path, "rb") as f:
        assert f.read(6) == b"\x93NUMPY", path
        major = f.read(2)[0]
        (header_len,) = struct.unpack("<H" if major == 1 else "<I", f.read(2 if major == 1 else 4))
        header = ast.literal_eval(f.read(header_len).decode())
        assert header["descr"] == "<f4" and not header["fortran_order"], header
        data = f.read()
    count = len(data) // 4
    return header["shape"], struct.unpack(f"<{count}f", data)


def check_grpc_logprobs_equal_the_logits_command(bin_dir, grpc_port, model_path, formats):
    """Greedy tokens' logprobs through the gRPC API (`infinigen client --logprobs`) equal the
    log-softmax of `infinigen logits` (the model run once over the same ids, another process) at
    the positions that predicted them."""
    prompt = [1, 504, 3458, 282, 4649, 314, 2114, 30]
    # max_new_tokens 0 over gRPC: the prompt computed, no token, finish length.
    scored = subprocess.run(
        [os.path.join(bin_dir, "infinigen"), "client", f"--server=127.0.0.1:{grpc_port}",
         f"--api-key={KEY}", "--prompt-ids=" + ",".join(map(str, prompt)), "--max-tokens=0"],
        check=True, capture_output=True, text=True)
    assert scored.stdout.strip() == "", scored.stdout
    assert f"[{len(prompt)} prompt (0 cached) + 0 generated tokens, finish FINISH_REASON_LENGTH" \
        in scored.stderr, scored.stderr
    out = subprocess.run(
        [os.path.join(bin_dir, "infinigen"), "client", f"--server=127.0.0.1:{grpc_port}",
         f"--api-key={KEY}", "--prompt-ids=" + ",".join(map(str, prompt)), "--max-tokens=6",
         "--temperature=0", "--ignore-eos", "--policy=full", "--logprobs=3"],
        check=True, capture_output=True, text=True).stdout
    tokens = [json.loads(line) for line in out.splitlines() if line.strip()]
    assert len(tokens) == 6, out
    ids = prompt + [t["id"] for t in tokens]
    with tempfile.TemporaryDirectory() as tmp:
        npy = os.path.join(tmp, "logits.npy")
        subprocess.run(
            [os.path.join(bin_dir, "infinigen"), "logits", f"--model={model_path}",
             "--token-ids=" + ",".join(map(str, ids[:-1])), f"--out={npy}", "--threads=1",
             f"--cpu-weights={formats[0]}", f"--cpu-kv={formats[1]}"],
            check=True, capture_output=True)
        shape, flat = read_npy_f32(npy)
    vocab = shape[1]
    worst = 0.0
    for i, t in enumerate(tokens):
        row = flat[(len(prompt) - 1 + i) * vocab:(len(prompt) + i) * vocab]
        top = max(row)
        log_sum = top + math.log(sum(math.exp(v - top) for v in row))
        logprob = {j: row[j] - log_sum for j in range(vocab)}
        assert t["id"] == max(range(vocab), key=lambda j: (row[j], -j)), (i, t)  # greedy
        worst = max(worst, abs(t["logprob"] - logprob[t["id"]]))
        assert len(t["top"]) == 3, t
        for j, lp in t["top"]:
            worst = max(worst, abs(lp - logprob[j]))
        ranked = sorted(range(vocab), key=lambda j: -row[j])
        if row[ranked[2]] - row[ranked[3]] > 1e-3:  # the top 3 are well separated: same ids
            assert [j for j, _ in t["top"]] == ranked[:3], (t["top"], ranked[:3])
    assert worst < 2e-3, f"gRPC logprobs differ from the logits command's by {worst}"
    print(f"gRPC logprobs of 6 greedy tokens = log-softmax of `infinigen logits` "
          f"(max |diff| {worst:.2e}, {formats[0]} weights, {formats[1]} K/V)")


def check_disconnect_frees_the_worker(client, model, worker_metrics):
    """A streamed answer the client hangs up on mid-stream ends on its worker: no request stays
    running and the tokens generated stop short of max_tokens."""
    generated = sum(metric(p, "infinigen_worker_generated_tokens_total") for p in worker_metrics)
    stream = client.completions.create(model=model, prompt="Count: 1, 2, 3,", max_tokens=400,
                                       temperature=0, stream=True,
                                       extra_body={"ignore_eos": True})
    received = 0
    for chunk in stream:
        received += 1
        if received == 3:
            break
    stream.close()  # the HTTP connection closes under the generation
    deadline = time.time() + 30
    while True:
        running = sum(metric(p, "infinigen_worker_running_requests") for p in worker_metrics)
        if running == 0:
            break
        assert time.time() < deadline, f"{running} requests still running 30 s after a hang-up"
        time.sleep(0.1)
    time.sleep(0.5)
    after = sum(metric(p, "infinigen_worker_generated_tokens_total") for p in worker_metrics)
    assert 0 < after - generated < 400, f"the worker generated {after - generated} of 400 tokens"
    print(f"hang-up after {received} chunks: the workers generated {after - generated} tokens "
          "of 400 and run nothing")


def check_failover_mid_stream(client, model, worker_metrics, router_metrics, procs):
    """The worker streaming an answer over HTTP crashes (SIGKILL) after a few chunks: the same
    stream goes on from the other worker (the router resumes it from the KV store) and the
    client receives exactly the text, finish reason and usage of an uninterrupted run."""
    max_tokens = 192  # seconds of decoding: the crash lands well before the end
    ask = dict(model=model, prompt="The history of the printing press", max_tokens=max_tokens,
               temperature=0, extra_body={"ignore_eos": True})
    whole = client.completions.create(**ask)
    assert whole.usage.completion_tokens == max_tokens, whole.usage
    deadline = time.time() + 30  # nothing running (the answer above has left its worker)
    while sum(metric(p, "infinigen_worker_running_requests") for p in worker_metrics) != 0:
        assert time.time() < deadline, "a request still runs 30 s after its answer"
        time.sleep(0.05)
    generated = [metric(p, "infinigen_worker_generated_tokens_total") for p in worker_metrics]
    failovers = metric(router_metrics, "infinigen_router_failovers_total")
    resumes = metric(router_metrics, "infinigen_router_resumes_total")
    stream = client.completions.create(**ask, stream=True,
                                       stream_options={"include_usage": True})
    text, finish, usage, crashed = "", None, None, None
    for chunk in stream:
        for choice in chunk.choices:
            text += choice.text
            finish = choice.finish_reason or finish
        usage = chunk.usage or usage
        if crashed is None and len(text) > 0:
            # The worker running it: the one whose generated tokens rose.
            now = [metric(p, "infinigen_worker_generated_tokens_total") for p in worker_metrics]
            rose = [i for i in range(len(now)) if now[i] > generated[i]]
            if len(rose) == 1 and now[rose[0]] - generated[rose[0]] < max_tokens:
                crashed = f"worker{rose[0]}"
                procs.crash(crashed)
    assert crashed is not None, "the stream ended before a worker could be crashed under it"
    assert text == whole.choices[0].text, (text, whole.choices[0].text)
    assert finish == "length", finish
    assert usage is not None and usage.completion_tokens == max_tokens, usage
    after = metric(router_metrics, "infinigen_router_failovers_total")
    assert after == failovers + 1, f"router failovers {failovers} -> {after}"
    resumed = metric(router_metrics, "infinigen_router_resumes_total") - resumes
    assert resumed == 1, f"{resumed} resumes from the stored KV (expected 1: no recompute)"
    print(f"{crashed} crashed mid-stream: the stream went on from the stored KV on the other "
          f"worker, {len(text)} characters equal to an uninterrupted run")


def check_no_worker_is_503(openai, client, model, procs):
    """With every worker gone the door answers 503 (OpenAI's error JSON) and says when to retry."""
    for name in ("worker0", "worker1"):
        if name in procs.children:
            procs.stop(name)
    deadline = time.time() + 30
    while True:
        try:
            client.completions.create(model=model, prompt="Hi", max_tokens=2)
        except openai.InternalServerError as e:
            assert e.status_code == 503, e
            assert e.response.headers.get("retry-after"), e.response.headers
            print(f"no worker: {e.status_code} {e.message[:120]}")
            return
        except openai.APIStatusError as e:
            raise AssertionError(f"expected 503 with no worker, got {e.status_code}: {e.message}")
        assert time.time() < deadline, "requests were still served 30 s after the workers stopped"
        time.sleep(0.2)


def check_api(openai, client, base, model):
    """The API checks both topologies pass."""
    messages = [{"role": "user", "content": "Name three colors."}]
    whole = client.chat.completions.create(model=model, messages=messages, max_tokens=24,
                                           temperature=0)
    content = whole.choices[0].message.content
    assert content, whole
    assert whole.choices[0].finish_reason in ("stop", "length"), whole
    assert whole.usage.completion_tokens > 0 and whole.usage.prompt_tokens > 0, whole.usage
    assert whole.usage.total_tokens == whole.usage.prompt_tokens + whole.usage.completion_tokens
    assert whole.usage.prompt_tokens_details.cached_tokens == 0, whole.usage

    stream = client.chat.completions.create(model=model, messages=messages, max_tokens=24,
                                            temperature=0, stream=True,
                                            stream_options={"include_usage": True})
    deltas, usage, finish = [], None, None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            if choice.delta.content:
                deltas.append(choice.delta.content)
            finish = choice.finish_reason or finish
    assert "".join(deltas) == content, ("".join(deltas), content)
    assert finish == whole.choices[0].finish_reason, finish
    assert usage is not None and usage.completion_tokens == whole.usage.completion_tokens

    # OpenAI's penalties, as the official client sends them: greedy, they change the answer (its
    # numbered list repeats "." and "\n"; the C++ test checks the formula token by token).
    penalized = client.chat.completions.create(model=model, messages=messages, max_tokens=24,
                                               temperature=0, presence_penalty=2,
                                               frequency_penalty=2)
    assert penalized.choices[0].message.content != content, penalized

    # JSON mode (response_format json_object): the answer parses as one object.
    shaped = client.chat.completions.create(
        model=model, max_tokens=150, temperature=0, response_format={"type": "json_object"},
        messages=[{"role": "user", "content": "Give a JSON object with a name and an age."}])
    assert shaped.choices[0].finish_reason == "stop", shaped
    assert isinstance(json.loads(shaped.choices[0].message.content), dict), shaped

    # A conversation (the gRPC API's session_id, not OpenAI's): the second turn, whose prompt
    # begins with the first turn's prompt and answer, takes the stored KV over.
    turn = [{"role": "user", "content": "Name a fruit."}]
    first = client.chat.completions.create(model=model, messages=turn, max_tokens=12,
                                           temperature=0, extra_body={"session_id": "conv-1"})
    assert first.usage.prompt_tokens_details.cached_tokens == 0, first.usage
    turn += [{"role": "assistant", "content": first.choices[0].message.content},
             {"role": "user", "content": "And a vegetable?"}]
    second = client.chat.completions.create(model=model, messages=turn, max_tokens=12,
                                            temperature=0, extra_body={"session_id": "conv-1"})
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert 0 < cached < second.usage.prompt_tokens, second.usage
    print(f"second turn: {cached} of {second.usage.prompt_tokens} prompt tokens cached")

    text = client.completions.create(model=model, prompt="The capital of France is",
                                     max_tokens=8, temperature=0, logprobs=2)
    lp = text.choices[0].logprobs
    assert len(lp.token_logprobs) == text.usage.completion_tokens == 8, text
    assert all(v <= 0 for v in lp.token_logprobs), lp.token_logprobs
    assert all(len(top) == 2 for top in lp.top_logprobs), lp.top_logprobs
    assert all(max(top.values()) >= chosen - 1e-5
               for top, chosen in zip(lp.top_logprobs, lp.token_logprobs))
    # Each token's text (the worker's decoding of that id): together, the completion's text.
    assert "".join(lp.tokens) == text.choices[0].text, (lp.tokens, text.choices[0].text)
    assert lp.text_offset == [sum(len(t.encode()) for t in lp.tokens[:i]) for i in range(8)]

    chat_lp = client.chat.completions.create(model=model, messages=messages, max_tokens=6,
                                             temperature=0, logprobs=True, top_logprobs=3)
    entries = chat_lp.choices[0].logprobs.content
    assert len(entries) == chat_lp.usage.completion_tokens, entries
    assert all(len(e.top_logprobs) == 3 for e in entries)
    assert "".join(e.token for e in entries) == chat_lp.choices[0].message.content, entries
    assert all(bytes(e.bytes) == e.token.encode() for e in entries)

    # echo, as lm-eval-harness asks for a loglikelihood: the prompt's text, then the
    # completion's; the prompt tokens' logprobs (the first has none), then the completion's.
    prompt = "The capital of France is"
    echoed = client.completions.create(model=model, prompt=prompt, max_tokens=1,
                                       temperature=0, logprobs=1, echo=True)
    e = echoed.choices[0]
    assert e.text == prompt + lp.tokens[0], (e.text, lp.tokens[0])
    elp = e.logprobs
    assert len(elp.tokens) == echoed.usage.prompt_tokens + 1, (elp.tokens, echoed.usage)
    assert elp.token_logprobs[0] is None and elp.top_logprobs[0] is None, elp
    assert all(v <= 0 for v in elp.token_logprobs[1:]), elp.token_logprobs
    assert abs(elp.token_logprobs[-1] - lp.token_logprobs[0]) < 1e-5
    assert elp.tokens[-1] == lp.tokens[0] and elp.text_offset[-1] == len(prompt)
    assert "".join(elp.tokens[1:-1]) in prompt, elp.tokens
    # max_tokens 0: the prompt alone (lm-eval's loglikelihood of a whole string): the same
    # prompt entries as above, no completion token.
    scored = client.completions.create(model=model, prompt=prompt, max_tokens=0,
                                       temperature=0, logprobs=1, echo=True)
    s = scored.choices[0]
    assert s.text == prompt and s.finish_reason == "length", s
    assert s.logprobs.tokens == elp.tokens[:-1], (s.logprobs.tokens, elp.tokens)
    assert s.logprobs.token_logprobs[1:] == elp.token_logprobs[1:-1], s.logprobs
    assert scored.usage.completion_tokens == 0, scored.usage
    assert scored.usage.prompt_tokens == echoed.usage.prompt_tokens, scored.usage
    # lm-eval batches its loglikelihood requests: a list of prompts, a choice each, in order,
    # each as if it came alone.
    other = "Paris is the capital of"
    batch = client.completions.create(model=model, prompt=[other, prompt], max_tokens=0,
                                      temperature=0, logprobs=1, echo=True)
    assert [c.index for c in batch.choices] == [0, 1], batch
    assert batch.choices[0].text == other, batch.choices[0]
    assert batch.choices[1].logprobs.tokens == s.logprobs.tokens, batch.choices[1]
    assert batch.choices[1].logprobs.token_logprobs[1:] == s.logprobs.token_logprobs[1:]
    alone = client.completions.create(model=model, prompt=other, max_tokens=0, echo=True)
    assert batch.usage.prompt_tokens == (alone.usage.prompt_tokens
                                         + scored.usage.prompt_tokens), batch.usage
    # `max_tokens: 0` is the gRPC API's prompt-only request (no token sampled, so a prompt
    # that fills the whole context is served: tests/integration/batch_engine_test.cc, 8192
    # tokens here would take a minute); one token more than the context is a 400.
    context = client.models.list().data[0].model_extra["max_model_len"]
    try:
        client.completions.create(model=model, prompt=[28] * (context + 1), max_tokens=0,
                                  echo=True)
        raise AssertionError("a prompt longer than the context was accepted")
    except openai.BadRequestError as e:
        assert "max_prompt_tokens" in e.message or "exceeds" in e.message, e.message
        print(f"BadRequestError: {e.status_code} {e.message[:160]}")
    # Streamed, the prompt alone comes as one chunk with the prompt's entries.
    chunks = list(client.completions.create(model=model, prompt=prompt, max_tokens=0,
                                            temperature=0, logprobs=1, echo=True, stream=True))
    streamed_tokens = [t for c in chunks for ch in c.choices if ch.logprobs
                       for t in ch.logprobs.tokens]
    assert streamed_tokens == s.logprobs.tokens, (streamed_tokens, s.logprobs.tokens)
    assert "".join(ch.text for c in chunks for ch in c.choices) == prompt, chunks

    stopped = client.completions.create(model=model, prompt="1, 2, 3, 4,", max_tokens=30,
                                        temperature=0, stop=[","])
    assert "," not in stopped.choices[0].text, stopped
    assert stopped.choices[0].finish_reason == "stop", stopped
    assert stopped.choices[0].model_extra["stop_reason"] == ",", stopped  # vLLM's field
    # vLLM's include_stop_str_in_output: the same text, then the stop string that ended it.
    kept = client.completions.create(model=model, prompt="1, 2, 3, 4,", max_tokens=30,
                                     temperature=0, stop=[","],
                                     extra_body={"include_stop_str_in_output": True})
    assert kept.choices[0].text == stopped.choices[0].text + ",", (kept, stopped)
    assert kept.choices[0].finish_reason == "stop", kept
    streamed = client.completions.create(model=model, prompt="1, 2, 3, 4,", max_tokens=30,
                                         temperature=0, stop=[","], stream=True)
    last = [c for c in streamed][-1].choices[0]
    assert last.finish_reason == "stop" and last.model_extra["stop_reason"] == ",", last

    sampled = [client.chat.completions.create(model=model, messages=messages, max_tokens=16,
                                              temperature=1.0, seed=7)
               .choices[0].message.content for _ in range(2)]
    assert sampled[0] == sampled[1], sampled
    # No seed: the server draws one and reports it with the answer; it reproduces the answer.
    drawn = client.chat.completions.create(model=model, messages=messages, max_tokens=16,
                                           temperature=1.0)
    seed = drawn.choices[0].model_extra["seed"]
    assert seed, drawn
    again = client.chat.completions.create(model=model, messages=messages, max_tokens=16,
                                           temperature=1.0, seed=seed)
    assert again.choices[0].message.content == drawn.choices[0].message.content, (drawn, again)
    assert again.choices[0].model_extra["seed"] == seed, again

    three = client.chat.completions.create(model=model, messages=messages, max_tokens=16,
                                           temperature=1.0, seed=7, n=3)
    assert [c.index for c in three.choices] == [0, 1, 2], three
    assert three.choices[0].message.content == sampled[0], "choice 0 has the request's seed"
    assert len({c.message.content for c in three.choices}) > 1, three
    assert 3 <= three.usage.completion_tokens <= 3 * 16, three.usage

    def expect(error, call):
        try:
            call()
        except error as e:
            print(f"{error.__name__}: {e.status_code} {e.message[:80]}")
            return e
        raise AssertionError(f"expected {error.__name__}")

    expect(openai.BadRequestError, lambda: client.chat.completions.create(
        model=model, messages=messages, n=17))
    expect(openai.BadRequestError, lambda: client.chat.completions.create(
        model=model, messages=[{"role": "wizard", "content": "hi"}]))
    expect(openai.NotFoundError, lambda: client.chat.completions.create(
        model="no-such-model", messages=messages))
    wrong = openai.OpenAI(base_url=base, api_key="sk-wrong", max_retries=0)
    expect(openai.AuthenticationError, lambda: wrong.chat.completions.create(
        model=model, messages=messages))


if __name__ == "__main__":
    sys.exit(main())
