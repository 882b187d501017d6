"""A real `kvforge serve` subprocess on a free loopback port, shared by the server tests."""
import collections
import json
import os
import resource
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest

from kvforge.bench.servers import wait_healthy

API_KEY = "test-key-123"
MAX_MODEL_LEN = 512
#: lines of a server's output kept for failure reports
LOG_LINES = 2000


class _ThreadClient(threading.local):
    client: httpx.Client | None = None


_thread_client = _ThreadClient()


def http() -> httpx.Client:
    """This thread's HTTP client, for the helpers that poll a server (``httpx.get`` builds a client and an
    SSL context per call: see ``kvforge.bench.servers.wait_healthy``). No keep-alive: each request on its
    own connection, as ``httpx.get`` sends it."""
    if _thread_client.client is None:
        _thread_client.client = httpx.Client(timeout=2.0, limits=httpx.Limits(max_keepalive_connections=0))
    return _thread_client.client


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """``kvforge serve MODEL --device cpu ... *args`` on a free port; ``wait=False`` returns at once
    (call :meth:`wait_healthy`). ``log`` holds the tail of its output (stdout and stderr), read as it comes."""

    def __init__(self, *args: str, env: dict | None = None, model: str = "dummy:tiny", wait: bool = True,
                 nofile: int | None = None):
        """``nofile``: the server's descriptor limit (``ulimit -n``), when it must be lower than ours."""
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "kvforge.cli", "serve", model, "--device", "cpu", "--port", str(self.port),
               "--max-model-len", str(MAX_MODEL_LEN), "--num-gpu-blocks-override", "512", *args]
        limit = None if nofile is None else (lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile)))
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     env={**os.environ, **(env or {})}, preexec_fn=limit)
        # read the server's output in a thread, or a full pipe would block its logging; the tail is kept for reports
        self.log: collections.deque[str] = collections.deque(maxlen=LOG_LINES)
        self._reader = threading.Thread(target=self.log.extend, args=(self.proc.stdout,), daemon=True)
        self._reader.start()
        if wait:
            self.wait_healthy()

    def wait_healthy(self, timeout: float = 120) -> None:
        try:
            wait_healthy(self.url, timeout, alive=lambda: self.proc.poll() is None)
        except RuntimeError:
            if self.proc.poll() is not None:
                self._reader.join(5)
                raise RuntimeError("server exited early:\n" + "".join(self.log)) from None
            self.stop()
            raise

    def stop(self, timeout: float = 60) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


@pytest.fixture(scope="session")
def server():
    s = ServerProcess("--api-key", API_KEY, "--served-model-name", "tiny", "tiny-alias")
    yield s
    s.stop()


#: n-gram speculation on, drafting every step: the speculative series have samples on /metrics
SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "policy": "fixed"}


@pytest.fixture(scope="session")
def spec_server():
    """A tiny server with speculative decoding on, shared by the speculative-serving and dashboard tests."""
    s = ServerProcess("--api-key", API_KEY, "--speculative-config", json.dumps(SPEC))
    yield s
    s.stop()


#: the default model (SmolLM2) as a deployment serves it: tool calls and reasoning parsed, 16 sequences
SMOL_FLAGS = ("--served-model-name", "smol", "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
              "--reasoning-parser", "qwen3", "--max-num-seqs", "16")


@pytest.fixture(scope="session")
def smol_server(default_model_path, dummy_plugin_installed):
    """``kvforge serve`` on the default model with ``SMOL_FLAGS``, started once (a start on the real model
    costs several times a tiny one's) for the tests that only send it requests: the Responses API, tool
    calling, a client's hang-up, the one-rank reference of tensor parallelism. The dummy plugin is
    installed first: tool calling scripts the model's text with its logits processors. A test that uses
    it leaves nothing running; cumulative metrics (tokens, requests) are compared before and after."""
    s = ServerProcess(*SMOL_FLAGS, model=default_model_path)
    yield s
    assert s.stop() == 0


@pytest.fixture(scope="session")
def client(server):
    import openai
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY)


@pytest.fixture(scope="session")
def tokenizer():
    from kvforge.model.loader import default_model_path
    from kvforge.tokenizer import load_tokenizer
    return load_tokenizer(default_model_path())


def metric(server, name: str) -> float:
    text = http().get(f"{server.url}/metrics").text
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    raise KeyError(name)


def metric_by_label(server, name: str, label: str) -> dict[str, float]:
    """Every series of the metric ``name`` (a counter's ``_total`` included) by the value of ``label``."""
    out = {}
    for line in http().get(f"{server.url}/metrics").text.splitlines():
        if line.startswith(name + "{"):
            out[line.split(f'{label}="')[1].split('"')[0]] = float(line.rsplit(" ", 1)[1])
    return out


def hang_up_mid_stream(server, prompt: str = "Write a long story about the sea.", max_tokens: int = 300,
                       chunks: int = 3, while_open=None) -> None:
    """Start a streaming completion, read ``chunks`` SSE events, call ``while_open()`` (the request is
    still running), then close the connection: the server must abort the request."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "stream": True, "ignore_eos": True}
    with httpx.Client(timeout=60) as c:
        with c.stream("POST", f"{server.url}/v1/completions", json=body) as r:
            assert r.status_code == 200
            seen = 0
            lines = r.iter_lines()  # kept referenced: closing it early would close the connection
            for line in lines:
                seen += line.startswith("data: ")
                if seen >= chunks:
                    break
            if while_open is not None:
                while_open()


def wait_until(cond, timeout: float) -> bool:
    """Poll ``cond`` every 0.1 s until it holds (True) or ``timeout`` passes (False)."""
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


IDLE_METRICS = ("kv_cache_usage_perc", "num_requests_running", "num_requests_waiting")


def wait_idle(server, timeout: float = 10.0) -> dict[str, float]:
    """Poll /metrics until the engine holds nothing (no block, nothing running or waiting) or
    ``timeout`` passes; returns the last readings (all zero when idle)."""
    deadline = time.monotonic() + timeout
    while True:
        held = {name: metric(server, f"kvforge:{name}") for name in IDLE_METRICS}
        if not any(held.values()) or time.monotonic() > deadline:
            return held
        time.sleep(0.1)
