"""``disk``: prefix-cached KV blocks kept in files under ``kv_offload_dir``, at most ``kv_offload_disk_gib``
per rank, across restarts of the engine; behind the ``cpu`` tier when both are set (its evictions come here).

Each rank keeps its own heads' share of a block in a file of its own (``disk_files``), and its store does
the file work in a thread of its own, in step order: a step's drops (files deleted), then its saves (the
blocks copied to host buffers on the step's stream; the thread waits for those copies, then writes each
file to a temporary name, flushes it and renames it). Loads read their files at the start of the step that
loads them, which the engine's index (``disk_index``) schedules only once it has read the same files ahead
in a thread of its own: the step's read comes from the page cache, never waiting on the disk.
"""
from __future__ import annotations

import logging
import math
import os
import queue
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping, Sequence

import torch

from kvforge.attention import AttentionBackend
from kvforge.kv_connector import KVConnector, TierStore
from kvforge.kv_tier import TierIndex
from kvforge.plugins.kv_cache.disk_files import (
    BadBlockFile,
    block_name,
    header_size,
    layout_dir,
    pack_header,
    read_block,
    write_block,
)
from kvforge.plugins.kv_cache.disk_index import DiskIndex

if TYPE_CHECKING:
    from kvforge.config import EngineConfig

logger = logging.getLogger(__name__)
GiB = 1 << 30
#: host memory a rank's blocks on their way to the disk may hold; a save past it is not written (the index
#: gives the block up when its files never come)
MAX_PENDING_BYTES = 256 << 20


@dataclass
class _Batch:
    """One step's file work, in order: deletions, writes (once ``event``, the copies, is done), touches."""

    event: Any  # torch.cuda.Event | None
    drops: list[int]
    writes: list[tuple[int, Sequence[int], torch.Tensor]]  # (hash, tokens, [layers, lead, bytes] host buffer)
    touches: list[int]  # blocks loaded: their files' times say "recently used" to a restarted engine


class DiskStore(TierStore):
    """One rank's blocks of the disk tier: files under ``directory``, keyed by block hash."""

    def __init__(self, attn: AttentionBackend, num_layers: int, directory: Path, block_size: int):
        directory.mkdir(parents=True, exist_ok=True)
        self.dir, self.num_layers, self.block_size = directory, num_layers, block_size
        shape = attn.kv_cache_shape(1)
        itemsize = torch.empty((), dtype=attn.kv_cache_dtype).element_size()
        self.lead = shape[0]
        # one layer's block as its file holds it: cache[k, block] for each leading index k, as bytes
        self.block_shape = (shape[0], *shape[2:-1], shape[-1] * itemsize)
        self.chunk = math.prod(shape[2:]) * itemsize
        self.dtype = str(attn.kv_cache_dtype)
        self.cuda = attn.device.type == "cuda" and torch.cuda.is_available()
        self.max_buffers = max(8, MAX_PENDING_BYTES // (num_layers * self.lead * self.chunk))
        self.allocated = 0
        self.spare: list[torch.Tensor] = []  # host buffers free for a block (the writer thread gives them back)
        self.in_use: list[tuple[Any, list[torch.Tensor]]] = []  # (event, read buffers the device may copy from)
        self.loaded: dict[int, torch.Tensor] = {}  # this step's reads
        self.writing: dict[int, torch.Tensor] = {}  # this step's writes
        self.tokens: dict[int, Sequence[int]] = {}
        self.skipped = 0  # saves not written: too many on their way
        self.queue: queue.Queue[_Batch | None] = queue.Queue()
        self.thread = threading.Thread(target=self._run, name="kvforge-disk-writer", daemon=True)
        self.thread.start()

    # -- the step thread --------------------------------------------------------------------------
    def begin(self, reads: Sequence[int], tokens: Mapping[int, Sequence[int]]) -> None:
        self._reclaim()
        self.tokens = dict(tokens)
        for key in reads:
            buf = self._buffer(needed=True)
            assert buf is not None
            self._read(key, buf)
            self.loaded[key] = buf

    def read(self, layer: int, keys: Sequence[int], like: torch.Tensor) -> torch.Tensor:
        staged = like.new_empty((like.shape[0], len(keys), *like.shape[2:]))
        for j, key in enumerate(keys):
            src = self.loaded[key][layer]  # [lead, bytes]
            for k in range(self.lead):
                staged[k, j].view(torch.uint8).view(-1).copy_(src[k], non_blocking=True)
        return staged

    def write(self, layer: int, keys: Sequence[int], src: torch.Tensor, src_ids: Sequence[int]) -> None:
        for key, s in zip(keys, src_ids):
            buf = self.writing.get(key)
            if buf is None:
                # (a key skipped at its first layer stays skipped: a buffer given back meanwhile would miss it)
                buf = self._buffer(needed=False) if layer == 0 else None
                if buf is None:
                    self.skipped += 1
                    if self.skipped == 1:
                        logger.warning("disk tier: writes fall behind the saves; saves past %d MiB on their way are "
                                       "not written", MAX_PENDING_BYTES >> 20)
                    continue
                self.writing[key] = buf
            for k in range(self.lead):
                buf[layer, k].copy_(src[k, s].view(torch.uint8).view(-1), non_blocking=True)

    def end(self, drops: Sequence[int]) -> None:
        event = None
        if self.cuda and (self.writing or self.loaded):
            event = torch.cuda.Event()
            event.record()
        if self.loaded:
            self.in_use.append((event, list(self.loaded.values())))
        writes = [(key, self.tokens[key], buf) for key, buf in self.writing.items() if key in self.tokens]
        self.spare += [buf for key, buf in self.writing.items() if key not in self.tokens]  # (none: the index sends)
        if writes or drops or self.loaded:
            self.queue.put(_Batch(event, list(drops), writes, list(self.loaded)))
        self.loaded, self.writing, self.tokens = {}, {}, {}

    def close(self) -> None:
        if self.thread.is_alive():
            self.queue.put(None)
            self.thread.join()

    def flush(self) -> None:
        """Wait until the file work queued so far is done."""
        self.queue.join()

    def _read(self, key: int, buf: torch.Tensor) -> None:
        path = self.dir / block_name(key)
        for attempt in range(2):
            try:
                header = read_block(path, key, self.block_size, into=buf.numpy().data.cast("B"))
                if (header.num_layers, header.shape, header.dtype) != (self.num_layers, self.block_shape, self.dtype):
                    raise BadBlockFile(path, f"blocks of {header.num_layers} layers of {header.shape} {header.dtype}")
                return
            except BadBlockFile as exc:
                if attempt:
                    raise RuntimeError(f"disk tier: {exc}; the engine read this file whole before it scheduled the "
                                       "load: did another program change the directory?") from exc
                self.flush()  # a block dropped and saved again: its new file may still be on its way

    def _buffer(self, needed: bool) -> torch.Tensor | None:
        """A host buffer for one block, every layer; None when too many are on their way and not ``needed``."""
        if self.spare:
            return self.spare.pop()
        if not needed and self.allocated >= self.max_buffers:
            return None
        self.allocated += 1
        return torch.empty((self.num_layers, self.lead, self.chunk), dtype=torch.uint8, pin_memory=self.cuda)

    def _reclaim(self) -> None:
        """Read buffers whose copies to the device are done become spare."""
        busy = []
        for event, bufs in self.in_use:
            if event is None or event.query():
                self.spare += bufs
            else:
                busy.append((event, bufs))
        self.in_use = busy

    # -- the writer thread ------------------------------------------------------------------------
    def _run(self) -> None:
        while (batch := self.queue.get()) is not None:
            try:
                self._apply(batch)
            except Exception:  # noqa: BLE001 - a full disk, a bad directory: the blocks are lost, not the engine
                logger.exception("disk tier: file work failed in %s", self.dir)
            finally:
                self.queue.task_done()
        self.queue.task_done()

    def _apply(self, batch: _Batch) -> None:
        for key in batch.drops:
            (self.dir / block_name(key)).unlink(missing_ok=True)
        if batch.writes and batch.event is not None:
            batch.event.synchronize()
        for key, tokens, buf in batch.writes:
            payload = buf.numpy().data.cast("B")
            header = pack_header(key, tokens, self.num_layers, self.dtype, self.block_shape, payload)
            try:
                write_block(self.dir / block_name(key), header, payload)
            finally:
                self.spare.append(buf)
        for key in batch.touches:
            try:
                os.utime(self.dir / block_name(key))
            except FileNotFoundError:
                pass


class DiskConnector(KVConnector):
    name = "disk"
    medium = "DISK"

    def __init__(self, *, config: EngineConfig, **options: Any):
        super().__init__(config=config)
        if config.kv_offload_dir is None:
            raise ValueError("kv connector 'disk' needs kv_offload_dir, a directory for its files; got None")
        self.root = layout_dir(config.kv_offload_dir, config)
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ValueError(f"kv_offload_dir={config.kv_offload_dir!r}: cannot make {self.root}: {exc}") from None
        if not os.access(self.root, os.W_OK | os.X_OK):
            raise ValueError(f"kv_offload_dir={config.kv_offload_dir!r}: {self.root} is not writable")

    def slots(self, bytes_per_block: int) -> int:
        per_file = bytes_per_block + header_size(self.config.block_size)
        return int(self.config.kv_offload_disk_gib * GiB) // per_file

    def store(self, attn: AttentionBackend, num_layers: int, slots: int, rank: int) -> DiskStore:
        return DiskStore(attn, num_layers, self.root / f"rank{rank}", self.config.block_size)

    def index(self, slots: int) -> TierIndex:
        world = self.config.tensor_parallel_size * self.config.pipeline_parallel_size
        return DiskIndex(slots, root=self.root, world_size=world, block_size=self.config.block_size,
                         option=self.config.kv_offload_dir or "", medium=self.medium)
