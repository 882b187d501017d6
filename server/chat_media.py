"""The images of a chat request: checked against what the served model takes, loaded off the event loop.

An ``image_url`` part (a ``data:`` URL, an ``http(s)://`` URL, or a ``file://`` URL under
``--allowed-local-media-path``) reaches a model that takes images as ``multi_modal_data``; an image for a
text-only model, an audio or file part, one image too many, or one that cannot be loaded is a 400
naming the part (docs/multimodal.md).
"""
from __future__ import annotations

import asyncio
from typing import Any, Sequence

from kvforge.engine.client import EngineClient
from kvforge.multimodal.media import MediaLimits, load_image
from kvforge.server.errors import APIError
from kvforge.server.protocol import MEDIA_KINDS, ChatMessage


async def chat_images(messages: Sequence[ChatMessage], engine: EngineClient, limits: MediaLimits) -> list[Any]:
    """The request's images, decoded, in the order its messages hold them ([] for none)."""
    found = [(i, j, part) for i, m in enumerate(messages) for j, part in m.media()]
    for i, _, part in found:
        if part.type != "image_url" or "image" not in engine.modalities:
            raise APIError(400, f"messages.{i}.content: an {part.type} part, but this model takes no "
                                f"{MEDIA_KINDS[part.type]} (text parts only)", f"messages.{i}.content")
    limit = (engine.config.limit_mm_per_prompt or {}).get("image", 1)
    if len(found) > limit:
        i, j, _ = found[limit]
        raise APIError(400, f"messages.{i}.content.{j}: more than {limit} image(s) in one request "
                            "(--limit-mm-per-prompt)", f"messages.{i}.content.{j}")
    images = []
    for i, j, part in found:
        where = f"messages.{i}.content.{j}"
        url = part.image_url.get("url") if isinstance(part.image_url, dict) else part.image_url
        if not isinstance(url, str):
            raise APIError(400, f"{where}.image_url: give the image as {{\"url\": \"data:...\" or \"https://...\"}}",
                           f"{where}.image_url")
        try:
            images.append(await asyncio.to_thread(load_image, url, limits))
        except ValueError as exc:
            raise APIError(400, f"{where}: {exc}", where) from None
    return images
