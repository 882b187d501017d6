"""The typed messages between the driver (the executor, in the engine process) and its other ranks.

Each message is a frozen, slotted dataclass; a rank dispatches on its type, never on a string. A call
the driver makes on every rank (``Executor.call``, ``Executor.collective_rpc``) is a :class:`RankCall`
of its own type whose ``apply(worker)`` runs it, so no method name travels and a rank can run nothing
but these types. The ``mp`` executor pickles them over its connections, the ``ray`` executor hands them
to its actors.

Driver -> rank: :class:`ExecuteStep` every step (``kvforge.rank.step_codec``: no answer), a
:class:`RankCall` (answered), :class:`StopRank`. Rank -> driver: :class:`RankReady` once its worker is
built, then :class:`CallDone` or :class:`FailedCall` for every call, and :class:`RankFailed` just
before a rank that failed exits.

A call is also a ``Worker`` method's name and arguments (:meth:`RankCall.as_method`): executors written
before typed calls take names in ``collective_rpc``, and :class:`CallMethod` carries a name that such
an executor (or a test) passes on.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any, ClassVar, Generic, TypeVar

from kvforge.errors import is_device_error
from kvforge.rank.step_codec import ExecuteStep

if TYPE_CHECKING:
    from kvforge.lora.request import LoRARequest
    from kvforge.rank.worker import Worker

R = TypeVar("R")


class RankCall(ABC, Generic[R]):
    """A call on every rank's ``Worker``, returning an ``R`` from each. Subclasses are frozen dataclasses."""

    __slots__ = ()
    __dataclass_fields__: ClassVar[dict[str, Any]]  # every subclass is a dataclass
    #: the ``Worker`` method ``apply`` calls, its fields being that method's keyword arguments
    worker_method: ClassVar[str] = ""

    @abstractmethod
    def apply(self, worker: Worker) -> R:
        """Run the call on one rank's worker."""

    @property
    def name(self) -> str:
        """What errors name the call by (``rank 1: add_lora failed: ...``)."""
        return self.worker_method

    def as_method(self) -> tuple[str, tuple[object, ...], dict[str, object]]:
        """The call as the method name and arguments of the string form (executors written for names)."""
        return self.worker_method, (), {f.name: getattr(self, f.name) for f in fields(self)}


# -- the calls: each runs one Worker method ------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class DetermineNumBlocks(RankCall[int]):
    """KV blocks the rank can hold (the engine takes the fewest)."""

    worker_method = "determine_num_blocks"
    num_blocks_override: int | None
    kv_cache_memory_gib: float | None
    gpu_memory_utilization: float
    max_num_batched_tokens: int
    max_num_seqs: int
    max_model_len: int

    def apply(self, worker: Worker) -> int:
        return worker.determine_num_blocks(
            num_blocks_override=self.num_blocks_override, kv_cache_memory_gib=self.kv_cache_memory_gib,
            gpu_memory_utilization=self.gpu_memory_utilization, max_num_batched_tokens=self.max_num_batched_tokens,
            max_num_seqs=self.max_num_seqs, max_model_len=self.max_model_len)


@dataclass(frozen=True, slots=True)
class InitializeCache(RankCall[None]):
    worker_method = "initialize_cache"
    num_blocks: int
    max_num_batched_tokens: int
    max_num_seqs: int
    max_model_len: int

    def apply(self, worker: Worker) -> None:
        return worker.initialize_cache(self.num_blocks, self.max_num_batched_tokens, self.max_num_seqs,
                                       self.max_model_len)


@dataclass(frozen=True, slots=True)
class CaptureCudaGraphs(RankCall[float]):
    """Capture the CUDA graphs (every rank the same, in the same order); the seconds it took."""

    worker_method = "capture_cuda_graphs"
    max_num_seqs: int
    max_model_len: int
    query_lens: tuple[int, ...] = (1,)
    decode: bool = True  # uniform steps' graphs (the attention backend supports them)
    piecewise_tokens: int = 0  # mixed steps' piecewise graphs up to this many tokens (0: none)

    def apply(self, worker: Worker) -> float:
        return worker.capture_cuda_graphs(self.max_num_seqs, self.max_model_len, self.query_lens,
                                          self.decode, self.piecewise_tokens)


@dataclass(frozen=True, slots=True)
class InitializeKVTier(RankCall[list[int]]):
    """Build the stores of the KV tiers of prefix-cached blocks (``kvforge.kv_tier``), the connectors
    ``connectors`` in chain order; each one's number of slots."""

    worker_method = "initialize_kv_tier"
    connectors: tuple[str, ...]

    def apply(self, worker: Worker) -> list[int]:
        return worker.initialize_kv_tier(self.connectors)


@dataclass(frozen=True, slots=True)
class InitializeSwapSpace(RankCall[int]):
    """Size the CPU swap pool; its number of blocks."""

    worker_method = "initialize_swap_space"
    swap_space_gib: float

    def apply(self, worker: Worker) -> int:
        return worker.initialize_swap_space(self.swap_space_gib)


@dataclass(frozen=True, slots=True)
class BatchState(RankCall[dict[str, int]]):
    """The rank's persistent batch: ``{"requests": ..., "blocks": ...}``."""

    worker_method = "batch_state"

    def apply(self, worker: Worker) -> dict[str, int]:
        return worker.batch_state()


@dataclass(frozen=True, slots=True)
class StartProfile(RankCall[None]):
    worker_method = "start_profile"

    def apply(self, worker: Worker) -> None:
        return worker.start_profile()


@dataclass(frozen=True, slots=True)
class StopProfile(RankCall[str]):
    """Stop the trace (written to ``trace_dir/rank<r>.json`` if given); the rank's busiest operations."""

    worker_method = "stop_profile"
    trace_dir: str | None = None

    def apply(self, worker: Worker) -> str:
        return worker.stop_profile(self.trace_dir)


@dataclass(frozen=True, slots=True)
class AddLora(RankCall[str | None]):
    """Load an adapter into the rank's host memory; the problem as text if it is bad."""

    worker_method = "add_lora"
    request: LoRARequest

    def apply(self, worker: Worker) -> str | None:
        return worker.add_lora(self.request)


@dataclass(frozen=True, slots=True)
class RemoveLora(RankCall[bool]):
    worker_method = "remove_lora"
    lora_int_id: int

    def apply(self, worker: Worker) -> bool:
        return worker.remove_lora(self.lora_int_id)


@dataclass(frozen=True, slots=True)
class CallMethod(RankCall[Any]):
    """A ``Worker`` method by name: the string form of ``collective_rpc`` (plugins, tests). The only
    message that carries a method name; its result is whatever that method returns."""

    method_name: str
    args: tuple[Any, ...] = ()
    kwargs: dict[str, Any] = field(default_factory=dict)

    def apply(self, worker: Worker) -> Any:
        return getattr(worker, self.method_name)(*self.args, **self.kwargs)

    @property
    def name(self) -> str:
        return self.method_name

    def as_method(self) -> tuple[str, tuple[object, ...], dict[str, object]]:
        return self.method_name, self.args, self.kwargs


def as_call(call: RankCall[R] | str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> RankCall[R] | CallMethod:
    """``collective_rpc``'s arguments as one call: a typed call as it is, a name as a :class:`CallMethod`."""
    if isinstance(call, str):
        return CallMethod(call, args, kwargs)
    if args or kwargs:
        raise TypeError(f"collective_rpc({type(call).__name__}(...)) takes no further arguments: they are the "
                        "call's fields")
    return call


# -- driver -> rank, besides the calls ------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class StopRank:
    """Close the worker and exit."""


# -- rank -> driver -------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class RankReady:
    """The rank's worker is built: what ``Worker.ready()`` says of it."""

    info: dict[str, Any]


@dataclass(frozen=True, slots=True)
class CallDone(Generic[R]):
    """A call's result on one rank."""

    value: R


@dataclass(frozen=True, slots=True)
class FailedCall:
    """A call that raised on a rank for a reason that is not the device's: the rank lives on, and the
    driver raises ``RankCallError`` naming the rank (``kvforge.rank.executor.check_calls``)."""

    message: str  # "<exception type>: <text>"
    rank: int | None = None

    @classmethod
    def of(cls, exc: BaseException, rank: int | None = None) -> FailedCall:
        return cls(f"{type(exc).__name__}: {exc}", rank)


@dataclass(frozen=True, slots=True)
class RankFailed:
    """The rank failed (to start, in a step, or on its device) and exits: the engine cannot go on."""

    message: str


#: what the driver sends a rank (``ExecuteStep`` is defined with its codec, ``kvforge.rank.step_codec``)
RankMessage = ExecuteStep | RankCall[Any] | StopRank
#: what a rank sends the driver
RankReply = RankReady | CallDone[Any] | FailedCall | RankFailed


def answer(call: RankCall[R], worker: Worker, rank: int) -> CallDone[R] | FailedCall:
    """Run ``call`` on a rank other than the driver. NOTE: only a device-level error (``is_device_error``)
    escapes, to end the rank; anything else a call raises is its caller's to report (``RankCallError``)."""
    try:
        return CallDone(call.apply(worker))
    except Exception as exc:
        if is_device_error(exc):
            raise
        return FailedCall.of(exc, rank)
