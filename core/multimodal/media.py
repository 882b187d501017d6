"""Images a request carries, decoded from what a client sends, within limits; and their content hash.

A client gives an image as a ``data:`` URL (base64), an ``http(s)://`` URL (fetched with a byte limit, a
time limit and, when set, an allowed-domain list), a ``file://`` URL (only under an allowed local
directory: off by default, as vLLM's ``--allowed-local-media-path``), raw bytes, or an already decoded
``PIL.Image``. Every failure is a ``ValueError`` saying what is wrong; the caller prefixes the field
that carried the image (``messages.0.content.1``). Decoding and fetching block: callers run them off
the event loop (the server in a worker thread).
"""
from __future__ import annotations

import base64
import binascii
import hashlib
import io
import os
import urllib.parse
from dataclasses import dataclass
from typing import Any

#: the largest encoded image accepted (bytes): vLLM's default fetch limit is of this order
DEFAULT_MAX_IMAGE_BYTES = 20 << 20
#: the most pixels a decoded image may have (a small PNG can declare a huge canvas: a decompression bomb)
DEFAULT_MAX_IMAGE_PIXELS = 40_000_000
#: seconds an http(s) image may take to arrive whole
DEFAULT_FETCH_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class MediaLimits:
    """What a request's images may be, and where they may come from."""

    max_image_bytes: int = DEFAULT_MAX_IMAGE_BYTES
    max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS
    fetch_timeout_s: float = DEFAULT_FETCH_TIMEOUT_S
    #: ``file://`` images are read only from under this directory (None: refused)
    allowed_local_media_path: str | None = None
    #: ``http(s)://`` images only from these hosts (None: any host; ``()``: none)
    allowed_media_domains: tuple[str, ...] | None = None


#: the limits of a request that sets none (the Python API's; the server passes its flags')
DEFAULT_MEDIA = MediaLimits()


def _pil() -> Any:
    try:
        from PIL import Image
    except ImportError:  # pragma: no cover - pillow is a dependency
        raise ValueError("images need Pillow (pip install pillow)") from None
    return Image


def decode_image(data: bytes, limits: MediaLimits = DEFAULT_MEDIA) -> Any:
    """``data`` (an encoded image: PNG, JPEG, WebP, GIF...) as an RGB ``PIL.Image``."""
    if len(data) > limits.max_image_bytes:
        raise ValueError(f"the image is {len(data)} bytes, more than the limit of {limits.max_image_bytes} bytes")
    Image = _pil()
    try:
        with Image.open(io.BytesIO(data)) as img:
            width, height = img.size
            if width * height > limits.max_image_pixels:
                raise ValueError(f"the image is {width}x{height} pixels, more than the limit of "
                                 f"{limits.max_image_pixels}")
            img.load()
            return img.convert("RGB")
    except ValueError:
        raise
    except Exception as exc:  # PIL raises many kinds (UnidentifiedImageError, OSError, SyntaxError...)
        raise ValueError(f"the image cannot be decoded ({type(exc).__name__}: {exc})") from None


def load_image(source: Any, limits: MediaLimits = DEFAULT_MEDIA) -> Any:
    """An RGB ``PIL.Image`` from a ``PIL.Image``, bytes, or a ``data:``, ``http(s)://`` or ``file://`` URL."""
    Image = _pil()
    if isinstance(source, Image.Image):
        width, height = source.size
        if width * height > limits.max_image_pixels:
            raise ValueError(f"the image is {width}x{height} pixels, more than the limit of {limits.max_image_pixels}")
        return source.convert("RGB")
    if isinstance(source, (bytes, bytearray)):
        return decode_image(bytes(source), limits)
    if not isinstance(source, str):
        raise ValueError(f"expected an image, bytes or a URL, got {type(source).__name__}")
    scheme = source.split(":", 1)[0].lower() if ":" in source else ""
    if scheme == "data":
        return decode_image(_data_url_bytes(source, limits), limits)
    if scheme in ("http", "https"):
        return decode_image(_fetch(source, limits), limits)
    if scheme == "file":
        return decode_image(_local_file(source, limits), limits)
    raise ValueError(f"an image URL must be a data:, http(s):// or file:// URL, got {source[:40]!r}")


def _data_url_bytes(url: str, limits: MediaLimits) -> bytes:
    head, sep, payload = url.partition(",")
    if not sep or not head.lower().startswith("data:image/") or not head.lower().endswith(";base64"):
        raise ValueError("a data URL image must be data:image/<type>;base64,<data>")
    if len(payload) > limits.max_image_bytes * 4 // 3 + 4:
        raise ValueError(f"the image is more than the limit of {limits.max_image_bytes} bytes")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise ValueError("the data URL's base64 payload is not valid base64") from None


def _fetch(url: str, limits: MediaLimits) -> bytes:
    import httpx

    host = urllib.parse.urlsplit(url).hostname or ""
    if limits.allowed_media_domains is not None and host not in limits.allowed_media_domains:
        raise ValueError(f"images are not fetched from {host!r}: it is not one of --allowed-media-domains")
    chunks, size = [], 0
    try:
        with httpx.stream("GET", url, timeout=limits.fetch_timeout_s, follow_redirects=False) as r:
            if r.status_code != 200:
                raise ValueError(f"fetching the image answered HTTP {r.status_code}")
            for chunk in r.iter_bytes():
                size += len(chunk)
                if size > limits.max_image_bytes:
                    raise ValueError(f"the image is more than the limit of {limits.max_image_bytes} bytes")
                chunks.append(chunk)
    except httpx.HTTPError as exc:
        raise ValueError(f"the image could not be fetched ({type(exc).__name__}: {exc})") from None
    return b"".join(chunks)


def _local_file(url: str, limits: MediaLimits) -> bytes:
    if limits.allowed_local_media_path is None:
        raise ValueError("file:// images are off: start the server with --allowed-local-media-path DIR")
    root = os.path.realpath(limits.allowed_local_media_path)
    path = os.path.realpath(urllib.parse.unquote(urllib.parse.urlsplit(url).path))
    if os.path.commonpath([root, path]) != root:
        raise ValueError("the file:// image is outside --allowed-local-media-path")
    try:
        if os.path.getsize(path) > limits.max_image_bytes:
            raise ValueError(f"the image is more than the limit of {limits.max_image_bytes} bytes")
        with open(path, "rb") as f:
            return f.read()
    except OSError as exc:
        raise ValueError(f"the file:// image cannot be read ({exc.strerror})") from None


def image_hash(image: Any) -> int:
    """A content hash of a decoded image (its mode, size and pixels): the same picture sent as PNG or as
    a data URL hashes alike; a different picture does not (to 64 bits). A prefix-cache and encoder-cache key."""
    digest = hashlib.blake2b(digest_size=8)
    digest.update(f"{image.mode}:{image.size[0]}x{image.size[1]}:".encode())
    digest.update(image.tobytes())
    return int.from_bytes(digest.digest(), "little", signed=True)
