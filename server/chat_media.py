"""The images of a chat or Responses request: checked against what the served model takes, loaded off
the event loop.

An image part (chat's ``image_url``, Responses' ``input_image``: a ``data:`` URL, an ``http(s)://`` URL,
or a ``file://`` URL under ``--allowed-local-media-path``) reaches a model that takes images as
``multi_modal_data``; an image for a text-only model, an audio or file part, one image too many, or one
that cannot be loaded is a 400 naming the part (docs/multimodal.md).
"""
from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any, Sequence

from kvforge.engine.client import EngineClient
from kvforge.multimodal.media import MediaLimits, load_image
from kvforge.server.errors import APIError
from kvforge.server.protocol import MEDIA_KINDS, ChatMessage


@dataclass(frozen=True)
class ImagePart:
    """An image a request carries: where (``messages.0.content.1``), what kind of part, and its URL."""

    where: str
    kind: str
    url: Any


async def load_images(parts: Sequence[ImagePart], engine: EngineClient, limits: MediaLimits) -> list[Any]:
    """The parts' images, decoded, in order ([] for none); 400s name the part."""
    if parts and "image" not in engine.modalities:
        content = parts[0].where.rsplit(".", 1)[0]
        raise APIError(400, f"{content}: an {parts[0].kind} part, but this model takes no images (text parts only)",
                       content)
    limit = (engine.config.limit_mm_per_prompt or {}).get("image", 1)
    if len(parts) > limit:
        where = parts[limit].where
        raise APIError(400, f"{where}: more than {limit} image(s) in one request (--limit-mm-per-prompt)", where)
    images = []
    for part in parts:
        if not isinstance(part.url, str):
            raise APIError(400, f"{part.where}: give the image's URL (\"data:...\" or \"https://...\")", part.where)
        try:
            images.append(await asyncio.to_thread(load_image, part.url, limits))
        except ValueError as exc:
            raise APIError(400, f"{part.where}: {exc}", part.where) from None
    return images


def engine_prompt(text: str, ids: list[int], images: list[Any]) -> dict[str, Any]:
    """The prompt an engine request gets: the rendered text, its ids and, if any, its images."""
    prompt: dict[str, Any] = {"prompt": text, "prompt_token_ids": ids}
    if images:
        prompt["multi_modal_data"] = {"image": images}
    return prompt


async def chat_images(messages: Sequence[ChatMessage], engine: EngineClient, limits: MediaLimits) -> list[Any]:
    """A chat request's images (``image_url`` parts); an audio or file part is a 400 naming its message."""
    parts = []
    for i, m in enumerate(messages):
        for j, part in m.media():
            if part.type != "image_url":
                raise APIError(400, f"messages.{i}.content: an {part.type} part, but this model takes no "
                                    f"{MEDIA_KINDS[part.type]} (text parts only)", f"messages.{i}.content")
            url = part.image_url.get("url") if isinstance(part.image_url, dict) else part.image_url
            parts.append(ImagePart(f"messages.{i}.content.{j}", "image_url", url))
    return await load_images(parts, engine, limits)
