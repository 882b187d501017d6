"""What a multimodal prompt is once processed: token ids with each item's placeholders expanded, and
one :class:`MultiModalFeature` per item (what the model's encoder needs, where its embedding goes, and
its content hash). docs/multimodal.md gives the design.

The model plugin's processor (:class:`MultiModalProcessor`) makes them on the front end, off the event
loop; the engine schedules and caches by them; the worker merges their embeddings into the prompt's.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Protocol, Sequence, runtime_checkable

from kvforge.multimodal.media import DEFAULT_MEDIA, MediaLimits, load_image

#: the modalities kvforge knows (a model declares the ones it takes: ModelCapabilities.modalities)
MODALITIES = ("image",)


@dataclass(frozen=True, eq=False)
class MultiModalFeature:
    """One item of a prompt (an image), processed.

    modality: ``"image"``.
    data: what the model's ``embed_multimodal`` needs for it (``pixel_values``, grid sizes...), on the CPU.
    offset: the first of its placeholder positions in the expanded prompt.
    length: how many placeholder positions it takes: the rows of its embedding.
    content_hash: of its decoded content and the processor's settings (``media.image_hash``): the key of
        the encoder cache and, for blocks that hold its positions, part of the prefix-cache key.
    rope_positions: for a model with multimodal RoPE (Qwen2-VL's M-RoPE), each row's (temporal, height,
        width) position relative to the item's first position, ``[3, length]`` int64; None: its rows take
        ordinary positions (``kvforge.multimodal.mrope``).
    rope_extent: with ``rope_positions``, how far the item advances the position of what follows it
        (Qwen2-VL: the larger side of its merged grid, not its ``length``).
    bidirectional: its rows attend to each other both ways (Gemma 3's images): a prompt chunk never ends
        inside it (``kvforge.multimodal.spans``), and the attention backend gets its span.
    """

    modality: str
    data: dict[str, Any]
    offset: int
    length: int
    content_hash: int
    rope_positions: Any = None
    rope_extent: int = 0
    bidirectional: bool = False

    @property
    def end(self) -> int:
        return self.offset + self.length


@dataclass(frozen=True)
class ProcessedPrompt:
    """A prompt's token ids with the placeholders expanded, and its items' features (by offset)."""

    prompt_token_ids: list[int]
    features: tuple[MultiModalFeature, ...] = field(default_factory=tuple)


@runtime_checkable
class MultiModalProcessor(Protocol):
    """A multimodal model's processor (its class's ``processor(config, source)`` makes it).

    ``process`` gets the prompt's token ids (each item's placeholder token where the item goes, as the
    checkpoint's chat template writes it) and the decoded items by modality, in prompt order; it returns
    the expanded ids and one feature per item. A mismatch (more items than placeholders) is a
    ``ValueError`` naming ``multi_modal_data``.

    Optional: ``profile_prompt() -> (prompt_token_ids, item)``, a prompt of one placeholder and the item
    that costs the encoder most (an image of the largest size the processor makes); the KV sizing encodes
    as many of them as one step can reach (``kvforge.multimodal.profile``). Without it the sizing counts
    no encoder work.
    """

    modalities: tuple[str, ...]

    def process(self, prompt_token_ids: list[int], items: Mapping[str, Sequence[Any]]) -> ProcessedPrompt: ...


def parse_multi_modal_data(data: Any, modalities: Sequence[str], limits: Mapping[str, int],
                           media: MediaLimits = DEFAULT_MEDIA) -> dict[str, list[Any]]:
    """vLLM's ``multi_modal_data`` (``{"image": img or [img, ...]}``; an image a ``PIL.Image``, bytes or a
    URL) as decoded items by modality. ``ValueError`` naming ``multi_modal_data.<modality>[.<i>]``."""
    if not isinstance(data, Mapping):
        raise ValueError(f"multi_modal_data: expected a dict of modality -> items, got {type(data).__name__}")
    items: dict[str, list[Any]] = {}
    for modality, value in data.items():
        if modality not in MODALITIES:
            raise ValueError(f"multi_modal_data.{modality}: unknown modality (kvforge takes {list(MODALITIES)})")
        if modality not in modalities:
            raise ValueError(f"multi_modal_data.{modality}: this model takes no "
                             f"{modality}s (it takes {list(modalities) or 'text only'})")
        values = list(value) if isinstance(value, (list, tuple)) else [value]
        limit = limits.get(modality, 1)
        if len(values) > limit:
            raise ValueError(f"multi_modal_data.{modality}: {len(values)} {modality}s, more than the "
                             f"limit of {limit} per prompt (limit_mm_per_prompt)")
        decoded = []
        for i, v in enumerate(values):
            try:
                decoded.append(load_image(v, media))
            except ValueError as exc:
                raise ValueError(f"multi_modal_data.{modality}.{i}: {exc}") from None
        if decoded:
            items[modality] = decoded
    return items


def expand_placeholders(ids: Sequence[int], token_id: int, lengths: Sequence[int]) -> tuple[list[int], list[int]]:
    """``ids`` with the i-th occurrence of ``token_id`` repeated ``lengths[i]`` times, and where each run
    starts. ``ValueError`` (naming ``multi_modal_data``) unless there is one occurrence per length."""
    found = sum(1 for t in ids if t == token_id)
    if found != len(lengths):
        raise ValueError(f"multi_modal_data: the prompt has {found} image placeholder(s) (token {token_id}) "
                         f"for {len(lengths)} image(s); put one where each image goes")
    out: list[int] = []
    offsets: list[int] = []
    k = 0
    for t in ids:
        if t == token_id:
            offsets.append(len(out))
            out.extend([token_id] * lengths[k])
            k += 1
        else:
            out.append(t)
    return out, offsets


def block_extra_keys(features: Sequence[MultiModalFeature], start: int, end: int) -> tuple | None:
    """The part of a prefix-cache block key that names the items whose positions fall in [start, end):
    ``((content_hash, first position of the item inside the block's range), ...)``; None for none."""
    keys = tuple((f.content_hash, max(start, f.offset) - f.offset)
                 for f in features if f.offset < end and f.end > start)
    return keys or None
