"""What the KV sizing counts for a multimodal model's encoder (docs/multimodal.md, "Memory").

The memory profile (``kvforge.rank.kv_sizing.profile_peak_memory``) runs one forward of a full token
budget; a multimodal model's step may also encode images first and keep their rows while the decoder runs.
So the profile encodes, before its forward and holding the result through it, the costliest batch of
items one step can reach: the processor's largest item (``MultiModalProcessor.profile_prompt``), as many
times as a step's budget holds its rows (at most ``limit_mm_per_prompt`` a sequence, and what the encoder
cache holds). The encoder cache's rows beyond those are reserved too (``encoder_cache_bytes``).
"""
from __future__ import annotations

from typing import Any, Mapping

from kvforge.multimodal.encoder_cache import DEFAULT_CAPACITY_ROWS
from kvforge.multimodal.inputs import MultiModalFeature


def profile_features(processor: Any, *, max_num_batched_tokens: int, max_num_seqs: int,
                     limits: Mapping[str, int] | None) -> list[MultiModalFeature]:
    """The items the profile encodes at once (empty for a processor without ``profile_prompt``)."""
    make = getattr(processor, "profile_prompt", None)
    if make is None:
        return []
    ids, item = make()
    feature = processor.process(list(ids), {"image": [item]}).features[0]
    per_seq = max(1, int((limits or {}).get("image", 1)))
    fit = min(max_num_batched_tokens, DEFAULT_CAPACITY_ROWS) // feature.length
    return [feature] * max(1, min(fit, per_seq * max_num_seqs))


def encoder_cache_bytes(features: list[MultiModalFeature], hidden_size: int, itemsize: int) -> int:
    """The encoder cache's bytes beyond the rows the profile already holds (its capacity is in rows)."""
    held = sum(f.length for f in features)
    return max(0, DEFAULT_CAPACITY_ROWS - held) * hidden_size * itemsize
