"""``torch``: the reference paged attention backend, built from PyTorch ops (CPU and CUDA).

Decode tokens (sequences with one query token) are batched into one SDPA call over keys gathered
through their block tables; every prefill chunk is one SDPA call over its cached prefix plus its new
tokens. Correctness first: the GPU backends are measured against this one.

An FP8 cache (``kv_cache_dtype``) is written as ``kv_write.quantize_kv`` stores it and read back as
``k8.float() * k_scale`` (``v8.float() * v_scale``): the gathered pages only, never the whole cache.
"""
from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from kvforge.attention import AttentionBackend, AttentionCapabilities, AttentionMetadata, BatchLayout, as_bytes
from kvforge.plugins.attention.kv_write import write_kv_torch


class TorchAttentionBackend(AttentionBackend):
    name = "torch"
    capabilities = AttentionCapabilities(
        devices=("cpu", "cuda"),
        dtypes=(torch.float32, torch.float16, torch.bfloat16),
        kv_cache_dtypes=(torch.float8_e4m3fn,),
        supports_cuda_graphs=False,
    )

    def build_metadata(self, layout: BatchLayout) -> AttentionMetadata:
        meta = super().build_metadata(layout)
        query_lens = layout.query_lens
        decode = np.nonzero(query_lens == 1)[0]
        prefill = np.nonzero(query_lens > 1)[0]
        bs = self.block_size
        if len(decode):
            dec_max_blocks = int(-(-layout.seq_lens[decode].max() // bs))
            dev = self.device
            all_decode = len(decode) == layout.num_seqs == layout.num_tokens
            meta.extra["decode"] = (
                # token index of each decode; None when the step is decode-only (token i = sequence i)
                None if all_decode else torch.from_numpy(layout.query_start_loc[decode].astype(np.int64)).to(dev),
                torch.from_numpy(np.ascontiguousarray(layout.block_tables[decode, :dec_max_blocks])).to(dev),
                torch.from_numpy(layout.seq_lens[decode].astype(np.int64)).to(dev),
                dec_max_blocks * bs,
            )
        # (token start, token end, context length, block ids) per prefill chunk, all host ints
        meta.extra["prefill"] = [
            (int(layout.query_start_loc[i]), int(layout.query_start_loc[i + 1]), int(layout.seq_lens[i]),
             meta.block_tables[i, : -(-int(layout.seq_lens[i]) // bs)])
            for i in prefill
        ]
        return meta

    def forward(self, q, k, v, kv_cache, meta: AttentionMetadata):
        # q: [num_tokens, num_heads, head_size]; k, v: [num_tokens, num_kv_heads, head_size]
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

        decode = meta.extra.get("decode")
        if decode is not None:
            tok_idx, tables, lens, max_len = decode
            n = tables.shape[0]
            # keys: [n, kv_heads, max_len, head_size]
            keys = pages(k_cache, tables, 0).reshape(n, max_len, hkv, d).transpose(1, 2)
            vals = pages(v_cache, tables, 1).reshape(n, max_len, hkv, d).transpose(1, 2)
            mask = (torch.arange(max_len, device=q.device)[None, :] < lens[:, None])[:, None, None, :]
            qd = (q if tok_idx is None else q[tok_idx]).unsqueeze(2)  # [n, heads, 1, head_size]
            o = F.scaled_dot_product_attention(qd, keys, vals, attn_mask=mask, scale=self.scale, enable_gqa=gqa)
            if tok_idx is None:
                return o.squeeze(2).to(out.dtype)
            out[tok_idx] = o.squeeze(2).to(out.dtype)

        for start, end, ctx_len, blocks in meta.extra["prefill"]:
            q_len = end - start
            keys = pages(k_cache, blocks, 0).reshape(-1, hkv, d)[:ctx_len].transpose(0, 1)  # [kv_heads, ctx, d]
            vals = pages(v_cache, blocks, 1).reshape(-1, hkv, d)[:ctx_len].transpose(0, 1)
            qp = q[start:end].transpose(0, 1)  # [heads, q_len, d]
            if ctx_len == q_len:
                o = F.scaled_dot_product_attention(qp, keys, vals, is_causal=True, scale=self.scale, enable_gqa=gqa)
            else:
                # query i sits at absolute position ctx_len - q_len + i and sees keys 0..that position
                qpos = torch.arange(ctx_len - q_len, ctx_len, device=q.device)
                mask = torch.arange(ctx_len, device=q.device)[None, :] <= qpos[:, None]
                o = F.scaled_dot_product_attention(qp, keys, vals, attn_mask=mask, scale=self.scale, enable_gqa=gqa)
            out[start:end] = o.transpose(0, 1).to(out.dtype)
        return out
