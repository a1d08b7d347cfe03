"""`infinigen serve` with its OpenAI-compatible HTTP port, for the benchmark scripts beside this
file: started on free ports, waited for (GET /health), stopped at the end of a `with`. Standard
library only."""
import json
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def post(port, body, path="/v1/completions"):
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as r:
        return json.loads(r.read())


class Serve:
    """`with Serve(binary, model, flags) as http_port:` a running `infinigen serve`."""

    def __init__(self, binary, model, flags=(), log_prefix="serve-"):
        self.args = (binary, model, list(flags))
        self.log_prefix = log_prefix
        self.server = None

    def __enter__(self):
        binary, model, flags = self.args
        grpc_port, http_port = free_port(), free_port()
        log = tempfile.NamedTemporaryFile(prefix=self.log_prefix, suffix=".log", delete=False)
        self.server = subprocess.Popen([binary, "serve", "--model", model, "--listen",
                                        f"127.0.0.1:{grpc_port}", "--http-listen",
                                        f"127.0.0.1:{http_port}", *flags],
                                       stdout=log, stderr=subprocess.STDOUT)
        for _ in range(600):
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{http_port}/health", timeout=1):
                    return http_port
            except OSError:
                if self.server.poll() is not None:
                    break
                time.sleep(0.2)
        self.__exit__(None, None, None)
        sys.exit(f"the server did not come up (log: {log.name})")

    def __exit__(self, *exc):
        self.server.terminate()
        self.server.wait(timeout=30)
        return False
