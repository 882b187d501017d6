"""Issue 34, findings 3 and 4: a hung engine is noticed, and one model's engine dying never cuts another's.

The engine core process is stopped with SIGSTOP: it raises nothing and its connection stays open, as
with a deadlocked collective or a stuck kernel. The front end's watchdog (``--engine-step-timeout``)
must declare it dead: its streams get an error event and ``[DONE]``, ``/health`` answers 503, and the
server drains and exits 1. With two models, the other model's open streams finish normally first.
"""
from __future__ import annotations

import json
import os
import signal
import threading
import time

import httpx
import pytest

from conftest import ServerProcess, http, wait_until
from kvforge.model.loader import default_model_path

STEP_TIMEOUT_S = 3.0
#: tokens of each stream of the healthy model at most: enough to outlast the other's death (3-4 s) on a
#: fast CPU; on a slower one, fewer do (see b_tokens): 240 ran 30 s past it on 2 cores at 135 ms a step
B_TOKENS = 240
B_TOKENS_MIN = 32
#: seconds each of the healthy model's streams should run: twice what the other's death takes at most
B_STREAM_S = 2 * (STEP_TIMEOUT_S + 5)
#: tokens of each of the two warm-up streams that measure the healthy model's speed
WARM_TOKENS = 16


def engine_core_pids(server: ServerProcess) -> list[int]:
    """The server's engine core processes, oldest (first model's) first."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read()
        except OSError:
            continue
        if ppid == server.proc.pid and b"kvforge.engine.core" in cmdline:
            pids.append(int(entry))
    return sorted(pids)


class Stream:
    """A streamed completion on its own thread: its chunks' tokens, its finish reason, errors, [DONE]."""

    def __init__(self, server: ServerProcess, model: str, max_tokens: int):
        self.body = {"model": model, "prompt": "Tell me a story.", "max_tokens": max_tokens, "stream": True,
                     "ignore_eos": True, "stream_options": {"include_usage": True}}
        self.url = f"{server.url}/v1/completions"
        self.started = threading.Event()
        self.chunks, self.errors, self.done, self.finish, self.usage = 0, [], False, None, None
        self.ended_at: float | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            with httpx.stream("POST", self.url, json=self.body, timeout=60) as r:
                assert r.status_code == 200, r.read()
                for line in r.iter_lines():
                    if not line.startswith("data: "):
                        continue
                    self.started.set()
                    if line == "data: [DONE]":
                        self.done = True
                        continue
                    event = json.loads(line[6:])
                    if "error" in event:
                        self.errors.append(event["error"])
                    elif event.get("usage"):
                        self.usage = event["usage"]
                    for choice in event.get("choices") or ():
                        self.chunks += 1
                        self.finish = choice.get("finish_reason") or self.finish
        except Exception as exc:  # noqa: BLE001  (recorded: a cut stream fails the test)
            self.errors.append(repr(exc))
        finally:
            self.started.set()
            self.ended_at = time.monotonic()


def b_tokens(server: ServerProcess, model: str) -> int:
    """Tokens for each of two streams of ``model`` to run about B_STREAM_S on this machine (within
    B_TOKENS_MIN..B_TOKENS): its time per token measured on two concurrent warm-up streams. Their first
    token and the HTTP round trip count in that time, so the estimate errs long: the streams asked for
    run at least B_STREAM_S times the share of decoding in the warm-up (most of it)."""
    start = time.monotonic()
    warm = [Stream(server, model, WARM_TOKENS) for _ in range(2)]
    for s in warm:
        s.thread.join(60)
        assert s.done and not s.errors and s.usage["completion_tokens"] == WARM_TOKENS, (s.errors, s.usage)
    per_token = (max(s.ended_at for s in warm) - start) / WARM_TOKENS
    return max(B_TOKENS_MIN, min(B_TOKENS, round(B_STREAM_S / per_token)))


def watch_health(server: ServerProcess, seen: list[int], stop: threading.Event) -> None:
    while not stop.is_set() and server.proc.poll() is None:
        try:
            seen.append(http().get(f"{server.url}/health").status_code)
        except httpx.HTTPError:
            pass
        time.sleep(0.2)


@pytest.fixture(scope="module")
def two_models():
    """``a`` (dummy:tiny) and ``b`` (the default model, slower, so its streams outlast a's death)."""
    s = ServerProcess("--served-model-name", "a", "--model", default_model_path(), "--engine-step-timeout",
                      str(STEP_TIMEOUT_S), "--shutdown-timeout", "60")
    yield s
    s.stop()


def test_a_stalled_model_fails_its_streams_while_the_other_models_streams_finish(two_models):
    a_core, b_core = engine_core_pids(two_models)
    b_model = default_model_path().rstrip("/")
    want = b_tokens(two_models, b_model)
    a_streams = [Stream(two_models, "a", 480) for _ in range(2)]
    for s in a_streams:
        assert s.started.wait(30)
    os.kill(a_core, signal.SIGSTOP)  # a's engine hangs mid-stream
    stopped_at = time.monotonic()
    b_streams = [Stream(two_models, b_model, want) for _ in range(2)]
    seen: list[int] = []
    stop = threading.Event()
    watcher = threading.Thread(target=watch_health, args=(two_models, seen, stop), daemon=True)
    watcher.start()
    try:
        for s in a_streams:
            s.thread.join(STEP_TIMEOUT_S + 10)
            assert s.ended_at is not None and s.ended_at - stopped_at < STEP_TIMEOUT_S + 5
            assert s.done and s.errors and "no progress" in s.errors[0]["message"], (s.errors, s.done)
            assert s.finish is None  # cut by the error, not finished
        dead_at = time.monotonic()
        for s in b_streams:
            s.thread.join(120)
            assert not s.errors, s.errors
            assert s.done and s.finish == "length" and s.usage["completion_tokens"] == want, (s.usage, s.finish)
        assert max(s.ended_at for s in b_streams) > dead_at  # b's streams were open when a died
        assert two_models.proc.wait(60) == 1
    finally:
        stop.set()
        for pid in (a_core, b_core):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    assert 503 in seen, seen
    log = "".join(two_models.log)
    # the server drained (as on SIGTERM), where it used to stop at once and cut b's streams at 5 s
    assert "made no progress" in log and "draining:" in log


def test_a_stalled_idle_engine_turns_health_503_and_the_server_exits_1():
    server = ServerProcess("--engine-step-timeout", str(STEP_TIMEOUT_S))
    try:
        (core,) = engine_core_pids(server)
        assert httpx.get(f"{server.url}/health").status_code == 200
        os.kill(core, signal.SIGSTOP)
        t0 = time.monotonic()
        assert wait_until(lambda: _health(server) == 503, STEP_TIMEOUT_S + 5)
        assert time.monotonic() - t0 > STEP_TIMEOUT_S - 1  # not before the bound
        assert server.proc.wait(30) == 1
        assert wait_until(lambda: not os.path.exists(f"/proc/{core}"), 10)  # the stopped core is killed
    finally:
        server.stop()


def _health(server: ServerProcess) -> int | None:
    try:
        return http().get(f"{server.url}/health").status_code
    except httpx.HTTPError:
        return None
