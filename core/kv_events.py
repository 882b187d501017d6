"""KV events: which prefix-cached blocks each tier holds, in vLLM's shape (docs/kv_cache.md, "Tiers beyond
the GPU, KV events and a prefix-aware router").

A router that knows which block hashes a replica holds can send a prompt where its prefix is cached. The paged
manager (and its tiers) record a :class:`BlockStored` when a block gets a prefix hash in a tier, a
:class:`BlockRemoved` when it loses it, and :class:`AllBlocksCleared` on ``reset_prefix_cache``; ``medium``
names the tier (``"GPU"``, ``"CPU"``, ``"DISK"``). The engine loop takes them once per step and hands them over
as one :class:`EventBatch`; the front end numbers the batches in a :class:`KVEventLog` (``GET /kv_events``) and
publishes each on ZMQ (``kvforge.kv_event_publisher``).

The structs are vLLM's (``vllm.distributed.kv_events``): msgspec structs encoded as arrays, each event tagged
with its class name, so a consumer of vLLM's msgpack stream decodes kvforge's unchanged. Hashes are the paged
manager's own (``kvforge.kv_cache.hash_block``): signed 64-bit integers.
"""
from __future__ import annotations

import itertools
import threading
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Sequence, Union

import msgspec

if TYPE_CHECKING:
    from kvforge.config import EngineConfig
    from kvforge.kv_event_publisher import ZmqEventPublisher

#: where a block lives, as the events name it
GPU, CPU, DISK = "GPU", "CPU", "DISK"
#: batches a :class:`KVEventLog` keeps for ``GET /kv_events`` (the oldest go first)
LOG_CAPACITY = 10_000


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    """Base of the events (tagged: a decoder tells them apart by the class name in front)."""


class BlockStored(KVCacheEvent):
    """Blocks that now hold a prefix in ``medium``: a chain, ``block_hashes[0]``'s parent being
    ``parent_block_hash`` (None: the first block of a prompt, or unknown), ``token_ids`` every block's
    tokens in order (``block_size`` each)."""

    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None


class BlockRemoved(KVCacheEvent):
    """Blocks that no longer hold their prefix in ``medium`` (evicted, or dropped from the tier)."""

    block_hashes: list[int]
    medium: str | None


class AllBlocksCleared(KVCacheEvent):
    """Every tier forgot every block (``reset_prefix_cache``)."""


Event = Union[BlockStored, BlockRemoved, AllBlocksCleared]
EVENT_TYPES: dict[str, type[BlockStored] | type[BlockRemoved] | type[AllBlocksCleared]] = {
    c.__name__: c for c in (BlockStored, BlockRemoved, AllBlocksCleared)}


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """One engine step's events; ``ts`` its wall-clock time (``time.time()``); ``data_parallel_rank`` the
    replica that made them (``--data-parallel-size``; None: the only engine)."""

    ts: float
    events: list[Event]
    data_parallel_rank: int | None = None


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(EventBatch)


def encode(batch: EventBatch) -> bytes:
    """The batch in msgpack, vLLM's wire form."""
    return _encoder.encode(batch)


def decode(payload: bytes) -> EventBatch:
    return _decoder.decode(payload)


def event_to_json(event: KVCacheEvent) -> dict[str, Any]:
    """An event as a JSON object: ``{"type": "BlockStored", "block_hashes": [...], ...}``."""
    return {"type": type(event).__name__, **{name: getattr(event, name) for name in event.__struct_fields__}}


def event_from_json(obj: dict[str, Any]) -> Event:
    """:func:`event_to_json`'s inverse; ``ValueError`` naming the type for an unknown one."""
    values = dict(obj)
    name = values.pop("type", None)
    cls = EVENT_TYPES.get(name) if isinstance(name, str) else None
    if cls is None:
        raise ValueError(f"KV event type must be one of {sorted(EVENT_TYPES)}, got {obj.get('type')!r}")
    return cls(**values)


class KVEventRecorder:
    """The events a KV manager and its tiers made since the last :meth:`take`.

    A block stored right after its parent in the same medium joins the parent's ``BlockStored`` (one event
    per chain, as vLLM sends them); consecutive removals in one medium share a ``BlockRemoved``.
    """

    def __init__(self, block_size: int):
        self.block_size = block_size
        self.events: list[Event] = []

    def stored(self, block_hash: int, parent_hash: int | None, tokens: Sequence[int], lora_id: int | None,
               medium: str) -> None:
        last = self.events[-1] if self.events else None
        if (type(last) is BlockStored and parent_hash is not None and last.medium == medium
                and last.lora_id == lora_id and last.block_hashes[-1] == parent_hash):
            last.block_hashes.append(block_hash)
            last.token_ids.extend(tokens)
            return
        self.events.append(BlockStored([block_hash], parent_hash, list(tokens), self.block_size, lora_id, medium))

    def removed(self, block_hash: int, medium: str) -> None:
        last = self.events[-1] if self.events else None
        if type(last) is BlockRemoved and last.medium == medium:
            last.block_hashes.append(block_hash)
            return
        self.events.append(BlockRemoved([block_hash], medium))

    def cleared(self) -> None:
        self.events.append(AllBlocksCleared())

    def take(self) -> list[Event]:
        events, self.events = self.events, []
        return events


@dataclass
class KVEventPage:
    """A page of a :class:`KVEventLog`: ``batches`` numbered from the ``since`` asked for (or ``first``, the
    oldest kept, when older ones were dropped); ask for ``next`` to go on. A ``next`` below the ``since``
    asked for means the log started again (a restarted server): its numbers count from 0 again."""

    first: int
    next: int
    batches: list[tuple[int, EventBatch]] = field(default_factory=list)


class KVEventLog:
    """The front end's numbered event batches (0, 1, ...), the last ``capacity`` kept, each handed to
    ``publisher`` as it comes. Thread-safe: one thread appends (the engine loop's, the reader of the engine
    core's messages, or the data-parallel front end's reader of its replicas' logs), any reads."""

    def __init__(self, capacity: int = LOG_CAPACITY, publisher: ZmqEventPublisher | None = None):
        self._batches: deque[tuple[int, EventBatch]] = deque(maxlen=capacity)
        self._next = 0
        self._lock = threading.Lock()
        self.publisher = publisher

    @classmethod
    def for_config(cls, config: EngineConfig) -> KVEventLog | None:
        """The log of an engine configured with ``enable_kv_events`` (publishing on ``kv_events_endpoint``
        when set; a ``ValueError`` names it if it cannot be bound); None when events are off."""
        if not config.enable_kv_events:
            return None
        publisher = None
        if config.kv_events_endpoint is not None:
            from kvforge.kv_event_publisher import ZmqEventPublisher

            publisher = ZmqEventPublisher(config.kv_events_endpoint)
        return cls(publisher=publisher)

    def append(self, batch: EventBatch) -> int:
        """Number the batch, keep it and publish it; its number."""
        with self._lock:
            seq = self._next
            self._next += 1
            self._batches.append((seq, batch))
            if self.publisher is not None:
                self.publisher.publish(seq, batch)
        return seq

    def since(self, seq: int, limit: int) -> KVEventPage:
        """Up to ``limit`` batches numbered ``seq`` and later."""
        with self._lock:
            first = self._batches[0][0] if self._batches else self._next
            if seq > self._next:  # numbers of an earlier log: start again from ours
                return KVEventPage(first, self._next)
            start = max(seq, first) - first
            batches = list(itertools.islice(self._batches, start, start + limit))
            return KVEventPage(first, batches[-1][0] + 1 if batches else self._next, batches)

    def close(self) -> None:
        """Close the publisher's socket (a batch appended later is still kept, not published)."""
        with self._lock:
            publisher, self.publisher = self.publisher, None
        if publisher is not None:
            publisher.close()
