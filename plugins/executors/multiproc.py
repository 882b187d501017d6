"""``mp``: the ranks other than the driver run in processes spawned on this node.

Each rank is a fresh ``python -m kvforge.plugins.executors.rank_process`` (never a re-import of the
user's script, so no ``if __name__ == "__main__"`` guard is needed), connected back over loopback with
a random key. They speak the typed messages of ``kvforge.rank.messages``. Each step's ``StepInput`` is
packed (``kvforge.rank.step_codec``), pickled once and written once into a ring in shared memory that
every rank reads (``shm_broadcast``; a message too large for a chunk goes over each rank's connection,
as the answers do); the ranks answer nothing (their results are the driver's too, and the collectives keep them in step). Calls on
every rank (``collective_rpc``: sizing the KV cache, capturing graphs) are answered. A monitor thread
watches every process: one that dies makes :meth:`check_health` raise ``WorkerFailure`` naming it,
and a step that fails because a rank is gone raises the same (docs/distributed.md, Failures).

NOTE: a remote rank never waits for its device. Its staging buffers alternate like the driver's and
are safe for the same reason: the driver sends step N + 2 only after step N's results arrived, and
those came after step N's collectives, which every rank's stream reaches only after its copies.
"""
from __future__ import annotations

import dataclasses
import logging
import multiprocessing.connection
import os
import pickle
import signal
import subprocess
import sys
import threading
import time
import weakref
from typing import Any, Callable

import torch

from kvforge.errors import is_device_error
from kvforge.plugins.executors.shm_broadcast import CHUNK_BYTES, SPIN_S, RingAddress, ShmBroadcast
from kvforge.rank.executor import Executor, WorkerFailure, check_calls, free_port, start_driver, stop_processes
from kvforge.rank.messages import CallDone, FailedCall, RankCall, RankFailed, RankReady, RankReply, StopRank, as_call
from kvforge.rank.step_codec import StepEncoder
from kvforge.rank.step_input import ForwardOutput, StepInput
from kvforge.rank.worker import Worker
from kvforge.rank.worker_spec import WorkerSpec

logger = logging.getLogger(__name__)

#: seconds a failing step waits for the process monitor to name the rank that is gone
FAILURE_GRACE_S = 5.0
#: seconds shutdown waits for the ring to take the ranks' stop message
STOP_WAIT_S = 2.0


class MultiprocExecutor(Executor):
    name = "mp"
    typed_calls = True
    #: the ring's chunk size: a message larger than this goes over the ranks' connections
    ring_chunk_bytes = CHUNK_BYTES

    def __init__(self, spec: WorkerSpec):
        if spec.init_method is None:
            spec = dataclasses.replace(spec, init_method=f"tcp://127.0.0.1:{free_port()}")
        super().__init__(spec)
        self._closing = False
        self._lock = threading.Lock()  # one pipe conversation at a time
        self.errors: dict[int, str] = {}  # rank -> what it reported before it went
        self._early: dict[int, RankReply] = {}  # rank -> a reply read before it was asked for (its RankReady)
        self._steps = StepEncoder()  # NOTE: every rank gets every step it packs, in order
        if spec.config.torch_device.type == "cuda":
            base = spec.config.torch_device.index or 0
            if base + spec.world_size > torch.cuda.device_count():
                raise WorkerFailure(
                    f"rank {spec.world_size - 1} cannot start: {spec.world_size} ranks from cuda:{base} need "
                    f"{base + spec.world_size} GPUs on this node, it has {torch.cuda.device_count()} "
                    "(across nodes use distributed_executor_backend='ray')")
        self.procs: dict[int, subprocess.Popen] = {}
        self.conns: dict[int, multiprocessing.connection.Connection] = {}
        others = [r for r in range(spec.world_size) if r != spec.driver_rank]
        self._ring = ShmBroadcast.create(readers=len(others), chunk_bytes=self.ring_chunk_bytes)
        # NOTE: the CPU device's ranks share the node's cores with the computation: they never spin
        spin_s = SPIN_S if spec.config.torch_device.type == "cuda" else 0.0
        self._addresses = {r: RingAddress(self._ring.name, len(others), i, chunk_bytes=self.ring_chunk_bytes, spin_s=spin_s) for i, r in enumerate(others)}
        key = os.urandom(16)
        self._listener = multiprocessing.connection.Listener(("127.0.0.1", 0), authkey=key)
        env = dict(os.environ, KVFORGE_RANK_AUTHKEY=key.hex())
        host, port = self._listener.address
        for rank in range(spec.world_size):
            if rank != spec.driver_rank:
                self.procs[rank] = subprocess.Popen(
                    [sys.executable, "-m", "kvforge.plugins.executors.rank_process", host, str(port), str(rank)], env=env)
        self._finalizer = weakref.finalize(self, _release, list(self.procs.values()), self._ring)
        try:
            self._connect()
            self.driver = self._start_driver()
            for rank in self.conns:  # each rank's RankReady once its model is built
                if not isinstance(ready := self._reply(rank), RankReady):
                    raise WorkerFailure(f"rank {rank} started with {type(ready).__name__}, not RankReady")
        except BaseException:
            self.shutdown()
            raise
        self._monitor = threading.Thread(target=self._watch, name="kvforge-rank-monitor", daemon=True)
        self._monitor.start()
        logger.info("mp executor: %d ranks (driver rank %d in process %d, others %s)", spec.world_size,
                    spec.driver_rank, os.getpid(), {r: p.pid for r, p in self.procs.items()})

    # -- starting --------------------------------------------------------------------------------
    def _connect(self) -> None:
        """Accept every rank's connection and send it the spec (a rank that dies first ends the wait)."""
        accepted: dict[int, multiprocessing.connection.Connection] = {}
        failed: list[BaseException] = []

        def accept() -> None:
            try:
                while len(accepted) < len(self.procs):
                    conn = self._listener.accept()
                    rank = conn.recv()
                    conn.send(self.spec)
                    conn.send(self._addresses[rank])
                    accepted[rank] = conn
            except (OSError, EOFError) as exc:
                failed.append(exc)

        thread = threading.Thread(target=accept, name="kvforge-rank-accept", daemon=True)
        thread.start()
        deadline = time.monotonic() + self.spec.init_timeout_s
        while thread.is_alive():
            thread.join(timeout=0.1)
            for rank, proc in self.procs.items():
                if rank not in accepted and proc.poll() is not None:
                    raise WorkerFailure(self.describe(rank, "failed to start"))
            if time.monotonic() > deadline:
                missing = sorted(set(self.procs) - set(accepted))
                raise WorkerFailure(f"rank {missing[0]} did not connect within {self.spec.init_timeout_s:.0f} s")
        if failed:
            raise WorkerFailure(f"accepting the ranks' connections failed: {failed[0]!r}")
        self.conns = {r: accepted[r] for r in sorted(self.procs)}
        self._listener.close()

    def _start_driver(self) -> Worker:
        """Build the driver worker while watching the other ranks: one that fails to start ends the
        wait at once with its error. (Every rank's "ready" is read afterwards, by ``_reply``.)"""
        def watch() -> bool:
            for rank, conn in self.conns.items():
                if self.procs[rank].poll() is not None or (conn.poll() and self._peek_error(rank)):
                    raise WorkerFailure(self.describe(rank, "failed to start"))
            return True
        return start_driver(self.spec, watch)

    def _peek_error(self, rank: int) -> bool:
        """Read a message a rank sent unasked: True if it was an error (kept in ``errors``)."""
        msg: RankReply = self.conns[rank].recv()
        if isinstance(msg, RankFailed):
            self.errors[rank] = msg.message
            return True
        self._early[rank] = msg  # a reply that came before we asked (the rank's RankReady)
        return False

    # -- calls -----------------------------------------------------------------------------------
    def collective_rpc(self, call: RankCall[Any] | str, *args: Any, **kwargs: Any) -> list[Any]:
        rank_call = as_call(call, args, kwargs)
        payload = pickle.dumps(rank_call, protocol=pickle.HIGHEST_PROTOCOL)
        with self._lock:
            self._send_all(payload)
            mine: Any = None
            driver_error: Exception | None = None
            try:
                mine = rank_call.apply(self.driver)
            except Exception as exc:
                if is_device_error(exc):
                    raise self._failure(exc) from exc
                driver_error = exc
            # NOTE: every rank's answer is read, even after a failure: an unread one would answer the next call
            results: dict[int, Any] = {rank: self._answer(rank) for rank in self.conns}
        if driver_error is not None:  # the driver's own error, as it was raised (a ValueError stays one)
            raise driver_error
        results[self.spec.driver_rank] = mine
        return check_calls(rank_call.name, results)

    def execute_model(self, step: StepInput, prev_tokens: torch.Tensor | None = None,
                      prompt_sink: Callable[[int, torch.Tensor], None] | None = None) -> ForwardOutput | None:
        with self._lock:  # NOTE: the encoder's order is the ranks' order: pack and send under one lock
            self._send_all(pickle.dumps(self._steps.encode(step), protocol=pickle.HIGHEST_PROTOCOL))
        try:
            return self.driver.execute(step, prev_tokens, prompt_sink)
        except Exception as exc:
            raise self._failure(exc) from exc

    def _send_all(self, payload: bytes, check: Callable[[], None] | None = None) -> None:
        """Every rank's next message: into the ring, or (too large for a chunk) after its marker, on each
        rank's connection."""
        if self._ring.write(payload, check or self.check_health):
            return
        for conn in self.conns.values():
            try:
                conn.send_bytes(payload)
            except (BrokenPipeError, ConnectionError, OSError) as exc:
                raise self._failure(exc) from exc

    def _answer(self, rank: int) -> object:
        """Rank's answer to a call: its result, or the ``FailedCall`` (the call failed, the rank lives on)."""
        reply = self._reply(rank)
        if isinstance(reply, CallDone):
            return reply.value
        if isinstance(reply, FailedCall):
            return reply
        raise WorkerFailure(f"rank {rank} answered a call with {type(reply).__name__}")

    def _reply(self, rank: int) -> RankReply:
        """Wait for rank's next message, or for its death (never forever); ``WorkerFailure`` for ``RankFailed``."""
        msg: RankReply | None = self._early.pop(rank, None)
        conn, proc = self.conns[rank], self.procs[rank]
        while msg is None:
            if conn.poll(1.0):
                try:
                    msg = conn.recv()
                except (EOFError, OSError):
                    raise WorkerFailure(self.describe(rank)) from None
            elif proc.poll() is not None:  # the process ended with nothing more to say
                raise WorkerFailure(self.describe(rank))
        if isinstance(msg, RankFailed):
            self.errors[rank] = msg.message
            raise WorkerFailure(self.describe(rank, "failed"))
        return msg

    # -- failures --------------------------------------------------------------------------------
    def describe(self, rank: int, what: str = "died") -> str:
        proc = self.procs[rank]
        try:
            code = proc.wait(timeout=0.5)
        except subprocess.TimeoutExpired:
            code = None
        if code is None:
            how = "still running"
        elif code < 0:
            how = f"killed by {signal.Signals(-code).name}"
        else:
            how = f"exit code {code}"
        cause = self.errors.get(rank)
        conn = self.conns.get(rank)
        if cause is None and conn is not None and conn.poll():
            try:
                msg = conn.recv()
                cause = msg.message if isinstance(msg, RankFailed) else None
            except (EOFError, OSError):
                pass
        detail = f": {cause}" if cause else ""
        return f"rank {rank} (pid {proc.pid}) {what} ({how}){detail}"

    def _dead_rank(self, wait_s: float) -> int | None:
        deadline = time.monotonic() + wait_s
        while True:
            for rank, proc in self.procs.items():
                if proc.poll() is not None or rank in self.errors:
                    return rank
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.05)

    def _failure(self, exc: BaseException) -> BaseException:
        """The error to raise for a failed call: the rank that is gone, if one is, else ``exc`` itself."""
        if isinstance(exc, WorkerFailure):
            return exc
        rank = self._dead_rank(FAILURE_GRACE_S)
        if rank is None:
            return exc
        return WorkerFailure(f"{self.describe(rank)}; the step failed with {type(exc).__name__}: {exc}")

    def check_health(self) -> None:
        rank = self._dead_rank(0.0)
        if rank is not None:
            raise WorkerFailure(self.describe(rank))

    def step_watch(self) -> Callable[[], None] | None:
        return self.check_health  # a poll of each rank's process

    def _watch(self) -> None:
        """Log the first rank that goes (the engine finds out through check_health or a failed step)."""
        while not self._closing:
            for rank, proc in self.procs.items():
                if proc.poll() is not None:
                    if not self._closing:
                        logger.error("%s", self.describe(rank))
                    return
            time.sleep(0.5)

    def shutdown(self) -> None:
        if self._closing:
            return
        self._closing = True
        if self.conns:
            deadline = time.monotonic() + STOP_WAIT_S

            def in_time() -> None:  # a rank that is alive but stuck must not hold the shutdown
                self.check_health()
                if time.monotonic() > deadline:
                    raise TimeoutError("a rank did not take its messages")
            try:
                self._send_all(pickle.dumps(StopRank()), in_time)
            except (WorkerFailure, TimeoutError):
                pass  # stop_processes ends it
        # NOTE: the driver leaves its groups while the other ranks leave theirs (each abort is bounded)
        if getattr(self, "driver", None) is not None:
            self.driver.close()
        stop_processes(list(self.procs.values()))
        self._listener.close()
        for conn in self.conns.values():
            conn.close()
        self._ring.close()


def _release(procs: list[subprocess.Popen], ring: ShmBroadcast) -> None:
    """What an executor dropped without ``shutdown`` leaves: its processes and its ring."""
    stop_processes(procs)
    ring.close()
