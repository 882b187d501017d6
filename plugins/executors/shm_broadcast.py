"""``ShmBroadcast``: one writer, several readers, a ring of messages in shared memory on one node.

The ``mp`` executor's driver sends every step to every other rank. Over sockets that is a system call
per rank for the driver and a wake-up from a blocking read for each rank, on the step's critical path:
the ranks start their part of a step only when the kernel has delivered it (vLLM replaced the same
path with its ``shm_broadcast.MessageQueue``). Here the driver writes a message once into a ring of
``chunks`` slots of ``chunk_bytes`` in POSIX shared memory, and each rank reads it from there.

Layout (every counter an aligned int64, whose loads and stores are single instructions):

- ``done[r]``: how many messages reader ``r`` has taken;
- ``seq[c]``: the number (from 1) of the message chunk ``c`` holds; ``length[c]``: its size, or -1
  for a message that did not fit (the writer then sends it on the reader's socket, after publishing
  the marker, so a reader that sees the marker finds the bytes there);
- the chunks.

The writer puts message ``s`` in chunk ``(s - 1) % chunks`` once every reader has taken message
``s - chunks`` (the chunk's previous one), then publishes ``seq``; a reader waits for the ``seq`` it
expects, copies the bytes, then bumps its ``done``. The payload is written before ``seq`` and read
after it; x86's stores are seen in program order, and the lock each side takes around publishing is a
full barrier elsewhere (vLLM's ``memory_fence`` does the same).

Waiting: a reader spins (``os.sched_yield``) for ``spin_s`` after its last message, then sleeps in
steps growing to 1 ms, so an idle rank costs nothing and a busy one answers in microseconds; the CPU
device's ranks never spin (they share the node's cores with the computation). Both sides' waits call
a ``check`` function every so often that raises when the other side is gone.
"""
from __future__ import annotations

import dataclasses
import os
import threading
import time
from dataclasses import dataclass
from multiprocessing import resource_tracker, shared_memory
from typing import Callable

import numpy as np

#: bytes of one chunk: a decode step of hundreds of requests is a few KB; a long prompt's step can be
#: more, and goes over the socket
CHUNK_BYTES = 1 << 20
#: messages the writer may be ahead of the slowest reader
CHUNKS = 8
#: seconds a reader spins after its last message before it starts sleeping between looks
SPIN_S = 1.0
#: the longest sleep between two looks of a waiting side
MAX_SLEEP_S = 1e-3
#: seconds between two calls of a waiting side's ``check``
CHECK_EVERY_S = 0.1
#: a message that did not fit in its chunk
OVERFLOW = object()


class ShmBroadcast:
    """The ring; the writer creates it (``create``), each reader attaches by name (``attach``)."""

    def __init__(self, shm: shared_memory.SharedMemory, readers: int, chunks: int, chunk_bytes: int, *,
                 owner: bool, reader: int | None = None, spin_s: float = SPIN_S):
        self.shm, self.readers, self.chunks, self.chunk_bytes = shm, readers, chunks, chunk_bytes
        self.owner, self.reader, self.spin_s = owner, reader, spin_s
        counters = readers + 2 * chunks
        ints = np.ndarray((counters,), dtype=np.int64, buffer=shm.buf)
        self.done, self.seq, self.length = ints[:readers], ints[readers:readers + chunks], ints[readers + chunks:]
        self.data = np.ndarray((chunks, chunk_bytes), dtype=np.uint8, buffer=shm.buf, offset=counters * 8)
        self.count = 0  # messages written (writer) or taken (reader)
        self._fence = threading.Lock()
        self._last = time.monotonic()
        self._closed = False

    @property
    def name(self) -> str:
        return self.shm.name

    @staticmethod
    def size(readers: int, chunks: int, chunk_bytes: int) -> int:
        return (readers + 2 * chunks) * 8 + chunks * chunk_bytes

    @classmethod
    def create(cls, readers: int, chunks: int = CHUNKS, chunk_bytes: int = CHUNK_BYTES) -> ShmBroadcast:
        shm = shared_memory.SharedMemory(create=True, size=cls.size(readers, chunks, chunk_bytes))
        ring = cls(shm, readers, chunks, chunk_bytes, owner=True)
        ring.done[:] = 0
        ring.seq[:] = 0
        return ring

    @classmethod
    def attach(cls, name: str, readers: int, reader: int, chunks: int = CHUNKS, chunk_bytes: int = CHUNK_BYTES,
               spin_s: float = SPIN_S, writer_pid: int = -1) -> ShmBroadcast:
        shm = shared_memory.SharedMemory(name=name)
        if os.getpid() != writer_pid:
            # NOTE: the writer owns the segment, but attaching registers it with this process's resource
            # tracker too, which would unlink it when this reader exits (CPython issue 82300)
            resource_tracker.unregister(shm._name, "shared_memory")  # pyright: ignore[reportAttributeAccessIssue]
        return cls(shm, readers, chunks, chunk_bytes, owner=False, reader=reader, spin_s=spin_s)

    # -- writer ----------------------------------------------------------------------------------
    def write(self, payload: bytes | memoryview, check: Callable[[], None]) -> bool:
        """Publish ``payload`` to every reader; False if it did not fit (the caller then sends it to each
        reader another way, after this returns). ``check`` raises if a reader is gone."""
        s = self.count + 1
        c = (s - 1) % self.chunks
        if s > self.chunks:
            self._wait(lambda: int(self.done.min()) >= s - self.chunks, check, spin=True)
        n = len(payload)
        fits = n <= self.chunk_bytes
        if fits:
            self.data[c, :n] = np.frombuffer(payload, dtype=np.uint8)
        with self._fence:
            self.length[c] = n if fits else -1
        with self._fence:
            self.seq[c] = s
        self.count = s
        return fits

    # -- reader ----------------------------------------------------------------------------------
    def read(self, check: Callable[[], None]) -> bytes | object:
        """The next message's bytes, or ``OVERFLOW`` (it is on this reader's socket). Waits for it;
        ``check`` raises if the writer is gone."""
        assert self.reader is not None, "read() on the writer's end"
        s = self.count + 1
        c = (s - 1) % self.chunks
        self._wait(lambda: int(self.seq[c]) == s, check, spin=time.monotonic() - self._last < self.spin_s)
        with self._fence:
            n = int(self.length[c])
        payload = self.data[c, :n].tobytes() if n >= 0 else OVERFLOW
        with self._fence:
            self.done[self.reader] = s
        self.count = s
        self._last = time.monotonic()
        return payload

    def ready(self) -> bool:
        """Whether the reader's next message is published (it would not wait)."""
        s = self.count + 1
        return int(self.seq[(s - 1) % self.chunks]) == s

    # -- both ------------------------------------------------------------------------------------
    def _wait(self, done: Callable[[], bool], check: Callable[[], None], spin: bool) -> None:
        if done():
            return
        start = next_check = time.monotonic()
        sleep = 0.0
        while not done():
            now = time.monotonic()
            if now >= next_check:
                check()
                next_check = now + CHECK_EVERY_S
            if spin and (self.spin_s > 0 and now - start < self.spin_s):
                os.sched_yield()
            else:
                sleep = min(MAX_SLEEP_S, max(2 * sleep, 2e-5))
                time.sleep(sleep)

    def close(self) -> None:
        """Detach; the writer also removes the segment. Idempotent."""
        if self._closed:
            return
        self._closed = True
        del self.done, self.seq, self.length, self.data  # the views first: the mapping cannot close under them
        try:
            self.shm.close()
        except BufferError:  # a view still alive somewhere: the mapping goes with the process
            pass
        if self.owner:
            try:
                self.shm.unlink()
            except FileNotFoundError:
                pass


@dataclass(frozen=True)
class RingAddress:
    """What a reader needs to attach: sent to each rank with its spec."""

    name: str
    readers: int
    reader: int
    chunks: int = CHUNKS
    chunk_bytes: int = CHUNK_BYTES
    spin_s: float = SPIN_S
    writer_pid: int = dataclasses.field(default_factory=os.getpid)

    def attach(self) -> ShmBroadcast:
        return ShmBroadcast.attach(self.name, self.readers, self.reader, self.chunks, self.chunk_bytes, self.spin_s,
                                   self.writer_pid)
