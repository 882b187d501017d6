"""The metadata contract: a backend's per-step plan is a typed subclass of ``AttentionMetadata`` built from
``layout_fields``, and its ``forward`` refuses metadata another backend made (``kvforge.attention``)."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from kvforge.attention import AttentionMetadata, LayoutFields
from kvforge.plugins.attention.torch_backend import DecodeRows, PrefillChunk, TorchAttentionBackend, TorchMetadata
from testing_support import random_layout

KW = dict(num_heads=4, num_kv_heads=2, head_size=16, scale=0.25, block_size=4, dtype=torch.float32, device="cpu")


def test_layout_fields_are_the_metadata_s_own_fields():
    own = {f.name for f in dataclasses.fields(AttentionMetadata)} - {"extra"}
    assert set(LayoutFields.__annotations__) == own
    backend = TorchAttentionBackend(**KW)
    layout = random_layout([(0, 5), (3, 1)], 4, np.random.default_rng(0), 8)
    assert set(backend.layout_fields(layout)) == own


def test_the_torch_backend_plans_into_typed_fields_and_refuses_metadata_it_did_not_make():
    backend = TorchAttentionBackend(**KW)
    layout = random_layout([(0, 5), (3, 1), (2, 6)], 4, np.random.default_rng(0), 12)
    meta = backend.build_metadata(layout)
    assert isinstance(meta, TorchMetadata) and isinstance(meta.decode, DecodeRows)
    assert [(c.start, c.end, c.context_len) for c in meta.prefill] == [(0, 5, 5), (6, 12, 8)]
    assert all(isinstance(c, PrefillChunk) for c in meta.prefill)
    q = torch.randn(12, 4, 16)
    k, v = torch.randn(12, 2, 16), torch.randn(12, 2, 16)
    cache = backend.allocate_kv_cache(12, 1)[0]
    plain = AttentionMetadata(**backend.layout_fields(layout))
    with pytest.raises(TypeError, match="AttentionMetadata, not TorchMetadata"):
        backend.forward(q, k, v, cache, plain)
    assert backend.forward(q, k, v, cache, meta).shape == (12, 4, 16)
