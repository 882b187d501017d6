"""A step on the wire: :class:`ExecuteStep`, the compact form of a ``StepInput`` the driver sends its ranks.

The driver pickles one step for every other rank every step, on the engine loop's critical path. A
``StepInput`` pickled as it is costs 1.5 KB for a decode step of 32 requests with short ids, and 3.6 KB
with the server's ids (``<X-Request-Id>:cmpl-<hex>``, 74 characters): each field's name, each request's
id, and each numpy array's dtype and reconstructor travel every step. Its :class:`ExecuteStep` is 0.4 KB
either way (``benchmarks/rank_message_bytes.py`` measures both). It sends:

- each request id once: the :class:`StepEncoder` gives it a small slot number and the ranks'
  :class:`StepDecoder` remembers it, so a running request costs a byte or two a step;
- the fields by position, not by name;
- every 1-D ``int64`` array as a list of ints when it is short (pickle writes a small int in 2 or 3
  bytes, and a list is the cheapest to make: the driver's time is the engine's), else as the bytes of
  the narrowest integer type that holds its values.

The rank gets back a ``StepInput`` equal to the driver's, field for field and dtype for dtype: what a
step computes does not change.

NOTE: the encoder is stateful. Every rank must get every ``ExecuteStep`` one encoder makes, in order:
the ``mp`` executor writes each to every rank's connection; Ray runs the tasks one caller submits to a
(synchronous) actor in order.
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import cast

import numpy as np

from kvforge.rank.step_input import StepInput

#: the request id fields, which travel as slots; every other field of StepInput travels in ``ExecuteStep.rest``
ID_FIELDS = ("req_ids", "table_updates", "dropped")
#: StepInput's other fields, in the order ``ExecuteStep.rest`` holds them
OTHER_FIELDS = tuple(f.name for f in fields(StepInput) if f.name not in ID_FIELDS)
#: each of those fields' default when it may be left off: None (a None default), ``list`` (an empty list),
#: or False (not omittable).
#: Trailing fields at their defaults are left off the wire (most steps use none of the late, rarely set
#: fields: LoRA, images, M-RoPE, tier copies) and the decoder makes them again.
_OMITTABLE = tuple(None if f.default is None else list if f.default_factory is list else False
                   for f in fields(StepInput) if f.name not in ID_FIELDS)
#: request ids one encoder remembers before it starts over (the engine drops every id it ends, so only
#: a bug would reach it; starting over costs one step sending every id again)
MAX_IDS = 1 << 16
#: the integer types an int64 array may travel as, narrowest first: (item size, smallest, largest value)
_NARROW = tuple((np.dtype(t).itemsize, int(np.iinfo(t).min), int(np.iinfo(t).max))
                for t in (np.int8, np.int16, np.int32))
#: item size -> the little-endian integer type of that size
_WIRE_DTYPES = {size: np.dtype(f"<i{size}") for size in (1, 2, 4, 8)}
_INT64 = np.dtype(np.int64)
#: arrays shorter than this travel as lists (``tolist`` is cheaper than finding their bounds)
_SHORT = 64

#: a 1-D int64 array on the wire: its values (a short one), or (item size of the integer type it travels
#: as, its bytes)
PackedInts = list[int] | tuple[int, bytes]
#: a request on the wire: its slot, or its id when the decoder may not know it (a dropped request)
WireId = int | str


@dataclass(frozen=True, slots=True)
class ExecuteStep:
    """One step for a rank (no answer: the collectives keep the ranks in step)."""

    new_ids: tuple[tuple[int, str], ...]  # (slot, request id): the ids this message gives a slot
    req_ids: list[int]  # slots
    table_updates: list[tuple[int, int, list[int]]]  # (slot, start, block ids)
    dropped: list[WireId]
    rest: tuple[object, ...]  # StepInput's other fields, in OTHER_FIELDS order
    packed: int  # bit i set: ``rest[i]`` is a PackedInts (a numpy array packed by pack_ints)

    def __reduce__(self) -> tuple[type[ExecuteStep], tuple[object, ...]]:
        # NOTE: the fields as constructor arguments: a slotted dataclass pickles its state through
        # ``dataclasses.fields`` in Python, which cost more than the rest of pickling a step
        return ExecuteStep, (self.new_ids, self.req_ids, self.table_updates, self.dropped, self.rest, self.packed)


def pack_ints(a: np.ndarray) -> PackedInts | None:
    """A 1-D int64 array as a list (short), or as the bytes of the narrowest integer type holding its
    values; None for any other array."""
    if a.dtype != _INT64 or a.ndim != 1:
        return None
    if len(a) < _SHORT:
        return a.tolist()
    lo, hi = int(a.min()), int(a.max())
    for size, smallest, largest in _NARROW:
        if smallest <= lo and hi <= largest:
            return size, a.astype(_WIRE_DTYPES[size]).tobytes()
    return 8, a.astype(_WIRE_DTYPES[8]).tobytes()


def unpack_ints(packed: PackedInts) -> np.ndarray:
    """The int64 array :func:`pack_ints` packed (a new, writable array)."""
    if isinstance(packed, list):
        return np.array(packed, dtype=_INT64)
    size, data = packed
    return np.frombuffer(data, dtype=_WIRE_DTYPES[size]).astype(_INT64)


def _at_default(i: int, value: object) -> bool:
    """Whether ``value`` is OTHER_FIELDS[i]'s default and the field omittable (exactly: None for a None
    default, an empty list for a list default)."""
    kind = _OMITTABLE[i]
    return value is None if kind is None else kind is list and type(value) is list and not value


class StepEncoder:
    """The driver's side: turns each ``StepInput`` into the :class:`ExecuteStep` every other rank gets."""

    def __init__(self, max_ids: int = MAX_IDS) -> None:
        self.slots: dict[str, int] = {}  # request id -> slot, for the ids the ranks know
        self.free: list[int] = []  # slots given back by dropped requests (with ``slots``: 0 .. n - 1)
        self.max_ids = max_ids

    def encode(self, step: StepInput) -> ExecuteStep:
        if len(self.slots) >= self.max_ids:
            self.slots.clear()
            self.free.clear()
        new: list[tuple[int, str]] = []
        slot, known = self._slot, self.slots
        try:  # the common case: every scheduled request is known already
            req_ids = [known[rid] for rid in step.req_ids]
        except KeyError:
            req_ids = [slot(rid, new) for rid in step.req_ids]
        updates = [(slot(rid, new), start, ids) for rid, start, ids in step.table_updates]
        dropped: list[WireId] = [known.get(rid, rid) for rid in step.dropped]
        rest: list[object] = []
        packed = 0
        for i, name in enumerate(OTHER_FIELDS):
            value = getattr(step, name)
            if isinstance(value, np.ndarray):
                ints = pack_ints(value)
                if ints is not None:
                    value = ints
                    packed |= 1 << i
            rest.append(value)
        while rest and _at_default(len(rest) - 1, rest[-1]):
            rest.pop()
        for rid in step.dropped:  # the ranks forget them with this step: their slots are free again
            freed = known.pop(rid, None)
            if freed is not None:
                self.free.append(freed)
        return ExecuteStep(tuple(new), req_ids, updates, dropped, tuple(rest), packed)

    def _slot(self, rid: str, new: list[tuple[int, str]]) -> int:
        slot = self.slots.get(rid)
        if slot is None:
            slot = self.free.pop() if self.free else len(self.slots)
            self.slots[rid] = slot
            new.append((slot, rid))
        return slot


class StepDecoder:
    """A rank's side: the ``StepInput`` of each :class:`ExecuteStep`, given every one in order."""

    def __init__(self) -> None:
        self.names: list[str] = []  # slot -> request id (a slot's last id; a free slot's is stale)

    def decode(self, msg: ExecuteStep) -> StepInput:
        names = self.names
        for slot, rid in msg.new_ids:
            if slot >= len(names):
                names.extend([""] * (slot + 1 - len(names)))
            names[slot] = rid
        step = StepInput.__new__(StepInput)  # every field is set below, as unpickling one would
        state = step.__dict__
        state["req_ids"] = [names[s] for s in msg.req_ids]
        state["table_updates"] = [(names[s], start, ids) for s, start, ids in msg.table_updates]
        state["dropped"] = [names[w] if isinstance(w, int) else w for w in msg.dropped]
        for i, (name, value) in enumerate(zip(OTHER_FIELDS, msg.rest)):
            state[name] = unpack_ints(cast(PackedInts, value)) if msg.packed >> i & 1 else value
        for name, kind in zip(OTHER_FIELDS[len(msg.rest):], _OMITTABLE[len(msg.rest):]):
            state[name] = None if kind is None else []  # left off the wire: omittable, at its default
        return step
