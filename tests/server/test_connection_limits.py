"""Issue 34, findings 2 and 6: a client without the key cannot tie up the server's memory or descriptors.

One server under ``ulimit -n 1024`` with an API key, a short head deadline and body timeout, and the
default cap on unauthenticated connections (a quarter of the descriptor limit: 256). Every attack is
played on raw sockets, and each test ends by showing that a real request with the key still works.
"""
from __future__ import annotations

import logging
import resource
import socket
import threading
import time

import httpx
import pytest

from conftest import API_KEY, ServerProcess
from kvforge.server.connections import LINGER_S, AcceptErrorLog, default_max_unauthenticated

HEADER_TIMEOUT_S = 2.0
BODY_TIMEOUT_S = 3.0
KEEP_ALIVE_S = 1.0
NOFILE = 1024
AUTH = {"Authorization": f"Bearer {API_KEY}"}


@pytest.fixture(scope="module")
def guarded():
    s = ServerProcess("--api-key", API_KEY, "--header-timeout", str(HEADER_TIMEOUT_S), "--body-timeout",
                      str(BODY_TIMEOUT_S), "--timeout-keep-alive", str(KEEP_ALIVE_S), nofile=NOFILE)
    yield s
    s.stop()


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024


def closed_by_server(sock: socket.socket, timeout: float) -> bool:
    """True once the server has closed ``sock`` (EOF or reset) within ``timeout``; data is read past."""
    sock.settimeout(timeout)
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            if not sock.recv(65536):
                return True
    except ConnectionResetError:
        return True
    except (socket.timeout, TimeoutError):
        return False
    return False


def connect(server: ServerProcess) -> socket.socket:
    return socket.create_connection(("127.0.0.1", server.port), timeout=10)


def still_serves(server: ServerProcess) -> None:
    assert httpx.get(f"{server.url}/health", timeout=5).status_code == 200
    r = httpx.post(f"{server.url}/v1/completions", json={"prompt": "hi", "max_tokens": 3, "ignore_eos": True},
                   headers=AUTH, timeout=30)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3, r.text


def test_silent_and_slow_header_connections_are_closed_at_the_header_timeout(guarded):
    silent = [connect(guarded) for _ in range(20)]
    slow = [connect(guarded) for _ in range(5)]
    t0 = time.monotonic()
    for s in slow:  # a Slowloris head: a line now and then, never the blank line that ends it
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")

    def trickle():
        for i in range(8):
            time.sleep(0.4)
            for s in slow:
                try:
                    s.sendall(f"X-Slow-{i}: y\r\n".encode())
                except OSError:
                    pass

    t = threading.Thread(target=trickle)
    t.start()
    try:
        assert all(closed_by_server(s, HEADER_TIMEOUT_S + 3) for s in silent)
        assert all(closed_by_server(s, HEADER_TIMEOUT_S + 3) for s in slow)
        assert time.monotonic() - t0 < HEADER_TIMEOUT_S + 3
    finally:
        t.join()
        for s in silent + slow:
            s.close()
    still_serves(guarded)


def test_an_idle_kept_alive_connection_is_closed_after_the_keep_alive_timeout(guarded):
    with connect(guarded) as s:
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        assert s.recv(4096).startswith(b"HTTP/1.1 200")
        t0 = time.monotonic()
        assert closed_by_server(s, KEEP_ALIVE_S + 3)
        assert KEEP_ALIVE_S - 0.5 < time.monotonic() - t0 < KEEP_ALIVE_S + 3


def test_a_client_without_the_key_gets_401_before_its_body_is_read(guarded):
    """40 connections each declare 15 MiB and start sending it without the key: each gets its 401 at
    once, the rest of its body is dropped unread, and the server's memory does not grow by the bodies
    (it grew by 577 MiB before, and 8 such bodies waited 10-13 s for their 401)."""
    before = rss_mib(guarded.proc.pid)
    declared = 15 << 20
    head = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {declared}\r\n\r\n".encode())
    first = b'{"prompt": "' + b"x" * (256 << 10)
    socks = [connect(guarded) for _ in range(40)]
    waits = []
    for s in socks:
        s.sendall(head + first)
    for s in socks:
        t0 = time.monotonic()
        s.settimeout(5)
        answer = s.recv(4096)
        waits.append(time.monotonic() - t0)
        assert answer.startswith(b"HTTP/1.1 401"), answer[:200]
    assert max(waits) < 2.0, waits
    for s in socks:  # the rest of the body goes nowhere, and the connection ends within the linger
        rest = declared - len(first)
        try:
            while rest > 0:
                rest -= s.send(b"x" * min(rest, 1 << 20))
        except OSError:
            pass
        assert closed_by_server(s, LINGER_S + KEEP_ALIVE_S + 3)
        s.close()
    assert rss_mib(guarded.proc.pid) - before < 64, (before, rss_mib(guarded.proc.pid))
    still_serves(guarded)


def test_an_official_client_without_the_key_reads_its_401_even_with_a_large_body(guarded):
    """The answer comes before the body is read; the server reads the rest and drops it rather than
    closing at once, which would reset the connection under a client still sending."""
    import openai

    client = openai.OpenAI(base_url=f"{guarded.url}/v1", api_key="wrong", max_retries=0)
    for _ in range(3):
        with pytest.raises(openai.AuthenticationError):
            client.completions.create(model="tiny", prompt="word " * ((2 << 20) // 5), max_tokens=2)


def test_a_body_that_does_not_arrive_in_time_is_a_408_and_closes(guarded):
    with connect(guarded) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  + f"Authorization: Bearer {API_KEY}\r\nContent-Length: 100\r\n\r\n".encode() + b'{"prompt"')
        t0 = time.monotonic()
        s.settimeout(BODY_TIMEOUT_S + 5)
        answer = s.recv(4096)
        waited = time.monotonic() - t0
        while chunk := s.recv(4096):  # to the end: the server closes after its answer
            answer += chunk
        assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
        assert b"--body-timeout" in answer and b"request_timeout" in answer
        assert BODY_TIMEOUT_S - 0.5 < waited < BODY_TIMEOUT_S + 3
    still_serves(guarded)


def test_1100_silent_connections_under_ulimit_1024_leave_the_server_answering(guarded):
    """Before: every descriptor held, /health and completions timed out, 177 MB of log in 25 s. Now past
    the cap (256 here) the oldest waiting connection is closed, so a real client still gets in."""
    log_before = len(guarded.log)
    socks = []
    try:
        for _ in range(1100):
            socks.append(connect(guarded))
        t0 = time.monotonic()
        still_serves(guarded)
        assert time.monotonic() - t0 < HEADER_TIMEOUT_S  # let in by the cap, not by the head deadline
        closed = sum(closed_by_server(s, 0.01) for s in socks)
        assert closed >= 1100 - 256, closed  # the server keeps at most the cap waiting
    finally:
        for s in socks:
            s.close()
    lines = list(guarded.log)[log_before:]
    assert sum("out of system resource" in line for line in lines) <= 10, lines[-20:]
    still_serves(guarded)


def test_the_default_cap_is_a_quarter_of_the_descriptor_limit():
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    assert default_max_unauthenticated() == max(8, min(1024, soft // 4))


def test_accept_errors_under_descriptor_exhaustion_are_logged_once_a_second(caplog):
    """Python 3.11 reports the same accept failure once per queued connection on every retry; the
    handler folds them into one line a second."""
    seen = []
    handler = AcceptErrorLog(lambda loop, context: seen.append(context))
    context = {"message": "socket.accept() out of system resource", "exception": OSError(24, "Too many open files")}
    with caplog.at_level(logging.ERROR, logger="kvforge.server"):
        for _ in range(12_000):
            handler(None, context)
        handler(None, {"message": "something else"})
    lines = [r for r in caplog.records if "cannot accept connections" in r.getMessage()]
    assert len(lines) == 1 and handler.folded == 11_999
    assert seen == [{"message": "something else"}]  # other errors go to the handler it replaced
    handler._last -= AcceptErrorLog.PERIOD_S
    with caplog.at_level(logging.ERROR, logger="kvforge.server"):
        handler(None, context)
    assert "11999 more such errors" in caplog.records[-1].getMessage()
