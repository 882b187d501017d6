"""``EngineClient``: what a front end (the OpenAI server) needs of an engine, and all it may use.

Three front ends implement it: ``AsyncLLMEngine`` (the engine loop on a thread of this process),
``EngineProcessClient`` (the engine core in a process of its own, ``kvforge serve``'s default) and
``DataParallelEngine`` (replicas as Ray actors). The server is typed against this protocol only
(``server/app.py``, ``server/openai_api.py``), so a fourth front end needs nothing else.
``tests/core/test_engine_client.py`` holds each front end to it.
"""
from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any, AsyncIterator, Protocol, runtime_checkable

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from kvforge.config import EngineConfig
    from kvforge.engine.stats import EngineStats
    from kvforge.kv_events import KVEventPage
    from kvforge.lora.request import LoRARequest
    from kvforge.model.loader import ModelSource
    from kvforge.outputs import RequestOutput
    from kvforge.sampling_params import SamplingParams, StructuredOutputsParams


@runtime_checkable
class EngineClient(Protocol):
    """An engine behind a front end. Facts are read-only; calls are thread-safe unless said otherwise."""

    #: why the engine stopped (None while it runs)
    error: BaseException | None
    #: set once the engine has died (a crash, a rank lost, a stall): the server drains and exits 1
    dead: threading.Event

    @property
    def config(self) -> EngineConfig:
        """The engine's options."""
        ...

    @property
    def max_model_len(self) -> int: ...

    @property
    def vocab_size(self) -> int: ...

    @property
    def modalities(self) -> tuple[str, ...]:
        """The inputs beyond text the model takes (``("image",)``; ``()`` for a text-only model)."""
        ...

    @property
    def tokenizer(self) -> PreTrainedTokenizerBase | None:
        """The model's tokenizer (None for a model served without one: token ids only)."""

    @property
    def model_source(self) -> ModelSource: ...

    @property
    def is_running(self) -> bool:
        """Started and not dead."""
        ...

    def start(self) -> None:
        """Start serving (the engine was built by the constructor); idempotent."""

    def shutdown(self, timeout: float = ...) -> None:
        """Stop, give back what the engine holds (ranks, processes); bounded by ``timeout`` seconds."""

    async def add_request(self, prompt: str | list[int] | dict[str, Any], params: SamplingParams, request_id: str,
                          priority: int = 0, lora_request: LoRARequest | None = None
                          ) -> AsyncIterator[RequestOutput]:
        """Validate and queue a request: ``ValueError`` naming the field for bad input, before any output.
        Returns the async iterator of its output deltas; leaving it early aborts the request."""
        ...

    def generate(self, prompt: str | list[int] | dict[str, Any], params: SamplingParams, request_id: str,
                 priority: int = 0, lora_request: LoRARequest | None = None) -> AsyncIterator[RequestOutput]:
        """``add_request``'s deltas as one async generator."""
        ...

    def abort(self, request_id: str) -> None:
        """Abort a request; finished and unknown ids are ignored."""

    def get_stats(self) -> EngineStats:
        """Counters and gauges for ``/metrics`` (blocking: call from a worker thread)."""
        ...

    def kv_events_since(self, since: int, limit: int = 1000) -> KVEventPage | None:
        """Up to ``limit`` of the engine's KV event batches numbered ``since`` and later (``GET /kv_events``;
        ``kvforge.kv_events.KVEventLog.since``); None when ``enable_kv_events`` is off. Thread-safe."""
        ...

    def check_structured_outputs(self, so: StructuredOutputsParams) -> None:
        """Compile a constraint (cached); ``ValueError`` if it is invalid (blocking)."""

    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Register a LoRA adapter ahead of its requests; ``ValueError`` if it is bad (blocking)."""
        ...

    def remove_lora(self, lora_int_id: int) -> bool:
        """Unregister an adapter (its running requests finish with it); False if unknown (blocking)."""
        ...

    def list_loras(self) -> list[LoRARequest]:
        """The registered adapters (blocking)."""
        ...


def protocol_members() -> set[str]:
    """The names an ``EngineClient`` must have (attributes, properties and methods)."""
    names = set(EngineClient.__annotations__)
    names |= {n for n, v in vars(EngineClient).items()
              if not n.startswith("_") and (callable(v) or isinstance(v, property))}
    return names
