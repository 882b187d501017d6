"""Phi-3, Phi-3.5 and Phi-4 (``Phi3ForCausalLM``): Llama with fused checkpoints and LongRoPE.

The checkpoint already fuses ``self_attn.qkv_proj`` and ``mlp.gate_up_proj`` (the rows kvforge's fused
layers hold, in the same order), so each loads whole through the layer's loader, which takes this
rank's heads and columns under tensor parallelism. LongRoPE (``rope_scaling.rope_type == "longrope"``:
short and long factors, an attention factor on cos/sin) and Phi-4-mini's ``partial_rotary_factor``
are :class:`kvforge.plugins.models.llama.RotaryEmbedding`'s; ``sliding_window`` applies to every layer,
as in transformers.
"""
from __future__ import annotations

from kvforge.model.interface import ModelCapabilities
from kvforge.plugins.models.llama import LlamaForCausalLM


class Phi3ForCausalLM(LlamaForCausalLM):
    #: the checkpoint's modules are the fused ones (quantization formats name them)
    packed_modules_mapping: dict[str, list[str]] = {}
    capabilities = ModelCapabilities(sliding_window=True, notes="fused qkv/gate_up checkpoints, LongRoPE, partial rotary")
