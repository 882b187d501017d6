"""The executor contract: how the engine reaches its workers (docs/distributed.md).

An executor builds one ``Worker`` per rank from a ``WorkerSpec``. The driver worker (the first
tensor-parallel rank of the last pipeline stage) lives in the engine process; the others are
wherever the executor puts them (spawned processes, Ray actors, ...). Each step the engine calls
:meth:`Executor.execute_model` once: the executor hands the same ``StepInput`` to every rank and
returns the driver's ``ForwardOutput``. Executors are plugin components (``register_executors``),
selected by ``distributed_executor_backend``; ``uni`` (one rank, in process) is built in here.
"""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from abc import ABC, abstractmethod
from typing import Any, Callable

import torch

from kvforge.rank.step_input import StepInput
from kvforge.rank.worker import ForwardOutput, Worker, WorkerSpec


class WorkerFailure(RuntimeError):
    """A rank died, failed to start or raised: the engine cannot go on. The message names the rank."""


class RankCallError(RuntimeError):
    """A ``collective_rpc`` call raised on a rank for a reason that is not the device's (``is_device_error``
    is false): the call failed, the rank lives on and the engine with it. The message names the rank."""


class FailedCall:
    """A rank's answer to a call that raised for a reason that is not the device's (executors carry it
    back as a value, so that the rank lives on); :func:`check_calls` raises it as ``RankCallError``."""

    def __init__(self, message: str):
        self.message = message

    @classmethod
    def of(cls, exc: BaseException) -> "FailedCall":
        return cls(f"{type(exc).__name__}: {exc}")


def check_calls(method: str, results: dict[int, Any]) -> list[Any]:
    """Every rank's result of ``method`` in rank order; ``RankCallError`` naming the first rank that failed."""
    for rank in sorted(results):
        if isinstance(results[rank], FailedCall):
            raise RankCallError(f"rank {rank}: {method} failed: {results[rank].message}")
    return [results[r] for r in sorted(results)]


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

    @abstractmethod
    def collective_rpc(self, method: str, *args: Any, **kwargs: Any) -> list[Any]:
        """Call ``Worker.<method>(*args, **kwargs)`` on every rank at once; their results, rank order."""

    @abstractmethod
    def execute_model(self, step: StepInput, prev_tokens: torch.Tensor | None = None,
                      prompt_sink: Callable[[int, torch.Tensor], None] | None = None) -> ForwardOutput | None:
        """Run one step on every rank; the driver's output (None for a step without a batch)."""

    def check_health(self) -> None:
        """Raise ``WorkerFailure`` if a rank is gone (one rank in process: never)."""
        return None

    def shutdown(self) -> None:
        """Stop every rank; nothing is left running. Idempotent. (Nothing to stop in process: the driver
        worker's memory is given back by ``LLMEngine.release``.)"""
        return None


class UniExecutor(Executor):
    """One rank: the driver worker, in the engine process."""

    name = "uni"
    supports_multiple_ranks = False

    def __init__(self, spec: WorkerSpec):
        super().__init__(spec)
        if spec.world_size != 1:
            raise ValueError(f"distributed_executor_backend='uni' runs one rank; tensor_parallel_size x "
                             f"pipeline_parallel_size is {spec.world_size}: use 'mp' or 'ray'")
        self.driver = Worker(spec, 0)

    def collective_rpc(self, method: str, *args: Any, **kwargs: Any) -> list[Any]:
        return [getattr(self.driver, method)(*args, **kwargs)]

    def execute_model(self, step: StepInput, prev_tokens: torch.Tensor | None = None,
                      prompt_sink: Callable[[int, torch.Tensor], None] | None = None) -> ForwardOutput | None:
        return self.driver.execute(step, prev_tokens, prompt_sink)


#: written by ``ray start`` while a Ray cluster runs on this node (removed by ``ray stop``)
RAY_CLUSTER_FILE = "/tmp/ray/ray_current_cluster"


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
    """vLLM's rule: ``uni`` for one rank; ``ray`` when a Ray cluster is already running (this process is
    connected to one, ``RAY_ADDRESS`` is set, or ``ray start`` ran on this node) or the world is larger
    than this node's devices; else ``mp``."""
    if world_size == 1:
        return "uni"
    if os.environ.get("RAY_ADDRESS") or _ray_initialized() or os.path.exists(RAY_CLUSTER_FILE):
        return "ray"
    if device.type == "cuda" and world_size > torch.cuda.device_count():
        return "ray"
    return "mp"


def _ray_initialized() -> bool:
    ray = sys.modules.get("ray")  # imported only if the user already uses Ray
    return ray is not None and ray.is_initialized()
