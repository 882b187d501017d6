"""``torch``: the reference paged attention backend, built from PyTorch ops (CPU and CUDA).

Decode tokens (sequences with one query token) are batched into one SDPA call over keys gathered
through their block tables; every prefill chunk is one SDPA call over its cached prefix plus its new
tokens. Correctness first: the GPU backends are measured against this one.

An FP8 cache (``kv_cache_dtype``) is written as ``kv_write.quantize_kv`` stores it and read back as
``k8.float() * k_scale`` (``v8.float() * v_scale``): the gathered pages only, never the whole cache.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np
import torch
import torch.nn.functional as F

from kvforge.attention import (
    PLAIN_LAYER,
    AttentionBackend,
    AttentionCapabilities,
    AttentionLayer,
    AttentionMetadata,
    BatchLayout,
    as_bytes,
    metadata_of,
)
from kvforge.plugins.attention.kv_write import write_kv_torch


class DecodeRows(NamedTuple):
    """The step's decode sequences (one query token each), batched into one SDPA call."""

    tokens: torch.Tensor | None  # [n] int64 token index of each; None when the step is decode-only (token i = seq i)
    block_tables: torch.Tensor  # [n, max_len / block_size] int32
    seq_lens: torch.Tensor  # [n] int64
    max_len: int  # keys gathered per sequence (whole blocks)


class PrefillChunk(NamedTuple):
    """One prefill chunk, all host ints but its blocks: tokens ``start:end`` of the flat batch."""

    start: int
    end: int
    context_len: int  # cached prefix + the chunk
    blocks: torch.Tensor  # [ceil(context_len / block_size)] int32, its block ids


@dataclass
class TorchMetadata(AttentionMetadata):
    decode: DecodeRows | None = None
    prefill: list[PrefillChunk] = field(default_factory=list)
    lookahead: torch.Tensor | None = None  # [num_tokens] int64 (BatchLayout.lookahead), or None: all causal


class TorchAttentionBackend(AttentionBackend):
    name = "torch"
    capabilities = AttentionCapabilities(
        devices=("cpu", "cuda"),
        dtypes=(torch.float32, torch.float16, torch.bfloat16),
        kv_cache_dtypes=(torch.float8_e4m3fn,),
        supports_cuda_graphs=False,
        sliding_window=True,
        logits_soft_cap=True,
        attention_sinks=True,
        bidirectional_spans=True,
        auto_priority=10,
    )

    def build_metadata(self, layout: BatchLayout) -> TorchMetadata:
        meta = TorchMetadata(**self.layout_fields(layout))
        query_lens = layout.query_lens
        decode = np.nonzero(query_lens == 1)[0]
        prefill = np.nonzero(query_lens > 1)[0]
        bs = self.block_size
        if len(decode):
            dec_max_blocks = int(-(-layout.seq_lens[decode].max() // bs))
            dev = self.device
            all_decode = len(decode) == layout.num_seqs == layout.num_tokens
            meta.decode = DecodeRows(
                None if all_decode else torch.from_numpy(layout.query_start_loc[decode].astype(np.int64)).to(dev),
                torch.from_numpy(np.ascontiguousarray(layout.block_tables[decode, :dec_max_blocks])).to(dev),
                torch.from_numpy(layout.seq_lens[decode].astype(np.int64)).to(dev),
                dec_max_blocks * bs,
            )
        if layout.lookahead is not None:
            meta.lookahead = torch.from_numpy(layout.lookahead).to(self.device)
        meta.prefill = [
            PrefillChunk(int(layout.query_start_loc[i]), int(layout.query_start_loc[i + 1]), int(layout.seq_lens[i]),
                         meta.block_tables[i, : -(-int(layout.seq_lens[i]) // bs)])
            for i in prefill
        ]
        return meta

    def forward(self, q, k, v, kv_cache, meta: AttentionMetadata, layer: AttentionLayer = PLAIN_LAYER):
        # q: [num_tokens, num_heads, head_size]; k, v: [num_tokens, num_kv_heads, head_size]
        meta = metadata_of(meta, TorchMetadata)
        num_tokens = meta.num_tokens
        q, k, v = q[:num_tokens], k[:num_tokens], v[:num_tokens]
        hkv, d = self.num_kv_heads, self.head_size
        scales = getattr(self.kv_scales(kv_cache), "tensor", None)  # [2] fp32 (k, v) for an FP8 cache
        write_kv_torch(k, v, kv_cache, meta.slot_mapping[:num_tokens], scales)
        # an FP8 cache is gathered as bytes and dequantized after the gather (pages() below)
        k_cache, v_cache = as_bytes(kv_cache)  # each [num_blocks, block_size, kv_heads, head_size]
        out = torch.empty_like(q)
        gqa = self.num_heads != hkv
        # NOTE: the reference computes attention in float32 whatever the cache dtype (SDPA's math path
        # would otherwise round scores and probabilities to bf16/fp16)
        acc = torch.float32
        q = q.to(acc)

        def pages(cache: torch.Tensor, index: torch.Tensor, i: int) -> torch.Tensor:
            """cache[index] in float32, dequantized with scale i (0: K, 1: V) when FP8."""
            x = cache[index]
            if scales is None:
                return x.to(acc)
            return x.view(self.kv_cache_dtype).to(acc) * scales[i]

        decode = meta.decode
        if decode is not None:
            tok_idx, tables, lens, max_len = decode
            n = tables.shape[0]
            # keys: [n, kv_heads, max_len, head_size]
            keys = pages(k_cache, tables, 0).reshape(n, max_len, hkv, d).transpose(1, 2)
            vals = pages(v_cache, tables, 1).reshape(n, max_len, hkv, d).transpose(1, 2)
            key_pos = torch.arange(max_len, device=q.device)[None, :]
            mask = key_pos < lens[:, None]  # [n, max_len]
            if layer.sliding_window is not None:  # the query sits at lens - 1
                mask &= key_pos > lens[:, None] - 1 - layer.sliding_window
            qd = (q if tok_idx is None else q[tok_idx]).unsqueeze(2)  # [n, heads, 1, head_size]
            o = self._attend(qd, keys, vals, mask[:, None, None, :], layer, gqa)
            if tok_idx is None:
                return o.squeeze(2).to(out.dtype)
            out[tok_idx] = o.squeeze(2).to(out.dtype)

        for start, end, ctx_len, blocks in meta.prefill:
            q_len = end - start
            keys = pages(k_cache, blocks, 0).reshape(-1, hkv, d)[:ctx_len].transpose(0, 1)  # [kv_heads, ctx, d]
            vals = pages(v_cache, blocks, 1).reshape(-1, hkv, d)[:ctx_len].transpose(0, 1)
            qp = q[start:end].transpose(0, 1)  # [heads, q_len, d]
            look = None if meta.lookahead is None else meta.lookahead[start:end, None]
            if ctx_len == q_len and layer.features == frozenset() and look is None:
                o = F.scaled_dot_product_attention(qp, keys, vals, is_causal=True, scale=self.scale, enable_gqa=gqa)
            else:
                # query i sits at absolute position ctx_len - q_len + i and sees keys 0..that position
                # (within its window: the last sliding_window of them), and its span's later keys
                qpos = torch.arange(ctx_len - q_len, ctx_len, device=q.device)[:, None]
                key_pos = torch.arange(ctx_len, device=q.device)[None, :]
                mask = key_pos <= (qpos if look is None else qpos + look)
                if layer.sliding_window is not None:
                    mask &= key_pos > qpos - layer.sliding_window
                o = self._attend(qp, keys, vals, mask, layer, gqa)
            out[start:end] = o.transpose(0, 1).to(out.dtype)
        return out

    def _attend(self, q: torch.Tensor, keys: torch.Tensor, vals: torch.Tensor, mask: torch.Tensor,
                layer: AttentionLayer, gqa: bool) -> torch.Tensor:
        """softmax(q k^T * scale, masked) v in float32: SDPA unless the layer soft-caps its scores or has
        sinks, then spelled out. q: [..., heads, lq, d]; keys, vals: [..., kv_heads, lk, d]; mask
        broadcasts to [..., heads, lq, lk] (True: attend)."""
        if layer.logits_soft_cap is None and layer.sinks is None:
            return F.scaled_dot_product_attention(q, keys, vals, attn_mask=mask, scale=self.scale, enable_gqa=gqa)
        if gqa:
            rep = self.num_heads // self.num_kv_heads
            keys, vals = keys.repeat_interleave(rep, dim=-3), vals.repeat_interleave(rep, dim=-3)
        scores = (q @ keys.transpose(-1, -2)) * self.scale  # [..., heads, lq, lk]
        if layer.logits_soft_cap is not None:
            cap = layer.logits_soft_cap
            scores = torch.tanh(scores / cap) * cap
        scores = scores.masked_fill(~mask, float("-inf"))
        if layer.sinks is not None:  # one more logit per head in each row's denominator
            sink = layer.sinks.to(scores.dtype).reshape(-1, 1, 1).expand(*scores.shape[:-1], 1)
            probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
        else:
            probs = torch.softmax(scores, dim=-1)
        return probs @ vals
