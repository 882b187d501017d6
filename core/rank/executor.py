"""The executor contract: how the engine reaches its workers (docs/distributed.md).

An executor builds one ``Worker`` per rank from a ``WorkerSpec``. The driver worker (the first
tensor-parallel rank of the last pipeline stage) lives in the engine process; the others are
wherever the executor puts them (spawned processes, Ray actors, ...). Each step the engine calls
:meth:`Executor.execute_model` once: the executor hands the same ``StepInput`` to every rank and
returns the driver's ``ForwardOutput``. Other calls on every rank are typed messages
(``kvforge.rank.messages``), run by :meth:`Executor.call`. Executors are plugin components
(``register_executors``), selected by ``distributed_executor_backend``; ``uni`` (one rank, in
process) is built in here.
"""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from abc import ABC, abstractmethod
from typing import Any, Callable, Mapping, TypeVar, overload

import torch

from kvforge.rank.messages import FailedCall, RankCall, as_call  # FailedCall: also found here
from kvforge.rank.step_input import ForwardOutput, StepInput
from kvforge.rank.worker import Worker
from kvforge.rank.worker_spec import WorkerSpec

R = TypeVar("R")


class WorkerFailure(RuntimeError):
    """A rank died, failed to start or raised: the engine cannot go on. The message names the rank."""


class RankCallError(RuntimeError):
    """A call on every rank raised on a rank for a reason that is not the device's (``is_device_error``
    is false): the call failed, the rank lives on and the engine with it. The message names the rank."""


def check_calls(name: str, results: Mapping[int, R | FailedCall]) -> list[R]:
    """Every rank's result of the call ``name`` in rank order; ``RankCallError`` naming the first rank that failed."""
    out: list[R] = []
    for rank in sorted(results):
        result = results[rank]
        if isinstance(result, FailedCall):
            raise RankCallError(f"rank {rank}: {name} failed: {result.message}")
        out.append(result)
    return out


def takes_typed_calls(cls: type) -> bool:
    """Whether the ``collective_rpc`` of executor class ``cls`` takes typed calls: the class that defines
    it (the first in the MRO) says so in its own body (``typed_calls = True``). One that does not was
    written for method names (before typed calls, as the dummy plugin's ``CountingExecutor``, which
    records them) and is handed names."""
    for klass in cls.__mro__:
        if "collective_rpc" in vars(klass):
            return bool(vars(klass).get("typed_calls", False))
    return False


class Executor(ABC):
    """Owns the ranks of one engine. Subclasses set ``driver`` (the in-process driver ``Worker``)."""

    name: str = ""
    #: whether it can run a world larger than one rank
    supports_multiple_ranks: bool = True

    def __init__(self, spec: WorkerSpec):
        self.spec = spec
        self.driver: Worker

    @property
    def world_size(self) -> int:
        return self.spec.world_size

    @overload
    def collective_rpc(self, call: RankCall[R]) -> list[R]: ...
    @overload
    def collective_rpc(self, call: str, *args: Any, **kwargs: Any) -> list[Any]: ...
    @abstractmethod
    def collective_rpc(self, call: RankCall[Any] | str, *args: Any, **kwargs: Any) -> list[Any]:
        """Run ``call`` on every rank at once: a typed call (``kvforge.rank.messages``), or the name of a
        ``Worker`` method and its arguments (the string form, kept for plugins: ``as_call`` makes it a
        ``CallMethod``). Their results in rank order; ``RankCallError`` (``check_calls``) when it raised on a
        rank other than the driver for a reason that is not the device's, the driver's own error as raised.

        A subclass that defines this for typed calls sets ``typed_calls = True`` in its class body
        (:func:`takes_typed_calls`)."""

    def call(self, rank_call: RankCall[R]) -> list[R]:
        """Run a typed call on every rank; their results in rank order. The engine's calls come here: it
        hands ``collective_rpc`` the call itself, or its method name and arguments (``as_method``) when
        that ``collective_rpc`` was written for names (:func:`takes_typed_calls`)."""
        if takes_typed_calls(type(self)):
            return self.collective_rpc(rank_call)
        name, args, kwargs = rank_call.as_method()
        return self.collective_rpc(name, *args, **kwargs)

    @abstractmethod
    def execute_model(self, step: StepInput, prev_tokens: torch.Tensor | None = None,
                      prompt_sink: Callable[[int, torch.Tensor], None] | None = None) -> ForwardOutput | None:
        """Run one step on every rank; the driver's output (None for a step without a batch)."""

    def check_health(self) -> None:
        """Raise ``WorkerFailure`` if a rank is gone (one rank in process: never)."""
        return None

    def step_watch(self) -> Callable[[], None] | None:
        """A check cheap enough to call ten times a second while the driver waits for a step on the
        device, raising ``WorkerFailure`` if a rank is gone (a step whose collectives wait for a dead
        peer never ends); None where there is none (one rank; an executor whose health check is a
        round trip to the ranks)."""
        return None

    def shutdown(self) -> None:
        """Stop every rank; nothing is left running. Idempotent. (Nothing to stop in process: the driver
        worker's memory is given back by ``LLMEngine.release``.)"""
        return None


class UniExecutor(Executor):
    """One rank: the driver worker, in the engine process."""

    name = "uni"
    supports_multiple_ranks = False
    typed_calls = True

    def __init__(self, spec: WorkerSpec):
        super().__init__(spec)
        if spec.world_size != 1:
            raise ValueError(f"distributed_executor_backend='uni' runs one rank; tensor_parallel_size x "
                             f"pipeline_parallel_size is {spec.world_size}: use 'mp' or 'ray'")
        self.driver = Worker(spec, 0)

    def collective_rpc(self, call: RankCall[Any] | str, *args: Any, **kwargs: Any) -> list[Any]:
        return [as_call(call, args, kwargs).apply(self.driver)]

    def execute_model(self, step: StepInput, prev_tokens: torch.Tensor | None = None,
                      prompt_sink: Callable[[int, torch.Tensor], None] | None = None) -> ForwardOutput | None:
        return self.driver.execute(step, prev_tokens, prompt_sink)


def start_driver(spec: WorkerSpec, watch: Callable[[], bool]) -> Worker:
    """Build the driver ``Worker`` (joining the ranks' rendezvous, loading its shard) in a thread, calling
    ``watch()`` every 0.1 s meanwhile and until it returns True: it raises ``WorkerFailure`` for a remote
    rank that failed to start, so the wait ends at once instead of at the rendezvous timeout."""
    built: dict[str, Any] = {}

    def build() -> None:
        try:
            built["worker"] = Worker(spec, spec.driver_rank)
        except BaseException as exc:
            built["error"] = exc

    thread = threading.Thread(target=build, name="kvforge-driver-init", daemon=True)
    thread.start()
    settled = False
    while thread.is_alive() or not settled:
        thread.join(timeout=0.1)
        settled = watch()
        if "error" in built:
            exc = built["error"]
            raise WorkerFailure(f"rank {spec.driver_rank} (the driver) failed to start: "
                                f"{type(exc).__name__}: {exc}") from exc
        if not thread.is_alive() and not settled:
            time.sleep(0.05)
    return built["worker"]


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` now (for the ranks' rendezvous)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def stop_processes(procs: list[subprocess.Popen], grace_s: float = 5.0) -> None:
    """Wait up to ``grace_s`` for the processes to end by themselves; terminate, then kill, whatever is
    still running (never leaves one behind)."""
    deadline = time.monotonic() + grace_s
    for proc in procs:
        for stop in (None, proc.terminate, proc.kill):
            if stop is not None:
                stop()
            try:
                proc.wait(timeout=max(0.5, deadline - time.monotonic()) if stop is None else 2.0)
                break
            except subprocess.TimeoutExpired:
                continue


def default_backend(world_size: int, device: torch.device) -> str:
    """vLLM's rule: ``uni`` for one rank; ``ray`` when this process is told to use Ray (it is connected to a
    cluster, or ``RAY_ADDRESS`` names one) or the world is larger than this node's devices; else ``mp``.
    A cluster merely running on the node (``ray start``, another program's ``ray.init``) does not choose
    Ray: its address file outlives a crashed cluster, and another user's cluster is not this engine's."""
    if world_size == 1:
        return "uni"
    if os.environ.get("RAY_ADDRESS") or _ray_initialized():
        return "ray"
    if device.type == "cuda" and world_size > torch.cuda.device_count():
        return "ray"
    return "mp"


def _ray_initialized() -> bool:
    ray = sys.modules.get("ray")  # imported only if the user already uses Ray
    return ray is not None and ray.is_initialized()
