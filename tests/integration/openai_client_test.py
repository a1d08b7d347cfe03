#!/usr/bin/env python3
"""The official `openai` Python client (PyPI; scripts/setup.sh installs it into the project's
venv) against a real `infinigen serve --http-listen` of SmolLM2-135M-Instruct: chat and text
completions, whole and streamed (the streamed deltas equal the whole answer), usage with cached
tokens, logprobs, stop strings, a seed that reproduces a sampled answer, n = 3 choices, the model
list, and the errors the client raises for 400, 401 and 404.

Usage: openai_client_test.py --bin-dir build/bin. Exit 77 (skipped) without the model.
"""
import argparse
import os
import socket
import subprocess
import sys
import tempfile
import time

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


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin-dir", required=True)
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
    grpc_port, http_port = free_port(), free_port()
    log = tempfile.NamedTemporaryFile("w+", suffix=".log", delete=False)
    serve = subprocess.Popen(
        [os.path.join(args.bin_dir, "infinigen"), "serve", f"--model={model_path}",
         f"--listen=127.0.0.1:{grpc_port}", f"--http-listen=127.0.0.1:{http_port}",
         f"--api-keys-file={keys.name}", "--threads=1"],
        stdout=log, stderr=subprocess.STDOUT)
    try:
        base = f"http://127.0.0.1:{http_port}/v1"
        client = openai.OpenAI(base_url=base, api_key=KEY, max_retries=0, timeout=120)
        deadline = time.time() + 60
        while True:
            try:
                models = client.models.list()
                break
            except openai.APIConnectionError:
                if time.time() > deadline or serve.poll() is not None:
                    log.seek(0)
                    sys.exit("infinigen serve did not start:\n" + log.read())
                time.sleep(0.2)
        model = models.data[0].id
        print("model:", model)

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
        # A prompt that fills the whole context has no room for the one token `max_tokens: 0`
        # is served as: a 400 that says so (not only the gRPC limit's max_new_tokens = 1).
        context = client.models.list().data[0].model_extra["max_model_len"]
        try:
            client.completions.create(model=model, prompt=[1] * context, max_tokens=0, echo=True)
            raise AssertionError("a prompt filling the context was accepted with max_tokens 0")
        except openai.BadRequestError as e:
            assert "leave room for it" in e.message, e.message
            print(f"BadRequestError: {e.status_code} {e.message[:160]}")

        stopped = client.completions.create(model=model, prompt="1, 2, 3, 4,", max_tokens=30,
                                            temperature=0, stop=[","])
        assert "," not in stopped.choices[0].text, stopped
        assert stopped.choices[0].finish_reason == "stop", stopped

        sampled = [client.chat.completions.create(model=model, messages=messages, max_tokens=16,
                                                  temperature=1.0, seed=7)
                   .choices[0].message.content for _ in range(2)]
        assert sampled[0] == sampled[1], sampled

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
        print("openai client: every check passed")
        return 0
    finally:
        serve.terminate()
        serve.wait(timeout=30)
        os.unlink(keys.name)


if __name__ == "__main__":
    sys.exit(main())
