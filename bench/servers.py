"""The servers ``kvforge bench serve`` drives: kvforge's app in this process, or a command (``kvforge serve``,
``vllm serve``) as a subprocess on a loopback port. Cold start is engine construction (in-process) or
process start (subprocess) until ``/health`` answers 200.
"""
from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

import httpx


def wait_healthy(url: str, timeout: float, alive: Any = lambda: True) -> None:
    """Poll ``url``/health until it answers 200. One client for the whole wait: ``httpx.get`` builds a
    client (and an SSL context) per call, about 20 ms of CPU, which at this rate took a third of a core
    from the server starting on a small machine. No keep-alive: each poll on its own connection."""
    deadline = time.monotonic() + timeout
    with httpx.Client(timeout=2.0, limits=httpx.Limits(max_keepalive_connections=0)) as client:
        while time.monotonic() < deadline:
            if not alive():
                raise RuntimeError("the server exited before /health answered 200")
            try:
                if client.get(f"{url}/health").status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.02)
    raise RuntimeError(f"{url}/health did not answer 200 within {timeout:.0f} s")


class InProcessServer:
    """The app under uvicorn on a daemon thread of this process (the engine thread is its own)."""

    label = "kvforge serve (in-process)"

    def __init__(self, config: Any, timeout: float):
        import uvicorn

        from kvforge.engine.async_engine import AsyncLLMEngine
        from kvforge.plugin_manager import get_plugin_manager
        from kvforge.server.app import create_app
        from kvforge.server.cli import default_served_name

        t0 = time.perf_counter()
        self.engine = AsyncLLMEngine.from_config(config)
        app = create_app(self.engine, [default_served_name(config.model)], hook=get_plugin_manager().hook)
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))  # the OS picks a free port; uvicorn serves this very socket
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]},
                                       name="kvforge-bench-server", daemon=True)
        self.thread.start()
        wait_healthy(self.url, timeout, self.thread.is_alive)
        self.cold_start_s = time.perf_counter() - t0

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=60)


class ExternalServer:
    """A server someone else started (``--base-url``): nothing to start or stop, no cold start."""

    cold_start_s = None

    def __init__(self, url: str):
        self.url = self.label = url.rstrip("/")

    def stop(self) -> None:
        pass


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ProcessServer:
    """A server command as a subprocess on loopback ``port``, its output in a log file; cold start is
    process start until ``/health`` answers 200."""

    def __init__(self, cmd: list[str], port: int, timeout: float, label: str, env: dict | None = None):
        self.label = label
        self.url = f"http://127.0.0.1:{port}"
        self.log = tempfile.NamedTemporaryFile("w+", prefix="kvforge-bench-serve-", suffix=".log", delete=False)
        t0 = time.perf_counter()
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env)
        try:
            wait_healthy(self.url, timeout, lambda: self.proc.poll() is None)
        except RuntimeError as exc:
            tail = self.output()[-3000:]
            self.stop()
            raise RuntimeError(f"{exc}; server log ({self.log.name}):\n{tail}") from None
        self.cold_start_s = time.perf_counter() - t0

    def output(self) -> str:
        self.log.flush()
        with open(self.log.name, errors="replace") as f:  # read before stop() closes our handle
            return f.read()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


def kvforge_server(args: argparse.Namespace, port: int, timeout: float) -> ProcessServer:
    """``python -m kvforge.cli serve`` with the same engine flags."""
    cmd = [sys.executable, "-m", "kvforge.cli", "serve", "--port", str(port), *engine_argv(args)]
    return ProcessServer(cmd, port, timeout, "kvforge serve (process)")


def vllm_server(peer: Any, config: Any, source: Any, mc: Any, seed: int, port: int, timeout: float,
                workdir: str) -> ProcessServer:
    """``vllm serve`` of the same model (random weights where kvforge's are), served under kvforge's
    model name, vLLM's defaults otherwise; without a tokenizer it is told to skip loading one."""
    from kvforge.bench.vllm_peer import llm_kwargs
    from kvforge.model.tokenizer_source import tokenizer_for
    from kvforge.server.cli import default_served_name

    kwargs = llm_kwargs(source, mc, config.torch_dtype, seed, workdir, config)
    cmd = peer.cli("serve", kwargs["model"], "--host", "127.0.0.1", "--port", str(port), "--dtype", kwargs["dtype"],
                   "--seed", str(kwargs["seed"]), "--served-model-name", default_served_name(config.model))
    if kwargs.get("load_format"):
        cmd += ["--load-format", kwargs["load_format"]]
    for key in ("quantization", "kv_cache_dtype"):
        if kwargs.get(key):
            cmd += ["--" + key.replace("_", "-"), kwargs[key]]
    tokenizer = tokenizer_for(config, source, mc)
    if tokenizer is None:
        cmd.append("--skip-tokenizer-init")
    elif source.kind == "dummy" and source.path is None:  # a preset: its config directory lacks the tokenizer
        path = os.path.join(workdir, "tokenizer")
        tokenizer.save_pretrained(path)
        cmd += ["--tokenizer", path]
    return ProcessServer(cmd, port, timeout, f"vLLM {peer.version} serve", env=peer.env())


def engine_argv(args: argparse.Namespace) -> list[str]:
    """The engine flags of ``args`` as ``kvforge serve`` arguments."""
    from kvforge.cli import ENGINE_FLAGS

    argv: list[str] = []
    for flag, _ in ENGINE_FLAGS:
        value = getattr(args, flag[2:].replace("-", "_"), None)
        if value is not None:
            argv += [flag, str(value)]
    if args.enable_prefix_caching is not None:
        argv.append("--enable-prefix-caching" if args.enable_prefix_caching else "--no-enable-prefix-caching")
    if args.enforce_eager:
        argv.append("--enforce-eager")
    if getattr(args, "async_scheduling", None) is not None:
        argv.append("--async-scheduling" if args.async_scheduling else "--no-async-scheduling")
    return argv
