"""The engine's index of the ``disk`` KV tier: which blocks its files hold (rebuilt from the directory at
start, so hits survive a restart of the engine), and the reads ahead of the step that loads them.

The scheduler thread never touches the disk. Asked whether a held block can be loaded (``ready``), the index
hands the block to its reader thread, which reads every rank's file of it whole and checks each one's header
and checksum, and answers False (the request waits a step) until that read is done; the files are then in
the page cache, so the ranks' own reads at the start of the loading step are memory copies. A file that
fails its check, or is missing (and not one this engine put there moments ago, whose write may still be on
its way), drops the block from the index and the ranks delete what is left of it.

One engine owns a directory: the index holds an exclusive lock on it (``flock``), so a second engine on the
same directory (a data-parallel replica given the same ``kv_offload_dir``) fails to start, naming it.
"""
from __future__ import annotations

import fcntl
import logging
import os
import queue
import threading
import time
from collections import deque
from pathlib import Path
from typing import Container, Sequence

from kvforge.kv_tier import TierIndex, Tokens
from kvforge.plugins.kv_cache.disk_files import (
    SUFFIX,
    BadBlockFile,
    block_name,
    hash_of,
    read_block,
    read_header,
    remove_temp_files,
)

logger = logging.getLogger(__name__)

#: a block read ahead longer ago than this is read again before it is loaded (its pages may have gone)
READY_TTL_S = 10.0
#: a block this engine put that long ago whose files are still missing is given up (its write failed, or
#: fell behind: a request waiting for it waits no longer; the rank deletes a late file, its drop queued after)
WRITE_WAIT_S = 2.0
OK, MISSING, BAD = "ok", "missing", "bad"


class DiskIndex(TierIndex):
    """The blocks whose files every rank holds under ``root`` (``rank<r>/``), at most ``num_slots``, least
    recently used first; a block's key is its hash (its files' name)."""

    persistent = True

    def __init__(self, num_slots: int, *, root: Path, world_size: int, block_size: int, option: str = "",
                 medium: str = "DISK"):
        super().__init__(0, medium)
        self.num_slots = num_slots
        self.root, self.world_size, self.block_size = root, world_size, block_size
        self.lock = _lock(root, option)
        self.put_at: dict[int, float] = {}  # hash -> when this engine put it (its files may be on their way)
        self.read_at: dict[int, float] = {}  # hash -> when every rank's file of it was last read whole and checked
        self.reading: set[int] = set()
        self.results: deque[tuple[int, float | None, str]] = deque()  # (hash, its put_at, OK | MISSING | BAD)
        self.jobs: queue.SimpleQueue[tuple[int, Tokens, float | None] | None] = queue.SimpleQueue()
        self.found = self._rebuild()  # blocks the directory held at start
        self.thread = threading.Thread(target=self._read_ahead, name="kvforge-disk-read-ahead", daemon=True)
        self.thread.start()

    # -- the scheduler thread ---------------------------------------------------------------------
    def ready(self, block_hash: int) -> bool:
        self._collect()
        if block_hash not in self.held:
            return False  # (dropped by the check just collected)
        read = self.read_at.get(block_hash)
        if read is not None and time.monotonic() - read < READY_TTL_S:
            return True
        if block_hash not in self.reading:
            self.reading.add(block_hash)
            self.jobs.put((block_hash, self.held[block_hash][1], self.put_at.get(block_hash)))
        return False

    def put(self, block_hash: int, tokens: Sequence[int],
            keep: Container[int]) -> tuple[int, tuple[int, int, Tokens] | None] | None:
        got = super().put(block_hash, tokens, keep)
        if got is not None:
            self.put_at[block_hash] = time.monotonic()
        return got

    def take(self, block_hash: int) -> int:
        self.read_at.pop(block_hash, None)  # the next load of it reads ahead again
        return super().take(block_hash)

    def close(self) -> None:
        self.jobs.put(None)
        self.thread.join(timeout=10)
        if self.lock >= 0:
            os.close(self.lock)  # (releases the flock)
            self.lock = -1

    def _claim(self, block_hash: int) -> int | None:
        return block_hash if len(self.held) < self.num_slots else None

    def _release(self, block_hash: int, key: int) -> None:
        self.put_at.pop(block_hash, None)
        self.read_at.pop(block_hash, None)

    def _collect(self) -> None:
        """Apply the reader's answers (one about a block dropped, or put again, since it was asked is stale)."""
        while self.results:
            block_hash, tag, status = self.results.popleft()
            self.reading.discard(block_hash)
            if block_hash not in self.held or self.put_at.get(block_hash) != tag:
                continue
            now = time.monotonic()
            if status == OK:
                self.read_at[block_hash] = now
            elif status == BAD or tag is None or now - tag > WRITE_WAIT_S:
                key, _ = self.held.pop(block_hash)
                self._release(block_hash, key)
                self.dropped += 1
                self.forgotten.append((block_hash, key))
                logger.info("disk tier: block %016x dropped: its files are %s", block_hash & ((1 << 64) - 1), status)
            # else MISSING but put moments ago: its write is on its way; asked again, it is read again

    # -- the reader thread ------------------------------------------------------------------------
    def _read_ahead(self) -> None:
        while (job := self.jobs.get()) is not None:
            block_hash, tokens, tag = job
            status = OK
            for rank in range(self.world_size):
                try:
                    read_block(self.root / f"rank{rank}" / block_name(block_hash), block_hash, self.block_size, tokens)
                except BadBlockFile as exc:
                    status = MISSING if exc.missing else BAD
                    break
                except OSError:
                    status = BAD
                    break
            self.results.append((block_hash, tag, status))

    # -- start ------------------------------------------------------------------------------------
    def _rebuild(self) -> int:
        """The held blocks from the directory, oldest first (by the first rank's files' times): every rank's
        file must be there with a sound header; the rest, temporary files and those past the bound go."""
        dirs = [self.root / f"rank{rank}" for rank in range(self.world_size)]
        for d in dirs:
            d.mkdir(parents=True, exist_ok=True)
            remove_temp_files(d)
        found: list[tuple[int, str, int, Tokens]] = []  # (time, name, hash, tokens)
        for path in dirs[0].glob(f"*{SUFFIX}"):
            block_hash = hash_of(path.name)
            try:
                if block_hash is None:
                    raise BadBlockFile(path, "not a block file's name")
                header = read_header(path, self.block_size)
                for d in dirs[1:]:
                    read_header(d / path.name, self.block_size)
                found.append((path.stat().st_mtime_ns, path.name, block_hash, header.tokens))
            except (BadBlockFile, OSError) as exc:
                logger.info("disk tier: %s is not loaded: %s", path.name, exc)
        found.sort()
        keep = found[max(0, len(found) - self.num_slots):]
        names = {name for _, name, _, _ in keep}
        for d in dirs:  # the torn, the foreign, those of one rank only, those past the bound
            for path in d.glob(f"*{SUFFIX}"):
                if path.name not in names:
                    path.unlink(missing_ok=True)
        for _, _, block_hash, tokens in keep:
            self.held[block_hash] = (block_hash, tokens)
        return len(keep)


def _lock(root: Path, option: str) -> int:
    """An exclusive lock on ``root`` for this engine's life (its descriptor)."""
    root.mkdir(parents=True, exist_ok=True)
    fd = os.open(root / "lock", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        raise ValueError(f"kv_offload_dir={option!r}: its files for this model ({root}) are in use by another "
                         "engine; each engine (each data-parallel replica) needs a directory of its own") from None
    return fd
