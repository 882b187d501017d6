"""The files of the ``disk`` KV tier: one per block and rank, named by the block's prefix hash.

``<kv_offload_dir>/<layout>/rank<r>/<hash, 16 hex digits>.kv``, ``<layout>`` a digest of what makes one
engine's blocks differ from another's (:func:`layout_dir`: the model, its weights' seed when they are random,
the dtypes, the block size, the parallel layout), so that engines of different models sharing a directory
never read each other's files. A file is a header, then the payload:

    magic b"KVFB", version, header length, the block's hash, the payload's CRC-32 and length, the layers,
    the cache's element type, one layer's block shape (its last dimension in bytes), the block's tokens

then each layer's block in turn (``cache[:, block]`` of the layer, ``[lead][bytes]``). A file is written to
``<name>.tmp``, flushed to the disk, then renamed: a crash leaves a ``.tmp`` file (removed at start) or the
whole file, and a torn, truncated or foreign file fails its header or its checksum, so it is never loaded.
"""
from __future__ import annotations

import hashlib
import os
import struct
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Sequence

if TYPE_CHECKING:
    from kvforge.config import EngineConfig

MAGIC = b"KVFB"
VERSION = 1
SUFFIX = ".kv"
TEMP_SUFFIX = ".tmp"
MAX_DIMS = 8
#: magic, version, header length, hash, CRC-32, payload length, layers, element type, block shape
_FIXED = struct.Struct(f"<4sHHqIQI16s{MAX_DIMS}I")
_MASK = (1 << 64) - 1


class BadBlockFile(Exception):
    """A block file that cannot be loaded: missing (``missing``), or torn, truncated or foreign."""

    def __init__(self, path: Path, why: str, missing: bool = False):
        super().__init__(f"{path}: {why}")
        self.missing = missing


@dataclass(frozen=True)
class BlockHeader:
    block_hash: int
    crc: int
    payload: int  # bytes after the header
    num_layers: int
    dtype: str  # the cache's element type, as torch names it ("torch.bfloat16")
    shape: tuple[int, ...]  # one layer's block: [lead, ..., last dimension in bytes]
    tokens: tuple[int, ...]

    @property
    def size(self) -> int:
        """Header and payload: the file's whole length."""
        return header_size(len(self.tokens)) + self.payload


def header_size(block_size: int) -> int:
    return _FIXED.size + 8 * block_size


def layout_dir(root: str, config: EngineConfig) -> Path:
    """The directory of one engine layout's files under ``root`` (``kv_offload_dir``)."""
    random_weights = config.load_format == "dummy" or (config.model or "").startswith("dummy:")
    key = (VERSION, config.model, config.load_format, config.seed if random_weights else None, str(config.torch_dtype),
           config.kv_cache_dtype, config.block_size, config.quantization, config.tensor_parallel_size,
           config.pipeline_parallel_size)
    return Path(root) / hashlib.blake2b(repr(key).encode(), digest_size=8).hexdigest()


def block_name(block_hash: int) -> str:
    return f"{block_hash & _MASK:016x}{SUFFIX}"


def hash_of(name: str) -> int | None:
    """The block hash a file name says (None: not a block file's name)."""
    stem = name[:-len(SUFFIX)] if name.endswith(SUFFIX) else ""
    if len(stem) != 16:
        return None
    try:
        value = int(stem, 16)
    except ValueError:
        return None
    return value - (1 << 64) if value >> 63 else value


def pack_header(block_hash: int, tokens: Sequence[int], num_layers: int, dtype: str, shape: Sequence[int],
                payload: memoryview) -> bytes:
    if len(shape) > MAX_DIMS:
        raise ValueError(f"disk tier: a block of {len(shape)} dimensions (at most {MAX_DIMS})")
    dims = [*shape, *[0] * (MAX_DIMS - len(shape))]
    fixed = _FIXED.pack(MAGIC, VERSION, header_size(len(tokens)), block_hash, zlib.crc32(payload), payload.nbytes,
                        num_layers, dtype.encode()[:16], *dims)
    return fixed + struct.pack(f"<{len(tokens)}q", *tokens)


def parse_header(path: Path, data: bytes) -> BlockHeader:
    if len(data) < _FIXED.size:
        raise BadBlockFile(path, "shorter than a header")
    magic, version, length, block_hash, crc, payload, layers, dtype, *dims = _FIXED.unpack_from(data)
    if magic != MAGIC or version != VERSION:
        raise BadBlockFile(path, f"not a block file of version {VERSION}")
    count = (length - _FIXED.size) // 8
    if length < _FIXED.size or len(data) < length or (length - _FIXED.size) % 8:
        raise BadBlockFile(path, "a torn header")
    tokens = struct.unpack_from(f"<{count}q", data, _FIXED.size)
    return BlockHeader(block_hash, crc, payload, layers, dtype.rstrip(b"\0").decode(errors="replace"),
                       tuple(d for d in dims if d), tuple(tokens))


def read_header(path: Path, block_size: int) -> BlockHeader:
    """A file's header, checked against its name and its length (not its payload's checksum)."""
    try:
        with open(path, "rb") as f:
            header = parse_header(path, f.read(header_size(block_size)))
            length = os.fstat(f.fileno()).st_size
    except FileNotFoundError:
        raise BadBlockFile(path, "missing", missing=True) from None
    if hash_of(path.name) != header.block_hash or len(header.tokens) != block_size or length != header.size:
        raise BadBlockFile(path, "a truncated file, or one of another block")
    return header


def read_block(path: Path, block_hash: int, block_size: int, tokens: Sequence[int] | None = None,
               into: memoryview | None = None) -> BlockHeader:
    """Read a whole file (into ``into``, its payload's bytes, when given), checking its header against the
    block's hash (and tokens, when given) and its payload against the checksum."""
    try:
        with open(path, "rb") as f:
            header = parse_header(path, f.read(header_size(block_size)))
            if header.block_hash != block_hash or (tokens is not None and header.tokens != tuple(tokens)):
                raise BadBlockFile(path, "the file of another block")
            if into is not None and into.nbytes != header.payload:
                raise BadBlockFile(path, f"a payload of {header.payload} bytes, not this rank's {into.nbytes}")
            buf = into if into is not None else memoryview(bytearray(header.payload))
            got = f.readinto(buf)
            if got != header.payload or f.read(1):
                raise BadBlockFile(path, "truncated, or longer than its header says")
    except FileNotFoundError:
        raise BadBlockFile(path, "missing", missing=True) from None
    if zlib.crc32(buf) != header.crc:
        raise BadBlockFile(path, "a payload that fails its checksum")
    return header


def write_block(path: Path, header: bytes, payload: memoryview) -> None:
    """Write the file under a temporary name, flush it to the disk, then rename it into place."""
    temp = path.with_name(path.name + TEMP_SUFFIX)
    fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        for view in (memoryview(header), payload.cast("B")):
            while view:  # (a write may take less than it is given)
                view = view[os.write(fd, view):]
        (getattr(os, "fdatasync", None) or os.fsync)(fd)
    finally:
        os.close(fd)
    os.replace(temp, path)


def remove_temp_files(directory: Path) -> int:
    """Remove the temporary files a crash left behind; how many."""
    removed = 0
    for entry in directory.glob(f"*{TEMP_SUFFIX}"):
        entry.unlink(missing_ok=True)
        removed += 1
    return removed
