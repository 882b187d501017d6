"""Accuracy measures of a quantized model against the real default model in float32 (its GGUF weights
dequantized), shared by the quantization tests (docs/quantization.md#accuracy):

- the mean KL divergence of the next-token distribution at every position of a fixed 1,000+-token text;
- greedy agreement over 8 prompts x 64 tokens, teacher-forced: the share of the float32 model's
  greedy tokens that the quantized model, fed the same prefix, also ranks first."""
from __future__ import annotations

import os

import numpy as np
import torch

from kvforge import LLM, SamplingParams, quantization
from kvforge.attention import BatchLayout
from kvforge.model.loader import default_model_path, load_model, load_model_config, resolve_model_source
from kvforge.plugin_manager import get_plugin_manager
from kvforge.plugins.attention.torch_backend import TorchAttentionBackend
from kvforge.tokenizer import load_tokenizer

PASSAGE = os.path.join(os.path.dirname(__file__), "plugins", "quantization", "passage.txt")
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Hello, my name is", "1, 2, 3, 4, 5,",
           "The quick brown fox", "Once upon a time, in a small village by the sea,",
           "Water boils at", "The best way to learn a language is"]


def passage_logits(model: str | None = None, quant: str | None = None, *, kv_cache_dtype: torch.dtype | None = None,
                   kv_scales: list[tuple[float, float]] | None = None, amax: list | None = None,
                   **options) -> tuple[torch.Tensor, int]:
    """float32 logits at every position of the passage for ``model`` (None: the default model), its
    linear layers quantized by ``quant`` (None: as its config.json says) with ``options``; the KV
    cache in ``kv_cache_dtype`` with per-layer ``kv_scales`` (k, v); ``amax``, a list that gets each
    layer's (max |K|, max |V|)."""
    src = resolve_model_source(model)
    mc = load_model_config(src)
    pm = get_plugin_manager()
    name = quantization.resolve(quantization.registered(pm), quant, mc)
    method = pm.get("quantization_method", name)(model_config=mc, **options) if name else None
    attn = TorchAttentionBackend(num_heads=mc.num_attention_heads, num_kv_heads=mc.num_key_value_heads,
                                 head_size=mc.head_dim, scale=mc.head_dim ** -0.5, block_size=16,
                                 dtype=torch.float32, device=torch.device("cpu"), kv_cache_dtype=kv_cache_dtype)
    for layer, (k_scale, v_scale) in enumerate(kv_scales or []):
        attn.set_kv_scales(layer, k_scale=k_scale, v_scale=v_scale)
    net = load_model(src, mc, attn, torch.float32, torch.device("cpu"), quant=method)
    if amax is not None:  # layers run in order, one forward call each
        forward = attn.forward

        def recording(q, k, v, *args):
            amax.append((k.abs().max().item(), v.abs().max().item()))
            return forward(q, k, v, *args)
        attn.forward = recording
    ids = load_tokenizer(default_model_path()).encode(open(PASSAGE).read())
    n = len(ids)
    blocks = -(-n // 16)
    layout = BatchLayout(np.array([0, n], np.int32), np.array([n], np.int32),
                         np.arange(blocks, dtype=np.int32)[None], np.arange(n, dtype=np.int64))
    with torch.no_grad():
        hidden = net(torch.tensor(ids), torch.arange(n), attn.allocate_kv_cache(blocks, mc.num_hidden_layers),
                     attn.build_metadata(layout))
        return net.compute_logits(hidden).float(), n


def mean_kl(got: torch.Tensor, ref: torch.Tensor) -> float:
    """Mean over positions of KL(reference || quantized) of the next-token distributions, in nats."""
    kl = torch.nn.functional.kl_div(got.log_softmax(-1), ref.log_softmax(-1), log_target=True, reduction="none")
    return kl.sum(-1).mean().item()


def reference_greedy(reference: LLM) -> list[tuple[list[int], list[int]]]:
    """The float32 model's (prompt ids, 64 greedy tokens) for each of the 8 prompts."""
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    return [(list(o.prompt_token_ids), list(o.outputs[0].token_ids))
            for o in reference.generate(PROMPTS, params, use_tqdm=False)]


def top1_agreement(quantized: LLM, greedy: list[tuple[list[int], list[int]]]) -> float:
    """The share of the reference's greedy tokens that ``quantized``, teacher-forced, ranks first."""
    hits = total = 0
    for ids, gen in greedy:
        scored = quantized.generate([{"prompt_token_ids": ids + gen}],
                                    SamplingParams(max_tokens=1, prompt_logprobs=1), use_tqdm=False)[0]
        for pos, token in enumerate(gen, start=len(ids)):
            hits += scored.prompt_logprobs[pos][token].rank == 1
            total += 1
    return hits / total
